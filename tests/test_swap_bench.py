"""bench/swap.py on the CPU, a base built only quantized (the path `--model llama3-70b-fp8`
takes on the device): random bf16 adapter files, no PEFT baseline, and the host-tier swap
and promotion rows measured from the tier (the bench asserts each repetition hit it)."""

from __future__ import annotations

import math

import torch

from bench.common import build_any, write_random_adapters
from bench.decode import make_engine
from bench.swap import run


def test_swap_bench_runs_on_a_base_built_only_quantized(tmp_path):
    torch.set_num_threads(1)
    pair = build_any("tiny-moe-fp8", "cpu", tmp_path)
    assert pair.hf is None
    write_random_adapters(pair, 1, tmp_path / "adapters")
    engine = make_engine(pair, "cpu", 2, max_num_seqs=8, host_tier_bytes=64 << 20)
    res = run(engine, tmp_path / "adapters", None, "cpu", slot=1)
    assert set(res) == {"slot_bytes", "bf16"}  # no fp32 copy without PEFT
    row = res["bf16"]
    for key in ("disk_warm_ms", "disk_new_file_known_layout_ms", "host_tier_ms",
                "host_tier_promote_ms", "plan_ms"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert "peft_load_adapter_ms" not in row
