"""bench/plot.py draws every chart from the committed results, and skips what a result file
lacks instead of failing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHARTS = ("decode.png", "landing.png", "churn.png", "cpu_decode.png")


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 100 and height > 100 and len(data) > 5000, (path, width, height, len(data))


def test_plots_render_from_the_committed_results(tmp_path):
    out = subprocess.run([sys.executable, "bench/plot.py", "--out", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(CHARTS)
    for name in CHARTS:
        _assert_png(tmp_path / name)


def test_missing_keys_skip_a_chart_not_the_run(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    # a decode run without the roofline or 32-adapter figures, a swap without floors,
    # a churn policy without ITL, junk beside them
    (results / "a.json").write_text(json.dumps({
        "decode": {"m": {"batch8": {"base_tok_s": 10.0}, "batch16": {"lora1_tok_s": 12.0},
                         "gen": 64}},
        "swap": {"m": {"bf16": {"disk_warm_ms": 3.0}}},
        "churn": {"m": {"promote": {"ttft_p50_ms": 5.0}, "note": "x"}},
    }))
    (results / "b.json").write_text("[1, 2]")
    (results / "c.json").write_text("{not json")
    plots = tmp_path / "plots"
    out = subprocess.run([sys.executable, "bench/plot.py", "--results", str(results), "--out",
                          str(plots)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in plots.iterdir()) == ["churn.png", "decode.png", "landing.png"]
    for p in plots.iterdir():
        _assert_png(p)
