"""The start-up memory rule (engine/memory_plan.py): adapter slots take a share of the
budget (unless --max-loras), the KV cache room for every sequence at full length within
what is left (unless --num-kv-blocks), capped by memory (on CPU by half the weights'
bytes too), never below one full-length sequence. Expected sizes are worked out from the
model's shapes here."""

from __future__ import annotations

from metrale import LLM
from metrale.engine.memory_plan import (
    MIN_AUTO_SLOTS,
    SLOT_SHARE,
    host_available_bytes,
    memory_budget,
    plan_memory,
)
from tests.helpers.tiny_models import make_model, save_model

MiB = 1 << 20
# SmolLM2-135M in float32: 30 layers, 3 KV heads of 64, 16-token blocks, K and V
BLOCK = 2 * 30 * 16 * 3 * 64 * 4
WEIGHTS = 134_515_008 * 4


def _kv(seqs, model_len, block, weights, free_bytes, cuda, slots=0, slot_bytes=0):
    """The plan's KV blocks (with `slots` given slots of slot_bytes) and its reason."""
    plan = plan_memory(slots, slot_bytes, None, seqs, model_len, 16, block, weights,
                       free_bytes, cuda)
    return plan.kv_blocks, plan.reason


def test_cpu_default_model_is_capped_by_its_weights():
    b = _kv(32, 2048, BLOCK, WEIGHTS, free_bytes=24 << 30, cuda=False)
    assert b[0] == (WEIGHTS // 2) // BLOCK == 364 and "weights" in b[1]
    assert b[0] * BLOCK <= 257 * MiB  # was a fixed 2 GiB


def test_room_for_every_sequence_when_it_fits():
    b = _kv(4, 100, BLOCK, WEIGHTS, free_bytes=24 << 30, cuda=False)
    assert b[0] == 4 * 7  # ceil(100 / 16) blocks per sequence


def test_capped_by_available_memory():
    b = _kv(32, 2048, BLOCK, WEIGHTS, free_bytes=200 * MiB, cuda=False)
    assert b[0] == (100 * MiB) // BLOCK and "available" in b[1]


def test_a_tiny_model_still_gets_64_mib():
    b = _kv(64, 4096, 6144, 500_000, free_bytes=24 << 30, cuda=False)
    assert b[0] == (64 << 20) // 6144 and "weights" in b[1]


def test_never_below_one_full_sequence():
    b = _kv(32, 2048, BLOCK, WEIGHTS, free_bytes=10 * MiB, cuda=False)
    assert b[0] == 128 and "one 2048-token sequence" in b[1]


def test_cuda_uses_most_of_the_free_device_memory():
    free = 40 << 30
    b = _kv(256, 8192, BLOCK, WEIGHTS, free_bytes=free, cuda=True)
    assert b[0] == int(0.8 * free) // BLOCK  # weights do not cap a GPU


# Llama-3-8B bf16, r16 all-linear: one slot's bytes (32 layers x 7 modules x r x (in + out))
SLOT_8B = 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 2 * (4096 + 14336) + 14336 + 4096) * 2
BLOCK_8B = 2 * 32 * 16 * 8 * 128 * 2


def test_an_h100_holds_about_sixty_8b_slots_beside_its_kv_cache():
    free = 62 << 30  # an 80 GB H100 after 16 GB of weights
    plan = plan_memory(None, SLOT_8B, None, 256, 8192, 16, BLOCK_8B, 16 << 30, free, cuda=True)
    budget = int(0.8 * free)
    assert plan.num_slots == int(SLOT_SHARE * budget) // SLOT_8B
    assert 55 <= plan.num_slots <= 64
    # the KV cache takes the rest of the budget, and nothing past it
    assert plan.kv_blocks == (budget - plan.num_slots * SLOT_8B) // BLOCK_8B
    assert plan.num_slots * SLOT_8B + plan.kv_blocks * BLOCK_8B <= budget
    assert "slots" in plan.describe() and "KV cache" in plan.describe()


def test_auto_slots_are_at_least_the_minimum_and_at_most_max_num_seqs():
    tiny = plan_memory(None, 1 << 10, None, 8, 64, 16, 4096, 1 << 20, 24 << 30, cuda=False)
    assert tiny.num_slots == 8  # the share would allow thousands of 1 KiB slots
    huge = plan_memory(None, 1 << 30, None, 256, 64, 16, 4096, 1 << 20, 2 << 30, cuda=True)
    assert huge.num_slots == MIN_AUTO_SLOTS  # the share holds none of 1 GiB
    few_seqs = plan_memory(None, 1 << 10, None, 2, 64, 16, 4096, 1 << 20, 24 << 30, cuda=False)
    assert few_seqs.num_slots == MIN_AUTO_SLOTS


def test_given_slots_and_blocks_are_kept():
    plan = plan_memory(7, SLOT_8B, 1234, 256, 8192, 16, BLOCK_8B, 16 << 30, 62 << 30, cuda=True)
    assert (plan.num_slots, plan.kv_blocks) == (7, 1234)
    budget, _ = memory_budget(62 << 30, 16 << 30, cuda=True)
    given = plan_memory(7, SLOT_8B, None, 256, 8192, 16, BLOCK_8B, 16 << 30, 62 << 30, cuda=True)
    assert given.kv_blocks == (budget - 7 * SLOT_8B) // BLOCK_8B


def test_host_available_bytes_is_plausible():
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert 0 < host_available_bytes() <= total


def test_engine_sizes_its_cache_by_the_rule(tmp_path):
    model = make_model("llama", seed=1)
    save_model(model, tmp_path / "m")
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    block = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * head_dim * 4
    weights = sum(p.numel() for p in model.parameters()) * 4
    llm = LLM(tmp_path / "m", max_model_len=64, max_num_seqs=8)
    # a tiny model's weights would allow a few blocks: 64 MiB hold every sequence
    assert (weights // 2) // block < 8 * 4 < (64 << 20) // block
    expected = 8 * 4
    assert llm.engine.runner.num_blocks == expected
    assert llm.engine.blocks.num_blocks == expected
    # slots from the same budget: tiny ones, so max_num_seqs of them
    assert len(llm.engine.slot_info()) == 8 == llm.engine.memory.num_slots


def test_help_states_the_rule():
    from metrale.cli import build_parser

    text = " ".join(_serve_help(build_parser()).split())
    assert "--max-num-seqs sequences of --max-model-len tokens" in text
    assert "half the model's weight bytes" in text


def _serve_help(parser) -> str:
    import argparse

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"].format_help()
