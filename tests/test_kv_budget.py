"""The KV cache's size when --num-kv-blocks is not given: room for every sequence at full
length, capped by memory (and on CPU by half the weights' bytes), never below one
full-length sequence. Expected sizes are worked out from the model's shapes here."""

from __future__ import annotations

from metrale import LLM
from metrale.engine.kv_budget import auto_kv_blocks, host_available_bytes
from tests.helpers.tiny_models import make_model, save_model

MiB = 1 << 20
# SmolLM2-135M in float32: 30 layers, 3 KV heads of 64, 16-token blocks, K and V
BLOCK = 2 * 30 * 16 * 3 * 64 * 4
WEIGHTS = 134_515_008 * 4


def test_cpu_default_model_is_capped_by_its_weights():
    b = auto_kv_blocks(32, 2048, 16, BLOCK, WEIGHTS, free_bytes=24 << 30, cuda=False)
    assert b.num_blocks == (WEIGHTS // 2) // BLOCK == 364 and "weights" in b.reason
    assert b.num_blocks * BLOCK <= 257 * MiB  # was a fixed 2 GiB


def test_room_for_every_sequence_when_it_fits():
    b = auto_kv_blocks(4, 100, 16, BLOCK, WEIGHTS, free_bytes=24 << 30, cuda=False)
    assert b.num_blocks == 4 * 7  # ceil(100 / 16) blocks per sequence


def test_capped_by_available_memory():
    b = auto_kv_blocks(32, 2048, 16, BLOCK, WEIGHTS, free_bytes=200 * MiB, cuda=False)
    assert b.num_blocks == (100 * MiB) // BLOCK and "available" in b.reason


def test_a_tiny_model_still_gets_64_mib():
    b = auto_kv_blocks(64, 4096, 16, 6144, weight_bytes=500_000, free_bytes=24 << 30, cuda=False)
    assert b.num_blocks == (64 << 20) // 6144 and "weights" in b.reason


def test_never_below_one_full_sequence():
    b = auto_kv_blocks(32, 2048, 16, BLOCK, WEIGHTS, free_bytes=10 * MiB, cuda=False)
    assert b.num_blocks == 128 and "one 2048-token sequence" in b.reason


def test_cuda_uses_most_of_the_free_device_memory():
    free = 40 << 30
    b = auto_kv_blocks(256, 8192, 16, BLOCK, WEIGHTS, free_bytes=free, cuda=True)
    assert b.num_blocks == int(0.8 * free) // BLOCK  # weights do not cap a GPU


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
    llm = LLM(tmp_path / "m", max_loras=1, max_model_len=64, max_num_seqs=8)
    # a tiny model's weights would allow a few blocks: 64 MiB hold every sequence
    assert (weights // 2) // block < 8 * 4 < (64 << 20) // block
    expected = 8 * 4
    assert llm.engine.runner.num_blocks == expected
    assert llm.engine.blocks.num_blocks == expected


def test_help_states_the_rule():
    from metrale.cli import build_parser

    text = " ".join(_serve_help(build_parser()).split())
    assert "--max-num-seqs sequences of --max-model-len tokens" in text
    assert "half the model's weight bytes" in text


def _serve_help(parser) -> str:
    import argparse

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"].format_help()
