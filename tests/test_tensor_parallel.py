"""Tensor parallelism on CPU (issue 53): a tiny Llama, Qwen2 and Qwen3 split over two
processes (gloo) give the greedy tokens of transformers + PEFT and of one process, with
mixed adapters in a batch, swaps, a landing one rank refuses (every rank's slot EMPTY
after it) and a promotion while other requests decode. One TP engine per model serves
every case (a spawn costs seconds on 2 cores)."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from metrale import LLM
from metrale.cli import build_parser
from metrale.config import ConfigError, EngineConfig, ModelConfig, PoolConfig, TensorParallelSizeError
from metrale.engine.llm_engine import LLMEngine
from metrale.engine.sampling_params import InvalidSamplingParamsError, SamplingParams
from metrale.errors import LandingError
from metrale.model.parallel import MULTICAST_OFF, check_tensor_parallel
from metrale.pool.landing import Landing
from metrale.pool.slots import SlotState
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
    return EngineConfig(pool=PoolConfig(max_loras=3, max_lora_rank=4), max_model_len=64,
                        block_size=4, num_kv_blocks=64, tensor_parallel_size=tp)


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
        yield SimpleNamespace(root=root, base=base, peft=peft, engine=engine, flag=flag,
                              env_file=env_file)
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
    for i, name in enumerate(("b", "c")):  # the slot's earlier adapter leaves nothing behind
        tp.engine.swap_lora_slot_from_disk(tp.root / name, f"swap{i}", 2)
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

    def broken(landing, staged):
        raise OSError("the device copy failed")

    monkeypatch.setattr(Landing, "write_staged", broken)  # rank 0 is this process
    with pytest.raises(LandingError, match="device copy"):
        tp.engine.swap_lora_slot_from_disk(tp.root / "c", "broken", 1)
    assert _all_ranks_slot(tp, 1) == [SlotState.EMPTY] * 2  # the workers never landed


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


def test_serve_takes_the_flag():
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2
