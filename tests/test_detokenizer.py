"""Incremental detokenisation gives exactly the text of decoding the whole output, token
by token, on the default model's byte-level vocabulary: characters split over several
tokens (CJK, emoji, accents), stop strings split over tokens, streamed deltas that add
up to the final text."""

from __future__ import annotations

import random

import pytest

from metrale.engine.detokenizer import DetokenizerState, detokenize_new
from metrale.engine.output_processor import OutputProcessor
from metrale.engine.sampler import SampleResult
from metrale.engine.sampling_params import SamplingParams
from metrale.engine.sequence import Sequence
from metrale.model import default_model as dm

TEXTS = [
    "Hello, world! Ça va? Größe, naïve café.",
    "東京は日本の首都です。世界中から人が来ます。",
    "emoji: 🦜🏴‍☠️👍🏽 and a pirate says arrr 🏴‍☠️!",
    "mixed 한국어 текст العربية and code: x = 1  # ünïcödé",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_cache):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(dm.default_model_dir())


def _stream(tokenizer, ids: list[int]) -> tuple[str, list[str]]:
    state, deltas = DetokenizerState(), []
    for i in range(1, len(ids) + 1):
        deltas.append(detokenize_new(tokenizer, ids[:i], state, final=i == len(ids)))
        # never more than, nor different from, what the whole prefix decodes to
        assert tokenizer.decode(ids[:i], skip_special_tokens=True).startswith(state.text)
    return state.text, deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # really split below word level somewhere
    full, deltas = _stream(tokenizer, ids)
    assert full == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert "".join(deltas) == full


def test_random_token_runs_equal_whole_decode(tokenizer):
    """Arbitrary ids (byte tokens, special tokens, word pieces) in any order."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        full, _ = _stream(tokenizer, ids)
        assert full == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("stop", ["首都", "🏴‍☠️", "a va"])
def test_stop_string_split_over_tokens(tokenizer, stop):
    text = next(t for t in TEXTS if stop in t)
    ids = tokenizer.encode(text)
    processor = OutputProcessor(tokenizer, set(), 10_000)
    seq = Sequence("r", [1], SamplingParams(max_tokens=len(ids) + 5, stop=[stop]), None)
    streamed, final = "", None
    for token in ids:
        out = processor.process([seq], [SampleResult(token)])[0]
        streamed += out.delta_text
        if out.finished:
            final = out
            break
    want = text[:text.index(stop)]
    assert final is not None and final.finish_reason == "stop"
    assert final.text == want and streamed == want


def test_outputs_hold_their_step_s_tokens_and_logprobs(tokenizer):
    """Each RequestOutput's token_ids and logprobs stay what they were at its step while
    the request goes on (they are fixed-length views of the growing lists, not copies),
    read like lists and survive pickling (Ray replicas send outputs across processes)."""
    import pickle

    from metrale.engine.outputs import Prefix

    processor = OutputProcessor(tokenizer, set(), 10_000)
    seq = Sequence("r", [1], SamplingParams(max_tokens=50, logprobs=1), None)
    ids = tokenizer.encode(TEXTS[0])[:12]
    outs = [processor.process([seq], [SampleResult(t, {"token": t, "logprob": -0.5 * i,
                                                       "top": []})])[0]
            for i, t in enumerate(ids)]
    for n, out in enumerate(outs, start=1):
        assert out.token_ids == ids[:n] and list(out.token_ids) == ids[:n]
        assert len(out.logprobs) == n and out.logprobs[-1]["logprob"] == -0.5 * (n - 1)
        assert out.token_ids[-1] == ids[n - 1] and out.token_ids[1:3] == ids[1:3][:n - 1]
        assert pickle.loads(pickle.dumps(out)).token_ids == ids[:n]
    view = outs[3].token_ids
    assert isinstance(view, Prefix) and repr(view) == repr(ids[:4])
    assert view == tuple(ids[:4]) and view != ids[:5] and ids[:4] == view
    with pytest.raises(IndexError):
        view[4]
    assert [*view] == ids[:4] and view.index(ids[2]) == ids[:4].index(ids[2])
