"""Nothing in a request's sampling parameters can stop the engine: SamplingParams
refuses what the sampler cannot use (with the field's name), the sampler turns one
row's bad logits into that sequence's error, and the engine fails that sequence
alone while the rest of the batch decodes exactly as it would have without it."""

from __future__ import annotations

import math

import pytest
import torch

import metrale.engine.runner as runner_module
from metrale import LLM
from metrale.engine.sampler import SampleResult, sample
from metrale.engine.sampling_params import (
    GREEDY_EPS,
    MAX_TOKENS,
    InvalidSamplingParamsError,
    SamplingParams,
)
from metrale.engine.sequence import Sequence
from metrale.errors import SamplingError
from tests.helpers.engine import run_until_done
from tests.helpers.tiny_models import make_adapter, make_model, save_model

NAN, INF = math.nan, math.inf

# --- SamplingParams ------------------------------------------------------------------------

REFUSED = [
    ("temperature", NAN), ("temperature", INF), ("temperature", -INF), ("temperature", -1e-9),
    ("temperature", 2.0000001), ("temperature", 10**400), ("temperature", True),
    ("temperature", "0.5"), ("temperature", None),
    ("top_p", 0.0), ("top_p", -0.0), ("top_p", 1.0000001), ("top_p", NAN), ("top_p", INF),
    ("top_p", False), ("top_p", "1"),
    ("top_k", -2), ("top_k", 1.5), ("top_k", 3.0), ("top_k", True), ("top_k", NAN),
    ("seed", 2**64), ("seed", -2**63 - 1), ("seed", 10**400), ("seed", True), ("seed", 1.0),
    ("seed", "7"),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", MAX_TOKENS + 1), ("max_tokens", True),
    ("max_tokens", 5.0), ("max_tokens", INF),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", True), ("logprobs", 2.0),
    ("stop", [""]), ("stop", ""), ("stop", [1]), ("stop", 5), ("stop", ["x"] * 17),
    ("stop", ["x" * 1025]), ("stop", [None]),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
]


@pytest.mark.parametrize("field, value", REFUSED)
def test_out_of_range_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and field in str(info.value)


def test_edge_values_are_accepted_and_normalised():
    # temperatures a float cannot divide by are greedy, as in vLLM (below 1e-5)
    for t in (0, 0.0, -0.0, 5e-324, 1e-45, 1e-10, GREEDY_EPS / 2):
        assert SamplingParams(temperature=t).greedy, t
    assert not SamplingParams(temperature=GREEDY_EPS).greedy
    p = SamplingParams(temperature=2, top_p=5e-324, top_k=-1, seed=2**64 - 1, stop="x",
                       logprobs=20, max_tokens=MAX_TOKENS)
    assert p.temperature == 2.0 and type(p.temperature) is float
    assert p.top_k == 0 and p.stop == ("x",) and p.seed == 2**64 - 1
    assert SamplingParams(seed=-2**63).seed == -2**63
    assert SamplingParams(stop=["a"] * 16).stop == ("a",) * 16


def test_every_accepted_seed_seeds_a_generator():
    # the bounds are exactly torch's: one past them overflows inside manual_seed
    for seed in (-2**63, -1, 0, 2**63, 2**64 - 1):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)
    for seed in (-2**63 - 1, 2**64):
        with pytest.raises((ValueError, RuntimeError)):
            torch.Generator().manual_seed(seed)


# --- the sampler ----------------------------------------------------------------------------


def _seqs(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2], p, None) for i, p in enumerate(params)]


def _logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


GOOD = [
    SamplingParams(temperature=0, logprobs=3),
    SamplingParams(temperature=0.8, seed=11, logprobs=0),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.9, seed=12),
    SamplingParams(temperature=GREEDY_EPS, top_p=5e-324, seed=13),
]


def test_a_bad_row_fails_alone_and_the_others_are_unchanged():
    good = _logits(len(GOOD))
    alone = sample(good.clone(), _seqs(GOOD))
    assert all(r.error is None and r.token is not None for r in alone)

    bad_rows = {  # each kind of hopeless row, greedy and sampled
        1: (float("nan"), SamplingParams(temperature=0)),
        3: (float("nan"), SamplingParams(temperature=0.7, seed=5)),
        5: (float("inf"), SamplingParams(temperature=0)),
        6: ("all-inf", SamplingParams(temperature=1.0, top_k=3)),
        8: (float("nan"), SamplingParams(temperature=0, logprobs=2)),
    }
    size = len(GOOD) + len(bad_rows)
    logits, params, good_at = torch.empty(size, good.shape[1]), [], []
    it = iter(range(len(GOOD)))
    for row in range(size):
        if row in bad_rows:
            poison, p = bad_rows[row]
            logits[row] = _logits(1, seed=row)[0]
            if poison == "all-inf":
                logits[row] = float("-inf")
            else:
                logits[row, row] = poison
            params.append(p)
        else:
            i = next(it)
            logits[row], good_at = good[i], good_at + [row]
            params.append(GOOD[i])
    results = sample(logits, _seqs(params))

    assert len(results) == size and all(isinstance(r, SampleResult) for r in results)
    for row in bad_rows:
        r = results[row]
        assert r.token is None and r.logprob is None and isinstance(r.error, SamplingError)
        assert f"r{row}" in str(r.error)
    assert [results[row] for row in good_at] == alone


def _expected(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """The distribution SamplingParams describe, from the definitions (float64, by hand):
    softmax(logits / T) over the top_k largest, then the smallest most-likely prefix
    whose mass reaches top_p, renormalised."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    keep = order[:top_k] if top_k else order
    weights = {i: math.exp((logits[i] - max(logits)) / temperature) for i in keep}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for i in keep:  # most likely first
        if mass >= top_p:
            break
        kept.append(i)
        mass += weights[i] / total
    z = sum(weights[i] for i in kept)
    return [weights[i] / z if i in kept else 0.0 for i in range(len(logits))]


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0),
                                                       (1.0, 0, 0.8), (0.9, 6, 0.9)])
def test_unseeded_rows_draw_from_the_described_distribution(temperature, top_k, top_p):
    """Rows without a seed are drawn together: 6000 identical rows in one batch match the
    distribution the parameters describe (computed by hand), and tokens it excludes are
    never drawn. Fixed global seed: the check is deterministic."""
    torch.manual_seed(0)
    row = [2.0, 1.5, 1.4, 0.3, -0.2, -1.0, 0.9, 3.1]
    n = 6000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    results = sample(torch.tensor([row] * n), _seqs([params] * n))
    counts = torch.bincount(torch.tensor([r.token for r in results]), minlength=len(row))
    want = _expected(row, temperature, top_k, top_p)
    for token, (got, p) in enumerate(zip(counts.tolist(), want)):
        if p == 0:
            assert got == 0, f"token {token} is excluded but was drawn {got} times"
        else:
            assert abs(got / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, (token, got / n, p)


@pytest.mark.parametrize("spread", [2.0, 0.01])  # a peaked row; a near-flat one
def test_top_p_over_a_large_vocabulary_draws_from_its_nucleus(spread):
    """3000 tokens (more than sampler.NUCLEUS_CANDIDATES): the peaked row's nucleus lies
    in the top candidates, the near-flat row's does not (the full sort); either way the
    draws follow the described distribution and never leave the nucleus."""
    torch.manual_seed(1)
    vocab, n = 3000, 4000
    row = (torch.randn(vocab, generator=torch.Generator().manual_seed(2)) * spread).tolist()
    row[7], row[99] = max(row) + 2.0, max(row) + 1.0
    want = _expected(row, 1.0, 0, 0.8)
    params = SamplingParams(temperature=1.0, top_p=0.8)
    results = sample(torch.tensor([row] * n), _seqs([params] * n))
    counts = torch.bincount(torch.tensor([r.token for r in results]), minlength=vocab).tolist()
    assert all(c == 0 for c, p in zip(counts, want) if p == 0), "a token outside the nucleus"
    for token in (7, 99):
        p = want[token]
        assert abs(counts[token] / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, token


def test_a_bad_unseeded_row_fails_alone():
    """A NaN row among rows drawn together fails by itself; the others draw valid tokens."""
    logits = _logits(3)
    logits[1, 5] = float("nan")
    params = [SamplingParams(temperature=0.8, top_k=4)] * 3
    results = sample(logits, _seqs(params))
    assert isinstance(results[1].error, SamplingError) and results[1].token is None
    for i in (0, 2):
        assert results[i].error is None
        assert results[i].token in torch.topk(logits[i], 4).indices.tolist()


def test_tiny_temperature_and_top_p_keep_the_top_token():
    logits = _logits(3) * 1e4  # huge logits: (logits / 1e-5) alone would overflow to inf
    params = [SamplingParams(temperature=GREEDY_EPS, seed=1),
              SamplingParams(temperature=1.0, top_p=5e-324, seed=2),
              SamplingParams(temperature=2.0, top_p=1e-45, top_k=1, seed=3)]
    results = sample(logits, _seqs(params))
    assert [r.token for r in results] == logits.argmax(-1).tolist()
    unseeded = [SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k)
                for p in params]  # drawn together, not one by one
    for _ in range(20):
        results = sample(logits, _seqs(unseeded))
        assert [r.token for r in results] == logits.argmax(-1).tolist()


def test_masked_logits_keep_finite_logprobs():
    logits = _logits(1)
    logits[0, 10:] = float("-inf")  # only ten tokens left
    (r,) = sample(logits, _seqs([SamplingParams(temperature=1.0, seed=4, logprobs=20)]))
    assert r.error is None and 0 <= r.token < 10
    assert all(math.isfinite(v) for _, v in r.logprob["top"]) and len(r.logprob["top"]) == 20


# --- the engine -----------------------------------------------------------------------------

PROMPTS = [[5, 17, 99, 3, 42], [8, 120, 77, 61], [2, 9, 13, 200, 31, 4], [40, 41, 42]]
PARAMS = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=10, temperature=0.9, seed=77, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=9, temperature=1.2, top_k=20, top_p=0.8, seed=3,
                         ignore_eos=True)]
BAD = SamplingParams(max_tokens=12, temperature=0.5, seed=9, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    base = make_model("llama", seed=12)
    save_model(base, root / "model")
    make_adapter(base, root / "a", seed=3, r=4, lora_alpha=8, target_modules="all-linear")
    return root


def _llm(root) -> LLM:
    llm = LLM(root / "model", max_loras=1, max_lora_rank=4, block_size=4, max_model_len=64,
              num_kv_blocks=64)
    llm.register_adapter("a", root / "a")
    return llm


@pytest.fixture(scope="module")
def alone(root):
    """Each good request run by itself: what it must produce whatever shares its batch."""
    llm = _llm(root)
    return [llm.generate(p, sp, a)[0].token_ids
            for p, sp, a in zip(PROMPTS, PARAMS, [None, "a", None, "a"])]


def _poison(monkeypatch, request_id: str, after_tokens: int) -> None:
    """NaN logits for one request's row once it has `after_tokens` output tokens."""
    real = runner_module.draw

    def poisoned(logits, seqs):
        for i, seq in enumerate(seqs):
            if seq.request_id == request_id and seq.num_generated >= after_tokens:
                logits[i] = float("nan")
        return real(logits, seqs)

    monkeypatch.setattr(runner_module, "draw", poisoned)


@pytest.mark.parametrize("after_tokens", [0, 4])  # fails at its prefill, or mid-decode
def test_nan_logits_fail_one_request_and_the_batch_goes_on(root, alone, monkeypatch,
                                                           after_tokens):
    llm = _llm(root)
    engine = llm.engine
    free_blocks = engine.blocks.num_free
    table = engine.lora.table
    _poison(monkeypatch, "bad", after_tokens)
    ids = [engine.add_request(p, sp, a) for p, sp, a in
           zip(PROMPTS[:2], PARAMS[:2], [None, "a"])]
    engine.add_request([7, 7, 7, 7], BAD, "a", request_id="bad")
    ids += [engine.add_request(p, sp, a) for p, sp, a in
            zip(PROMPTS[2:], PARAMS[2:], [None, "a"])]

    finished = run_until_done(engine)

    bad = finished.pop("bad")
    assert bad.finish_reason == "error" and isinstance(bad.error, SamplingError)
    assert len(bad.token_ids) == after_tokens
    assert [finished[i].token_ids for i in ids] == alone
    assert all(finished[i].finish_reason == "length" for i in ids)
    # the failed sequence gave back its KV blocks and its adapter reference
    assert engine.blocks.num_free == free_blocks
    assert table.ref_count(engine.registry.slot_of("a")) == 0
    # and the engine still serves
    assert llm.generate(PROMPTS[0], PARAMS[0])[0].token_ids == alone[0]
