"""bench/decode.py --structured, small: on the CPU with the tiny model it decodes the
batch with half its rows under a JSON schema and the same batch unconstrained, the
same tokens each (no row's schema completes within the bench's tokens), and writes its
keys (no timing asserted)."""

from __future__ import annotations

from bench.common import build_any, write_random_adapters
from bench.decode import run_structured


def test_structured_run_decodes_the_same_tokens_constrained_and_not(tmp_path):
    pair = build_any("tiny", "cpu", tmp_path)
    write_random_adapters(pair, 4, tmp_path / "adapters")
    res = run_structured(pair, tmp_path / "adapters", tmp_path / "tokenizer", "cpu", batch=8,
                         n_adapters=4, gen=12)
    assert res["constrained"] == 4 and res["batch"] == 8
    assert res["structured_tokens"] == res["plain_tokens"] == 8 * 11  # all but the prefill's
    for key in ("plain_tok_s", "structured_tok_s", "plain_step_ms", "structured_step_ms"):
        assert res[key] > 0
    assert res["structured_over_plain"] == res["structured_tok_s"] / res["plain_tok_s"]
