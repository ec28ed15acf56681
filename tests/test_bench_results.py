"""bench/common.merge_results: one command's figures go into the results JSON beside every
other command's; a decode run of some batch sizes keeps the model's other batch rows."""

from __future__ import annotations

import json

from bench.common import merge_results


def test_merge_adds_sections_and_keeps_other_keys(tmp_path):
    path = tmp_path / "r.json"
    merge_results(path, "swap", "llama3-8b", {"disk_ms": 1.0})
    merge_results(path, "decode", "llama3-8b", {"batch32": {"base_tok_s": 1.0}})
    merge_results(path, "swap", "llama3-8b", {"disk_ms": 2.0})  # replaced whole
    data = json.loads(path.read_text())
    assert data == {"swap": {"llama3-8b": {"disk_ms": 2.0}},
                    "decode": {"llama3-8b": {"batch32": {"base_tok_s": 1.0}}}}


def test_keep_replaces_only_the_rows_a_run_measured(tmp_path):
    path = tmp_path / "r.json"
    merge_results(path, "decode", "m", {"batch1": {"t": 1}, "batch8": {"t": 8}, "gen": 64},
                  keep=True)
    merge_results(path, "decode", "m", {"batch32": {"t": 32}, "batch8": {"t": 9}}, keep=True)
    assert json.loads(path.read_text())["decode"]["m"] == {
        "batch1": {"t": 1}, "batch8": {"t": 9}, "batch32": {"t": 32}, "gen": 64}
