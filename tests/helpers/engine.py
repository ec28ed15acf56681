"""Driving an LLMEngine in tests: step until an event, never a fixed number of steps."""

from __future__ import annotations

from collections.abc import Callable

# A generous bound that only a hung engine reaches: between two iterations the engine
# either made progress or waited (wait_for_work) for its in-flight promotion to move.
_MAX_ITERATIONS = 20000
_WAIT_S = 0.05


def step_until(engine, done: Callable[[], bool], outputs: dict | None = None) -> None:
    """Step until done() holds; finished outputs are collected into `outputs`."""
    for _ in range(_MAX_ITERATIONS):
        if done():
            return
        produced = engine.step()
        for out in produced:
            if out.finished and outputs is not None:
                outputs[out.request_id] = out
        if not produced:
            engine.wait_for_work(_WAIT_S)
    raise AssertionError("the engine never reached the awaited state")


def run_until_done(engine) -> dict:
    """Step until every request finished; {request_id: final output}."""
    finished: dict = {}
    step_until(engine, lambda: not engine.has_unfinished_requests(), finished)
    return finished


def step_until_running(engine, request_id: str) -> None:
    """Until the request holds its adapter slot and has produced a token."""
    seq = engine.requests[request_id]
    step_until(engine, lambda: seq.bound and len(seq.output_ids) > 0)


def tiny_engine(model_dir, **kw):
    """An LLMEngine on CPU over model_dir (3 slots of rank 8, a small KV cache unless kw
    says otherwise; kw go to LLM)."""
    from metrale import LLM  # metrale: after conftest's triton switch

    args = dict(max_loras=3, max_lora_rank=8, block_size=4, max_model_len=64, num_kv_blocks=32)
    return LLM(model_dir, **{**args, **kw}).engine
