"""Everything for one device call: the GPU tests, then swap + decode for Llama-3-8B and
Llama-3.2-1B shapes (random bf16 weights) and churn on the 1B.

    PYTHONPATH=. python bench/gpu_all.py [--out DIR] [--budget-s 330] [--skip-tests]

Each stage is guarded: a failure prints its traceback and the rest still run; a stage
that would start past the time budget is skipped. Results merge into
bench/results/<date>-<gpu>.json (and a copy under --out); tables print last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import churn, decode, swap  # noqa: E402
from bench.common import build_pair, make_peft, merge_results, results_path  # noqa: E402
from metrale.config import PoolConfig  # noqa: E402
from metrale.pool.layout import SlotLayout  # noqa: E402

GPU_TESTS = ["tests/test_fused_ops.py", "tests/test_attention_ops.py", "tests/test_host_tier.py",
             "tests/test_cuda_graphs.py"]


class Stages:
    def __init__(self, budget_s: float) -> None:
        self.t0, self.budget = time.monotonic(), budget_s
        self.log: list[tuple[str, str, float]] = []

    def run(self, name: str, fn, need_s: float = 0.0):
        left = self.budget - (time.monotonic() - self.t0)
        if left < need_s:
            self.log.append((name, f"skipped ({left:.0f}s left, needs ~{need_s:.0f}s)", 0.0))
            print(f"== {name}: skipped", flush=True)
            return None
        print(f"== {name} (t={time.monotonic() - self.t0:.0f}s)", flush=True)
        t = time.monotonic()
        try:
            out = fn()
            self.log.append((name, "ok", time.monotonic() - t))
            return out
        except Exception:
            traceback.print_exc()
            self.log.append((name, "FAILED", time.monotonic() - t))
            return None


def run_tests(out: Path) -> None:
    """The gpu-marked tests (realistic sizes, compiled). If the fused elementwise kernels
    fail, the benchmarks fall back to the torch elementwise path (and say so)."""
    from metrale.ops import fused_triton

    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-m", "gpu", "-p", "no:cacheprovider",
           *GPU_TESTS]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    (out / "pytest.log").write_text(run.stdout + run.stderr)
    print(run.stdout[-4000:], flush=True)
    if "test_fused_ops.py" in run.stdout and "FAILED tests/test_fused_ops.py" in run.stdout:
        fused_triton.ENABLED = False
        print("!! fused elementwise kernels (norms, rotary, silu_mul) failed: benchmarks use the torch path")
    if run.returncode:
        raise RuntimeError(f"GPU tests failed (rc {run.returncode}); see pytest.log")


def bench_model(st: Stages, name: str, tmp: Path, results: Path, tables: list[str],
                with_churn: bool, dev: str, stages: tuple[str, ...]) -> None:
    pair = st.run(f"{name}: build", lambda: build_pair(name, dev, tmp), need_s=20)
    if pair is None:
        return
    root = tmp / f"{name}-adapters"
    n = 32 if "decode" in stages or with_churn else 1  # swap alone needs one adapter
    peft = st.run(f"{name}: peft adapters", lambda: make_peft(pair, n, root), need_s=20)
    if peft is None:
        return
    slot_bytes = None
    tier = 3 * SlotLayout(pair.config, PoolConfig(1, 16), torch.bfloat16).slot_bytes
    engine = st.run(f"{name}: engine + graphs", lambda: decode.make_engine(
        pair, dev, 33, max_num_seqs=64, max_model_len=512, host_tier_bytes=tier), need_s=20)
    if engine is None:  # keep the eager numbers at least
        engine = st.run(f"{name}: engine, eager", lambda: decode.make_engine(
            pair, dev, 33, max_num_seqs=64, max_model_len=512, host_tier_bytes=tier,
            enforce_eager=True), need_s=20)
    if engine is None:
        return
    slot_bytes = engine.lora.pool.layout.slot_bytes
    res = None
    if "decode" in stages:
        res = st.run(f"{name}: decode", lambda: decode.run(pair, root, peft, dev, (32, 64),
                                                            engine=engine), need_s=40)
    if res:
        merge_results(results, "decode", name, res)
        tables.append(decode.report(name, res))
    res = None
    if "swap" in stages:
        res = st.run(f"{name}: swap", lambda: swap.run(engine, root, peft, dev, slot=32), need_s=15)
    if res:
        merge_results(results, "swap", name, res)
        tables.append(swap.report(name, res))
    engine = peft = None  # free the HF/PEFT model and this engine's graphs and caches
    pair.hf = None
    gc.collect()
    empty_cache(dev)
    if with_churn and slot_bytes:
        res = st.run(f"{name}: churn", lambda: churn.run(pair, root, dev, seconds=8.0, rate=150.0),
                     need_s=40)
        if res:
            merge_results(results, "churn", name, res)
            tables.append(churn.report(name, res))
    pair = None
    gc.collect()
    empty_cache(dev)
    shutil.rmtree(root, ignore_errors=True)


def empty_cache(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--budget-s", type=float, default=330.0)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--models", nargs="+", default=["llama3-8b", "llama3.2-1b"])
    ap.add_argument("--churn", nargs="+", default=["llama3.2-1b"], help="models to run churn on")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    ap.add_argument("--stages", nargs="+", default=["decode", "swap"], help="per model")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    st = Stages(args.budget_s)
    if args.device.startswith("cuda"):
        print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if not args.skip_tests:
        st.run("gpu tests", lambda: run_tests(out))
    results, tables = results_path(args.device), []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            bench_model(st, name, Path(tmp), results, tables, name in args.churn, args.device,
                        tuple(args.stages))
    if results.exists():
        shutil.copy(results, out / results.name)
    print("\n== stages")
    for name, status, secs in st.log:
        print(f"{name:32s} {status:10s} {secs:6.1f}s")
    print("\n" + "\n\n".join(tables))
    if results.exists():
        print("\n" + json.dumps(json.loads(results.read_text()), sort_keys=True)[:6000])


if __name__ == "__main__":
    main()
