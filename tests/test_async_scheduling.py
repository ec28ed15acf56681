"""Async scheduling (a step launched before the previous step's outputs are processed,
its pending input tokens read on the device): the same tokens as transformers + PEFT,
with requests ending at different steps (length, EOS), mixed adapters with promotions
and evictions, prefix-cache hits, preemption, aborts while a step is in flight, and the
rows that need their logits on the host (seeds, logprobs). On the CPU every step is
complete when launched, so these check the host's bookkeeping of pending tokens; the
GPU test in test_cuda_graphs checks the device side."""

from __future__ import annotations

import random

import pytest

from metrale import LLM, SamplingParams
from tests.helpers.engine import run_until_done, step_until
from tests.helpers.reference import hf_greedy, prompts
from tests.helpers.tiny_models import make_adapter, make_model, save_model

GEN = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    base = make_model("llama", seed=3)
    save_model(base, root / "model")
    peft = {}
    for i, (name, kw) in enumerate({
        "a": dict(r=8, lora_alpha=16, target_modules="all-linear"),
        "b": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
        "c": dict(r=6, lora_alpha=3, target_modules=["k_proj", "o_proj", "up_proj"]),
    }.items()):
        peft[name] = make_adapter(base, root / name, seed=10 + i, **kw)
    return root, base, peft


def _llm(root, model: str = "model", **kw) -> LLM:
    args = dict(max_loras=2, max_lora_rank=8, block_size=4, max_model_len=128,
                num_kv_blocks=256, max_num_seqs=8, async_scheduling=True)
    llm = LLM(root / model, **{**args, **kw})
    for name in "abc":
        llm.register_adapter(name, root / name)
    return llm


def _reference(setup, name, prompt, n=GEN) -> list[int]:
    _, base, peft = setup
    model = base if name is None else peft[name]
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    return hf_greedy(model, prompt, n)[0]


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.mark.parametrize("kv", ["roomy", "preempting"])
def test_mixed_adapters_and_lengths_match_peft(setup, kv):
    """12 requests over 3 adapters and base on 2 slots, each with its own max_tokens (so
    requests leave at different steps while the next step is already planned)."""
    root = setup[0]
    kw = dict(num_kv_blocks=14, max_num_seqs=6, async_promotions=False) if kv == "preempting" else {}
    llm = _llm(root, **kw)
    ps = prompts(1, 12, shared_prefix=8)
    names = ["a", "b", "c", None, "a", "c", "b", None, "a", "b", "c", "a"]
    lengths = [random.Random(i).randrange(1, GEN + 1) for i in range(12)]
    outs = llm.generate(ps, [_greedy(n) for n in lengths], names)
    for p, name, n, out in zip(ps, names, lengths, outs):
        assert out.token_ids == _reference(setup, name, p, n), (name, n)
        assert out.finish_reason == "length"
    engine = llm.engine
    assert engine.adapters.num_promotions >= 3
    if kv == "preempting":
        assert engine.scheduler.num_preemptions > 0
    engine.check_integrity()
    assert all(info.ref_count == 0 for info in engine.slot_info())
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_blocks_filled_by_decoding_are_cached(setup, async_scheduling):
    """A block completed by decoded tokens is keyed once those tokens reach the host
    (one may be in flight when its KV is scheduled): a follow-up prompt that repeats
    the conversation hits every block whose KV was computed."""
    llm = _llm(setup[0], async_scheduling=async_scheduling)
    p = prompts(8, 1)[0]
    first = llm.generate(p, _greedy(GEN), "a")[0]
    follow = p + list(first.token_ids) + [7]
    out = llm.generate(follow, _greedy(4), "a")[0]
    # the last sampled token was never fed back: its KV is not there
    assert out.num_cached_tokens == (len(p) + GEN - 1) // 4 * 4
    assert out.token_ids == _reference(setup, "a", follow, 4)


def test_eos_ends_requests_at_different_steps(setup, tmp_path):
    """An EOS token (the model's config) ends some requests mid-batch while the step
    after it is already launched: their output is exactly transformers' up to EOS."""
    root, base, peft = setup
    ps = prompts(4, 8)
    names = ["a", None, "b", "c", None, "a", "b", "c"]
    refs = [_reference(setup, n, p) for n, p in zip(names, ps)]
    # an EOS that some continuations reach after a few tokens and others never do
    eos = next(t for r in refs for t in r[2:5] if t not in r[:2])
    save_model(make_model("llama", seed=3, eos_token_id=eos), tmp_path / "model")
    for name in "abc":
        (tmp_path / name).symlink_to(root / name)
    llm = _llm(tmp_path)
    outs = llm.generate(ps, SamplingParams(max_tokens=GEN, temperature=0), names)
    stopped = 0
    for ref, out in zip(refs, outs):
        want = ref[:ref.index(eos) + 1] if eos in ref else ref
        assert out.token_ids == want
        assert out.finish_reason == ("stop" if eos in ref else "length")
        stopped += eos in ref
    assert 0 < stopped < len(ps)
    # min_tokens suppresses that EOS: counted with the token still in flight
    out = llm.generate(ps[0], SamplingParams(max_tokens=GEN, temperature=0, min_tokens=GEN),
                       names[0])[0]
    assert len(out.token_ids) == GEN and eos not in out.token_ids


@pytest.mark.parametrize("async_scheduling,first", [(True, ["run", "run", "process"]),
                                                    (False, ["run", "process", "run"])])
def test_the_next_step_launches_before_outputs_are_processed(setup, monkeypatch,
                                                            async_scheduling, first):
    """The overlap is real: with async scheduling, step N+1 is queued before step N's
    tokens are turned into outputs; without it, never."""
    engine = _llm(setup[0], async_scheduling=async_scheduling).engine
    events = []
    run, process = engine.runner.run, engine.output_processor.process
    monkeypatch.setattr(engine.runner, "run",
                        lambda *a, **k: events.append("run") or run(*a, **k))
    monkeypatch.setattr(engine.output_processor, "process",
                        lambda *a, **k: events.append("process") or process(*a, **k))
    engine.add_request(prompts(5, 1)[0], _greedy(4))
    produced = engine.step()
    assert len(produced) == (0 if async_scheduling else 1)
    assert engine.wait_for_work(0) is async_scheduling  # no sleeping on a launched step
    run_until_done(engine)
    assert events[:3] == first


def test_seeded_and_logprob_rows_beside_overlapped_ones(setup):
    """Rows that read their logits on the host (a seed, logprobs) run the step
    synchronously; greedy rows beside them still match PEFT, and a seed's tokens
    are the same as in a synchronous engine."""
    root = setup[0]
    ps = prompts(6, 6)
    names = ["a", "b", None, "c", "a", None]
    params = [_greedy(GEN), _greedy(GEN, logprobs=2),
              SamplingParams(max_tokens=GEN, temperature=0.8, seed=11, ignore_eos=True),
              _greedy(GEN), SamplingParams(max_tokens=GEN, temperature=0.7, seed=3, ignore_eos=True),
              _greedy(GEN)]
    outs = _llm(root).generate(ps, params, names)
    sync = _llm(root, async_scheduling=False).generate(ps, params, names)
    for i in (0, 1, 3, 5):
        assert outs[i].token_ids == _reference(setup, names[i], ps[i])
    assert [lp["token"] for lp in outs[1].logprobs] == outs[1].token_ids
    for i in (2, 4):
        assert outs[i].token_ids == sync[i].token_ids


def test_abort_while_a_step_is_in_flight(setup):
    """An aborted request gets no output from the step already launched for it, its KV
    and slot come back, and the others are unchanged."""
    root = setup[0]
    engine = _llm(root).engine
    ps = prompts(7, 4)
    names = ["a", "b", None, "a"]
    ids = [engine.add_request(p, _greedy(GEN), n) for p, n in zip(ps, names)]
    done: dict = {}
    step_until(engine, lambda: bool(engine.requests[ids[1]].output_ids), done)
    assert engine.wait_for_work(0)  # a step is in flight: it computes ids[1]'s next token
    engine.abort(ids[1])
    done.update(run_until_done(engine))
    assert ids[1] not in done
    for i in (0, 2, 3):
        assert done[ids[i]].token_ids == _reference(setup, names[i], ps[i])
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert all(info.ref_count == 0 for info in engine.slot_info())


def test_requests_ending_at_max_model_len(setup):
    """Requests that reach max_model_len with their last token in flight: exact, and
    ended by length (no step is planned past them)."""
    llm = _llm(setup[0], max_model_len=24)
    ps = prompts(9, 3)
    ns = [24 - len(p) for p in ps]
    outs = llm.generate(ps, [_greedy(n) for n in ns], ["a", None, "b"])
    for p, n, name, out in zip(ps, ns, ["a", None, "b"], outs):
        assert out.token_ids == _reference(setup, name, p, n)
        assert out.finish_reason == "length"
