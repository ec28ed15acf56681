"""The sampling surface beyond temperature/top-k/top-p, each against a reference computed
from transformers (+ PEFT) logits: repetition, frequency and presence penalties,
logit_bias and min_p, applied on the device in the batched sampler with plain rows and
adapters in the same batch; n > 1 (the siblings run on the prompt's cached KV); prompt
logprobs. Bad values are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from metrale.engine.sampling_params import InvalidSamplingParamsError, SamplingParams
from tests.helpers.reference import prompts
from tests.helpers.tiny_models import make_adapter, saved_tiny_model

N = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("surface")
    base = saved_tiny_model(root / "model", seed=3)
    peft = {name: make_adapter(base, root / name, seed=20 + i, r=4, lora_alpha=8,
                               target_modules="all-linear") for i, name in enumerate("ab")}
    return {"root": root, "base": base, "peft": peft}


def _llm(world, **kw):
    from metrale import LLM

    llm = LLM(world["root"] / "model", **{**dict(max_loras=2, max_lora_rank=4, max_model_len=128,
                                                block_size=4, num_kv_blocks=256), **kw})
    for name in world["peft"]:
        llm.register_adapter(name, world["root"] / name)
    return llm


def _shaped_greedy(model, prompt: list[int], n: int, params: SamplingParams) -> tuple[list[int], list[float]]:
    """Greedy decoding of model's logits shaped as the parameters say, written out here
    from the definitions (HF's and vLLM's repetition penalty over prompt and output,
    OpenAI's frequency/presence penalties over the output, the bias added): the tokens
    and each step's gap between the two best shaped logits."""
    ids, out, gaps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            x = model(torch.tensor([ids])).logits[0, -1].float().clone()  # [V]
            for token, bias in params.logit_bias:
                x[token] += bias
            seen = torch.zeros_like(x, dtype=torch.bool)
            seen[torch.tensor(ids)] = True
            rep = params.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
            counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=x.numel()).float() \
                if out else torch.zeros_like(x)
            x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
            top2 = x.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            token = int(x.argmax())
            ids.append(token)
            out.append(token)
    return out, gaps


def _same_up_to_ties(got, want, gaps, label):
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert gaps[i] < 1e-4, f"{label}: token {i} is {g}, reference {w} (gap {gaps[i]})"
            return i
    assert len(got) == len(want), label
    return len(got)


SHAPED = [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.6),
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0),
    dict(frequency_penalty=-0.5, presence_penalty=1.0, repetition_penalty=1.2),
    dict(logit_bias={7: 4.0, 11: -100.0, 200: 2.5}),
    dict(logit_bias={"9": 100.0}),  # JSON sends ids as strings
]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_and_logit_bias_equal_the_reference_in_one_mixed_batch(world, async_scheduling):
    llm = _llm(world, async_scheduling=async_scheduling)
    prompt_list = prompts(5, 2)
    rows = []  # (prompt, params, adapter)
    for i, kw in enumerate(SHAPED):
        for j, adapter in enumerate((None, "a", "b")):
            rows.append((prompt_list[(i + j) % 2], SamplingParams(max_tokens=N, temperature=0,
                                                                  ignore_eos=True, **kw), adapter))
        rows.append((prompt_list[i % 2], SamplingParams(max_tokens=N, temperature=0,
                                                        ignore_eos=True), "a"))  # a plain row
    outs = llm.generate([p for p, _, _ in rows], [s for _, s, _ in rows], [a for _, _, a in rows])
    compared = 0
    for (prompt, params, adapter), out in zip(rows, outs):
        model = world["peft"][adapter] if adapter else world["base"]
        want, gaps = _shaped_greedy(model, prompt, N, params)
        compared += _same_up_to_ties(list(out.token_ids), want, gaps, f"{params} {adapter}")
    assert compared >= 0.9 * N * len(rows)
    # the biased row: token 9 every time, token 11 never
    biased = [o for (_, s, _), o in zip(rows, outs) if dict(s.logit_bias).get(9) == 100.0]
    assert biased and all(set(o.token_ids) == {9} for o in biased)
    assert llm.engine.token_counts.rows_in_use == 0  # every penalised row gave its counts back


def test_penalties_change_the_answer(world):
    """The reference above would pass for an engine ignoring the penalties only if they
    changed nothing: they do."""
    prompt = prompts(5, 1)[0]
    plain, _ = _shaped_greedy(world["base"], prompt, N, SamplingParams(temperature=0))
    for kw in SHAPED[:4]:
        shaped, _ = _shaped_greedy(world["base"], prompt, N, SamplingParams(temperature=0, **kw))
        assert shaped != plain, kw


def test_min_p_keeps_exactly_the_tokens_above_its_share_of_the_top():
    from metrale.engine.sampler import sample
    from metrale.engine.sequence import Sequence

    logits = torch.tensor([[2.0, 1.9, 1.0, 0.5, -3.0, 1.95]])
    probs = torch.softmax(logits[0], -1)
    for min_p, temperature in ((0.5, 1.0), (0.2, 1.0), (0.5, 0.7), (1.0, 1.0)):
        scaled = torch.softmax(logits[0] / temperature, -1)
        allowed = set((scaled >= min_p * scaled.max()).nonzero().flatten().tolist())
        drawn = set()
        for seed in range(300):
            seq = Sequence("r", [1], SamplingParams(temperature=temperature, min_p=min_p, seed=seed), None)
            drawn.add(sample(logits, [seq])[0].token)
        assert drawn == allowed, (min_p, temperature, probs)


def test_min_p_one_is_greedy_on_peft_logits(world):
    llm = _llm(world)
    prompt_list = prompts(9, 3)
    rows = [(p, a) for p in prompt_list for a in (None, "a", "b")]
    params = SamplingParams(max_tokens=N, temperature=1.0, min_p=1.0, ignore_eos=True)
    outs = llm.generate([p for p, _ in rows], params, [a for _, a in rows])
    for (prompt, adapter), out in zip(rows, outs):
        model = world["peft"][adapter] if adapter else world["base"]
        want, gaps = _shaped_greedy(model, prompt, N, SamplingParams(temperature=0))
        _same_up_to_ties(list(out.token_ids), want, gaps, f"min_p {adapter}")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_completions_share_the_prompt_kv_and_equal_their_own_requests(world, async_scheduling):
    llm = _llm(world, async_scheduling=async_scheduling)
    prompt = prompts(13, 1, shared_prefix=29)[0]  # >= 32 tokens: 8 full blocks of 4
    launched = llm.engine.scheduler.num_launched_tokens
    outs = llm.generate(prompt, SamplingParams(max_tokens=N, temperature=0, n=3, ignore_eos=True),
                        "a")
    assert [o.index for o in outs] == [0, 1, 2]
    want, _ = _shaped_greedy(world["peft"]["a"], prompt, N, SamplingParams(temperature=0))
    assert all(list(o.token_ids) == want for o in outs)
    # completions 1 and 2 found the prompt's full blocks in the cache: the prompt was
    # computed once, plus each sibling's last partial block
    full = (len(prompt) - 1) // 4 * 4
    assert [o.num_cached_tokens for o in outs[1:]] == [full, full]
    computed = llm.engine.scheduler.num_launched_tokens - launched
    assert computed <= len(prompt) + 2 * (len(prompt) - full) + 3 * N

    # seeded: completion i draws with seed + i, as its own request would
    sampled = SamplingParams(max_tokens=N, temperature=0.9, seed=41, n=2, ignore_eos=True)
    outs = llm.generate(prompt, sampled, "b")
    alone = [llm.generate(prompt, SamplingParams(max_tokens=N, temperature=0.9, seed=41 + i,
                                                 ignore_eos=True), "b")[0] for i in range(2)]
    assert [list(o.token_ids) for o in outs] == [list(o.token_ids) for o in alone]
    assert outs[0].token_ids != outs[1].token_ids


@pytest.mark.parametrize("adapter", [None, "a"])
def test_prompt_logprobs_equal_the_reference_even_with_the_prompt_cached(world, adapter):
    llm = _llm(world)
    prompt = prompts(17, 1, shared_prefix=20)[0]
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), adapter)  # cache it
    out = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3),
                       adapter)[0]
    model = world["peft"][adapter] if adapter else world["base"]
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)  # [P, V]
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        e, want = entries[p], lp[p - 1]
        assert e["token"] == prompt[p]
        torch.testing.assert_close(torch.tensor(e["logprob"]), want[prompt[p]], atol=2e-4, rtol=1e-4)
        assert e["rank"] == int((want > want[prompt[p]]).sum()) + 1
        top = want.topk(3)
        assert [i for i, _ in e["top"]] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in e["top"]]), top.values, atol=2e-4,
                                   rtol=1e-4)


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", float("nan")), ("frequency_penalty", -3),
    ("frequency_penalty", "1"), ("repetition_penalty", 0), ("repetition_penalty", -1.0),
    ("repetition_penalty", 2.5), ("min_p", 1.5), ("min_p", -0.1), ("n", 0), ("n", 65),
    ("n", 2.0), ("logit_bias", {"x": 1.0}), ("logit_bias", {5: 101.0}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", [1, 2]), ("prompt_logprobs", 21),
    ("prompt_logprobs", -1), ("structured", "json")])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and field in str(info.value)


def test_a_logit_bias_token_outside_the_vocabulary_is_refused(world):
    llm = _llm(world)
    vocab = world["base"].config.vocab_size
    with pytest.raises(InvalidSamplingParamsError) as info:
        llm.engine.add_request([1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert info.value.param == "logit_bias"
    assert not llm.engine.requests


def test_only_running_sequences_hold_count_rows(world):
    """A queued penalised request holds no device memory: its row is taken at its first
    draw and given back when it ends."""
    from tests.helpers.engine import step_until

    engine = _llm(world, max_num_seqs=2).engine
    params = SamplingParams(max_tokens=4, temperature=0, presence_penalty=1.0, ignore_eos=True)
    for prompt in prompts(21, 8):
        engine.add_request(prompt, params)
    assert engine.token_counts.rows_in_use == 0
    step_until(engine, lambda: engine.token_counts.rows_in_use > 0)
    most = 0

    def done() -> bool:
        nonlocal most
        most = max(most, engine.token_counts.rows_in_use)
        return not engine.has_unfinished_requests()

    step_until(engine, done)  # 8 requests, 2 at a time
    assert 0 < most <= 2 and engine.token_counts.rows_in_use == 0
