"""PNG charts from bench/results/*.json, for BENCHMARKS.md.

    python bench/plot.py                      # bench/results -> bench/plots
    python bench/plot.py --results DIR --out DIR

Charts (each written only when some result file has its data):
- decode.png      decode tok/s vs batch: base, 1 adapter, 32 adapters, against the HBM roofline
- landing.png     time to land one adapter per path (disk, host tier, peer HTTP / NVLink,
                  PEFT's load_adapter) against the copy floor of that path
- churn.png       TTFT and ITL p50/p99 per promotion policy (all resident vs promote on demand)
- cpu_decode.png  CPU decode tok/s of metrale beside transformers / PEFT, per batch and adapter

Result files come from several benchmark versions: every key is optional, a chart skips
what a file does not have, and a file with nothing to plot is ignored.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402 - after the backend choice

ROOT = Path(__file__).resolve().parent
_BATCH_KEY = re.compile(r"batch(\d+)")


def load_results(results: Path) -> list[tuple[str, dict]]:
    """(file name, document) for each readable JSON object in `results`, sorted by name."""
    docs = []
    for path in sorted(results.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a half-written or foreign file is not a reason to draw nothing
        if isinstance(doc, dict):
            docs.append((path.name, doc))
    return docs


def _num(d: Any, key: str) -> float | None:
    v = d.get(key) if isinstance(d, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _dicts(d: Any) -> dict[str, dict]:
    return {k: v for k, v in d.items() if isinstance(v, dict)} if isinstance(d, dict) else {}


# --- decode vs batch --------------------------------------------------------------------------

_DECODE_SERIES = (("base_tok_s", "base", "-o"), ("lora1_tok_s", "1 adapter", "-s"),
                  ("lora32_tok_s", "32 adapters", "-^"),
                  ("hbm_roofline_tok_s", "HBM roofline", "--"))


def decode_chart(docs: list[tuple[str, dict]], out: Path) -> Path | None:
    models: dict[str, dict[int, dict]] = {}
    for _, doc in docs:
        for model, runs in _dicts(doc.get("decode")).items():
            for key, row in _dicts(runs).items():
                if m := _BATCH_KEY.fullmatch(key):
                    models.setdefault(model, {})[int(m[1])] = row
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, (model, rows) in zip(axes[0], sorted(models.items())):
        batches = sorted(rows)
        for key, label, style in _DECODE_SERIES:
            points = [(b, _num(rows[b], key)) for b in batches]
            points = [(b, v) for b, v in points if v is not None]
            if points:
                ax.plot(*zip(*points), style, label=label)
        ax.set(title=f"decode, {model}", xlabel="batch (sequences)", ylabel="tokens / s",
               xticks=batches)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "decode.png")


# --- landing per path -----------------------------------------------------------------------

# (key, label, the key of its floor): what one landing costs beside what the copy alone costs
_LANDING_PATHS = (("disk_warm_ms", "disk (page cache)", "h2d_floor_ms"),
                  ("host_tier_ms", "host tier", "h2d_slot_floor_ms"),
                  ("peer_http_ms", "peer HTTP", "peer_floor_ms"),
                  ("peer_nvlink_ms", "peer NVLink", "peer_floor_ms"),
                  ("peft_load_adapter_ms", "PEFT load_adapter", None))


def landing_chart(docs: list[tuple[str, dict]], out: Path) -> Path | None:
    bars: list[tuple[str, float, float | None]] = []  # (label, ms, floor ms)
    for _, doc in docs:
        for model, entry in _dicts(doc.get("swap")).items():
            # either {dtype: {...}} per model, or the figures directly (the peer run)
            groups = _dicts(entry) or {}
            if not any(k.endswith("_ms") for g in groups.values() for k in g):
                groups = {"": entry}
            for dtype, row in groups.items():
                for key, label, floor_key in _LANDING_PATHS:
                    ms = _num(row, key)
                    if ms is not None:
                        floor = _num(row, floor_key) if floor_key else None
                        name = f"{model} {dtype}".strip()
                        bars.append((f"{label}\n{name}", ms, floor))
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(bars)), 4.5))
    xs = range(len(bars))
    ax.bar(xs, [b[1] for b in bars], color="tab:blue", label="landing")
    floors = [(x, b[2]) for x, b in zip(xs, bars) if b[2] is not None]
    if floors:
        ax.scatter(*zip(*floors), marker="_", s=600, color="tab:red", zorder=3,
                   label="copy floor of the path")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [b[0] for b in bars], rotation=60, ha="right", fontsize=7)
    ax.set(title="landing one adapter, per path", ylabel="ms (log)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "landing.png")


# --- churn percentiles ----------------------------------------------------------------------

_CHURN_STATS = (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
                ("itl_p50_ms", "ITL p50"), ("itl_p99_ms", "ITL p99"))


def churn_chart(docs: list[tuple[str, dict]], out: Path) -> Path | None:
    groups: list[tuple[str, dict]] = []  # (config / policy, stats)
    for _, doc in docs:
        for config, run in _dicts(doc.get("churn")).items():
            for policy, stats in _dicts(run).items():
                if any(_num(stats, k) is not None for k, _ in _CHURN_STATS):
                    groups.append((f"{config}\n{policy}", stats))
    if not groups:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(groups)), 4.2))
    width = 0.38
    for ax, kind in zip(axes, ("ttft", "itl")):
        stats = [(k, label) for k, label in _CHURN_STATS if k.startswith(kind)]
        for i, (key, label) in enumerate(stats):
            xs = [g + (i - 0.5) * width for g in range(len(groups))]
            ax.bar(xs, [_num(s, key) or 0.0 for _, s in groups], width, label=label)
        ax.set_yscale("log")
        ax.set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=7)
        ax.set(title=f"{kind.upper()} under adapter churn", ylabel="ms (log)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "churn.png")


# --- CPU decode beside transformers / PEFT --------------------------------------------------


def cpu_decode_chart(docs: list[tuple[str, dict]], out: Path) -> Path | None:
    rows = []  # (label, metrale tok/s, hf tok/s, hf name)
    for name, doc in docs:
        for row in doc.get("side_by_side") or []:
            if not isinstance(row, dict):
                continue
            ours, theirs = _num(row, "metrale_tok_s"), _num(row, "hf_tok_s")
            if ours is None or theirs is None:
                continue
            adapter = row.get("adapter") or "base"
            # the file name, not the date: two runs of one day must stay apart
            rows.append((f"{Path(name).stem}\nb{row.get('batch', '?')} {adapter}", ours, theirs,
                         str(row.get("hf", "transformers"))))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4.2))
    width = 0.4
    xs = range(len(rows))
    ax.bar([x - width / 2 for x in xs], [r[1] for r in rows], width, label="metrale")
    ax.bar([x + width / 2 for x in xs], [r[2] for r in rows], width, label="transformers / PEFT")
    ax.set_xticks(list(xs), [r[0] for r in rows], fontsize=7, rotation=30, ha="right")
    ax.set(title="CPU decode, SmolLM2-135M", ylabel="tokens / s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "cpu_decode.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


CHARTS = (decode_chart, landing_chart, churn_chart, cpu_decode_chart)


def plot_all(results: Path, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    docs = load_results(results)
    return [p for chart in CHARTS if (p := chart(docs, out)) is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results", help="dir of *.json results")
    ap.add_argument("--out", type=Path, default=ROOT / "plots", help="dir the PNGs go to")
    args = ap.parse_args()
    for path in plot_all(args.results, args.out):
        print(path)


if __name__ == "__main__":
    main()
