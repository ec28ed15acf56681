"""Tensor parallelism on CPU (issue 53): a tiny Llama, Qwen2 and Qwen3 split over two
processes (gloo) give the greedy tokens of transformers + PEFT and of one process, with
mixed adapters in a batch, swaps (host-tier images among them), a landing one rank refuses
or rank 0's whole check refuses (every rank's slot EMPTY after it) and a promotion while
other requests decode; rank 0's slots hold only its slice. One TP engine per model serves
every case (a spawn costs seconds on 2 cores)."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from metrale import LLM
from metrale.cli import build_parser
from metrale.config import ConfigError, EngineConfig, ModelConfig, PoolConfig, TensorParallelSizeError
from metrale.engine.llm_engine import LLMEngine
from metrale.engine.sampling_params import InvalidSamplingParamsError, SamplingParams
from metrale.errors import LandingError, ShardLandingError, WeightsLandingError
from metrale.model.parallel import MULTICAST_OFF, Shard, check_tensor_parallel, shard_config
from metrale.peer.exporter import AdapterExporter
from metrale.pool.landing import Landing
from metrale.pool.landing_area import SlicedServing
from metrale.pool.layout import SlotLayout
from metrale.pool.slots import SlotState
from metrale.pool.swap import LoraSlots, Prepared
from tests.helpers.engine import run_until_done, step_until, step_until_running
from tests.helpers.reference import hf_greedy, prompts
from tests.helpers.tiny_models import make_adapter, saved_tiny_model
from tests.helpers.tp import worker_hooks

# spawns a second process that wants a core of its own: `make test` runs these after the
# parallel workers, in a pytest process of their own
pytestmark = [pytest.mark.alone, pytest.mark.slow]

# every projection, so both splits of LoRA (column- and row-parallel) are exercised
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
N = 8  # greedy tokens per request


def _config(tp: int) -> EngineConfig:
    # a host tier: a landing of files landed before is a whole image, sliced like the rest
    return EngineConfig(pool=PoolConfig(max_loras=3, max_lora_rank=4, host_tier_bytes=8 << 20),
                        max_model_len=64, block_size=4, num_kv_blocks=64, tensor_parallel_size=tp)


def _greedy(n: int = N) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _generate(engine: LLMEngine, requests: list[tuple[list[int], str | None]],
              n: int = N) -> list[list[int]]:
    """All requests in one batch; their token ids in order."""
    ids = [engine.add_request(p, _greedy(n), a) for p, a in requests]
    outs = run_until_done(engine)
    return [list(outs[i].token_ids) for i in ids]


# qwen2: biased qkv; qwen3: head_dim != hidden / heads and per-head q/k norms
@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tp(request, tmp_path_factory):
    """A tiny model of the arch, adapters a, b, c on all its projections (their PEFT
    models), and a TP=2 engine with a, b registered whose rank 1 spoils its slice of
    the next landing while `flag` exists."""
    root = tmp_path_factory.mktemp(f"tp-{request.param}")
    base = saved_tiny_model(root / "model", request.param)
    peft = {name: make_adapter(base, root / name, seed=i + 1, r=4, lora_alpha=8,
                               target_modules=TARGETS)
            for i, name in enumerate(("a", "b", "c"))}
    flag, env_file = root / "poison", root / "rank1-env.json"
    # two ranks on a 2-core machine: one thread each (a worker takes rank 0's count);
    # restored after, for the modules that run next
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine(root / "model", _config(2),
                       tp_worker_init=functools.partial(worker_hooks, str(flag), str(env_file)))
    try:
        for name in ("a", "b"):
            engine.register_adapter(name, root / name)
        yield SimpleNamespace(arch=request.param, root=root, base=base, peft=peft,
                              engine=engine, flag=flag, env_file=env_file)
    finally:
        engine.close()
        torch.set_num_threads(threads)
    assert engine.tp.worker_exitcodes == [0]  # a clean stop, no abort at its exit


def _want(tp, adapter: str | None, prompt: list[int], n: int = N) -> list[int]:
    """transformers + PEFT's greedy tokens."""
    return hf_greedy(tp.peft[adapter] if adapter else tp.base, prompt, n)[0]


def test_nvlink_multicast_is_off_in_every_process(tp):
    assert {k: os.environ.get(k) for k in MULTICAST_OFF} == MULTICAST_OFF  # rank 0
    assert json.loads(tp.env_file.read_text()) == MULTICAST_OFF  # a spawned worker


def _all_ranks_slot(tp, slot: int) -> list[SlotState]:
    """The slot's state on rank 0, then on each worker."""
    return [tp.engine.slot_info()[slot].state] + [infos[slot].state
                                                  for infos in tp.engine.tp.slot_infos()]


def test_mixed_adapters_in_one_batch_equal_peft_and_one_process(tp):
    requests = [(p, a) for p in prompts(7, 2) for a in (None, "a", "b")]
    got = _generate(tp.engine, requests)
    assert got == [_want(tp, a, p) for p, a in requests]
    single = LLMEngine(tp.root / "model", _config(1))
    for name in ("a", "b"):
        single.register_adapter(name, tp.root / name)
    assert got == _generate(single, requests)


def test_swaps_between_requests(tp):
    # the slot's earlier adapter leaves nothing behind; b's files the second time are the
    # host tier's whole image of its first landing, sliced like any landing
    tier = tp.engine.lora.host_tier
    for i, name in enumerate(("b", "c", "b")):
        hits = tier.hits
        tp.engine.swap_lora_slot_from_disk(tp.root / name, f"swap{i}", 2)
        assert i < 2 or tier.hits == hits + 1
        p = prompts(20 + i, 1)[0]
        assert _generate(tp.engine, [(p, f"swap{i}")]) == [_want(tp, name, p)]
    assert _all_ranks_slot(tp, 2) == [SlotState.READY] * 2


def test_a_slice_refused_on_one_rank_leaves_every_rank_empty(tp):
    tp.flag.touch()
    with pytest.raises(LandingError, match="rank 1"):
        tp.engine.swap_lora_slot_from_disk(tp.root / "a", "spoiled", 2)
    assert not tp.flag.exists()  # rank 1 did spoil its slice: the refusal was its own check
    assert _all_ranks_slot(tp, 2) == [SlotState.EMPTY] * 2
    tp.engine.check_integrity()
    # the next landing into that slot, and the next requests, are served correctly
    tp.engine.swap_lora_slot_from_disk(tp.root / "c", "after", 2)
    requests = [(prompts(30, 1)[0], "after"), (prompts(31, 1)[0], None)]
    assert _generate(tp.engine, requests) == [_want(tp, "c", requests[0][0]),
                                              _want(tp, None, requests[1][0])]


def test_refusals_and_unloads_empty_the_slot_on_every_rank(tp):
    make_adapter(tp.base, tp.root / "dora", seed=9, r=4, lora_alpha=8, target_modules=TARGETS,
                 use_dora=True)
    with pytest.raises(LandingError, match="DoRA"):  # rank 0's own answer in the agreement
        tp.engine.swap_lora_slot_from_disk(tp.root / "dora", "dora", 1)
    assert _all_ranks_slot(tp, 1) == [SlotState.EMPTY] * 2
    tp.engine.swap_lora_slot_from_disk(tp.root / "b", "unloaded", 1)
    assert _all_ranks_slot(tp, 1) == [SlotState.READY] * 2
    assert tp.engine.unload_adapter("unloaded") == "unloaded"
    assert _all_ranks_slot(tp, 1) == [SlotState.EMPTY] * 2


def test_a_landing_failed_on_rank_0_empties_the_slot_on_every_rank(tp, monkeypatch):
    tp.engine.swap_lora_slot_from_disk(tp.root / "b", "held", 1)
    assert _all_ranks_slot(tp, 1) == [SlotState.READY] * 2

    def broken(landing, **source):
        raise OSError("the device copy failed")

    # rank 0 is this process; c's files may come staged or as a host-tier image
    monkeypatch.setattr(Landing, "write_staged", broken)
    monkeypatch.setattr(Landing, "write_image", broken)
    with pytest.raises(LandingError, match="device copy"):
        tp.engine.swap_lora_slot_from_disk(tp.root / "c", "broken", 1)
    assert _all_ranks_slot(tp, 1) == [SlotState.EMPTY] * 2  # the workers never landed


def test_a_nan_in_the_whole_adapter_is_refused_before_any_rank_commits(tp):
    engine = tp.engine
    engine.swap_lora_slot_from_disk(tp.root / "b", "before_nan", 1)
    assert _all_ranks_slot(tp, 1) == [SlotState.READY] * 2
    staged = engine.lora.prepare_disk(tp.root / "a", "nan", use_tier=False)
    plan = engine.lora.plan_from_disk(tp.root / "a", "nan")

    def write(landing: Landing) -> None:
        staged.write(landing)
        landing.slot_range(plan)  # bytes no check has seen, as a transport's: verified at commit
        b = landing.layout.region(0, "q_proj", "B")  # Bt [max_rank, out], whole
        # the last output column: rank 1's half, so rank 0's own slice stays finite
        landing.tensors.data[b.offset + b.cols - 1] = float("nan")

    with pytest.raises(WeightsLandingError, match="NaN") as refused:
        engine.swap_lora_slot_from_disk(tp.root / "a", "nan", 1, prepared=Prepared(write))
    assert not isinstance(refused.value.__cause__, ShardLandingError)  # no rank was asked
    assert _all_ranks_slot(tp, 1) == [SlotState.EMPTY] * 2
    assert not engine.lora.pool.slot_tensors[1].data.any()  # rank 0's slice never landed
    engine.check_integrity()


def test_rank_0_slots_hold_only_its_slice(tp):
    """Rank 0's pool is laid out as a worker's: each slot its slice (B of column-parallel
    and A of row-parallel modules split, the other factor whole), beside a landing area of
    whole slots; the memory plan counts them so."""
    engine, cfg = tp.engine, _config(2)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    pool_cfg = replace(cfg.pool, max_loras=engine.memory.num_slots)
    one_process = LoraSlots(engine.model_config, pool_cfg, "cpu", torch.float32).pool
    sliced = SlotLayout(shard_config(engine.model_config, 2), pool_cfg, torch.float32)
    rank0 = nbytes(engine.lora.pool.buffer)
    assert rank0 == pool_cfg.max_loras * sliced.slot_bytes < nbytes(one_process.buffer)
    area = engine.lora.area
    assert area.nbytes == 2 * one_process.layout.slot_bytes  # async promotions: 2 open at once
    assert (engine.memory.slot_bytes, engine.memory.area_bytes) == (sliced.slot_bytes, area.nbytes)
    print(f"\n{tp.arch}: slots {rank0} B on rank 0 (TP=2) vs "
          f"{nbytes(one_process.buffer)} B (TP=1), landing area {area.nbytes} B")


def test_promotion_while_others_decode(tp):
    engine = tp.engine
    engine.register_adapter("late", tp.root / "c")  # not resident: promoted on demand
    long_prompt, late_prompt = prompts(40, 2)
    long_id = engine.add_request(long_prompt, _greedy(30), "a")
    step_until_running(engine, long_id)
    late_id = engine.add_request(late_prompt, _greedy(), "late")
    long_seq, late_seq = engine.requests[long_id], engine.requests[late_id]
    step_until(engine, lambda: late_seq.bound)  # its landing committed on every rank
    assert long_seq.finish_reason is None and 0 < len(long_seq.output_ids) < 30
    outs = run_until_done(engine)
    assert list(outs[long_id].token_ids) == _want(tp, "a", long_prompt, 30)
    assert list(outs[late_id].token_ids) == _want(tp, "c", late_prompt)


def test_a_swap_while_a_promotion_writes(tp, monkeypatch):
    """Two landings open at once on rank 0, each in its own landing-area slot: a promotion
    whose write (on the reader thread) is held, and a swap run inline meanwhile."""
    engine = tp.engine
    peft_d = make_adapter(tp.base, tp.root / "d", seed=7, r=4, lora_alpha=8,
                          target_modules=TARGETS)  # files never landed: read, not a tier image
    writing, release = threading.Event(), threading.Event()
    original = Landing.write_staged

    def write_staged(landing, staged):
        if threading.current_thread().name.startswith("metrale-read"):
            writing.set()
            release.wait(30)
        return original(landing, staged)

    monkeypatch.setattr(Landing, "write_staged", write_staged)
    engine.register_adapter("promoted", tp.root / "d")
    p_promoted, p_inline = prompts(50, 2)
    promoted_id = engine.add_request(p_promoted, _greedy(), "promoted")
    step_until(engine, writing.is_set)
    busy = engine.adapters.job.slot
    try:
        engine.swap_lora_slot_from_disk(tp.root / "a", "inline", (busy + 1) % 3)
        assert engine.adapters.promoting() == "promoted"  # its landing stayed open throughout
    finally:
        release.set()
    inline_id = engine.add_request(p_inline, _greedy(), "inline")
    outs = run_until_done(engine)
    assert list(outs[promoted_id].token_ids) == hf_greedy(peft_d, p_promoted, N)[0]
    assert list(outs[inline_id].token_ids) == _want(tp, "a", p_inline)
    engine.check_integrity()


def test_prompt_logprobs_are_refused_not_deadlocked(tp):
    with pytest.raises(InvalidSamplingParamsError, match="prompt_logprobs"):
        tp.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert not tp.engine.has_unfinished_requests()


def test_a_size_the_model_cannot_split_is_refused(tiny_model_dir):
    with pytest.raises(TensorParallelSizeError):
        EngineConfig(tensor_parallel_size=0)
    before = len(multiprocessing.active_children())
    with pytest.raises(TensorParallelSizeError, match="attention heads"):  # 4 heads
        LLM(tiny_model_dir, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="async_scheduling"):
        LLMEngine(tiny_model_dir, replace(_config(2), async_scheduling=True))
    assert len(multiprocessing.active_children()) == before  # refused before any spawn
    cfg = ModelConfig.from_dir(tiny_model_dir)  # 4 heads, 2 KV heads, intermediate 96
    with pytest.raises(TensorParallelSizeError, match="KV heads"):
        check_tensor_parallel(cfg, 4)
    with pytest.raises(TensorParallelSizeError, match="intermediate size"):
        check_tensor_parallel(replace(cfg, intermediate_size=97), 2)


def test_a_sliced_pool_is_not_exported(tiny_model_dir):
    model = ModelConfig.from_dir(tiny_model_dir)
    slots = LoraSlots(model, PoolConfig(max_loras=2, max_lora_rank=4), "cpu", torch.float32,
                      sliced=SlicedServing(shard_config(model, 2), Shard(0, 2), 1))
    with pytest.raises(ConfigError, match="slices"):  # a peer would get rank 0's part only
        AdapterExporter(slots, None)


def test_serve_takes_the_flag():
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2
