"""Adapter landing time into a slot of a live engine, against the PCIe floor.

    PYTHONPATH=. python bench/swap.py [--model llama3-8b]
    PYTHONPATH=. python bench/swap.py --model llama3-70b-fp8   # 70B shape, built FP8, bf16 file only

For one PEFT-saved r=16 all-linear adapter (bf16 file; and PEFT's default fp32 file):
- h2d_floor_ms: a pinned host -> device copy of the file's data bytes (same run);
- disk_warm_ms: swap_lora_slot_from_disk with the file in the page cache, host tier off
  (parse + validate, one DMA from the file's registered mapping, NaN check, one landing
  kernel, tables; a file's first landing also bounds its weights in a scratch pool, since
  the direct API runs no registration check); disk_warm_cached_plan_ms: the same with the
  validated plan of these unchanged files remembered (a re-promotion after a tier miss); disk_first_ms: a file
  never landed before (plan, and the mapping made and registered);
  disk_pread_cached_plan_ms: the plan remembered, no mapping (parallel chunked preads
  into pinned staging overlapped with H2D, as every landing did before mappings);
  disk_new_file_known_layout_ms: a copy of the file never landed before (new inode: its
  own mapping and registration), whose config and header match a planned one;
- host_tier_ms: the same call when the host tier holds the adapter (one H2D of the slot
  image + table rows); host_tier_promote_ms: the promotion operation
  (promote_lora_slot_from_disk: the promoter chooses the slot) of the same files, a new
  version each time, their image in the tier;
- plan_ms: the config/header validation alone (part of disk_warm_ms);
- peft_load_adapter_ms: PEFT `load_adapter` of the same directory (one repetition);
- breakdown_ms: the cached-plan disk landing phase by phase, the device synchronized
  after each (so the phases add up to more than the pipelined whole): identity (config
  and header digest), plan (cache hit), read (the H2D copy from the registered mapping),
  check (one NaN/Inf pass), begin (slot zeroed), write (landing kernel), commit
  (rank/scale tables); read_only: the file's parallel preads into pinned memory, no copy.
Each time is wall clock until the device is idle again (synchronized), median of 5.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import (
    adapter_dir,
    build_any,
    h2d_ms,
    make_peft,
    median,
    merge_results,
    results_path,
    sync,
    table,
    timed,
    write_random_adapters,
)
from metrale.adapters.identity import adapter_identity
from metrale.adapters.plan import plan_adapter
from metrale.pool.staged import stage
from metrale.pool.staging import read_chunks
from metrale.pool.swap import read_adapter_data


def run(engine, adapters_root: Path, peft, device: str, slot: int) -> dict:
    slots = engine.lora
    out = {"slot_bytes": slots.pool.layout.slot_bytes}
    files = {"bf16": adapter_dir(adapters_root, 0), "fp32": adapters_root / "fp32" / "a0"}
    for label, d in files.items():
        if not d.exists():  # a base built only quantized: random bf16 adapters, no PEFT copy
            continue
        plan = plan_adapter(d, "x", slots.model_config, slots.pool_config)

        def swap(d=d):
            engine.swap_lora_slot_from_disk(d, "swapbench", slot)

        def swap_fresh_plan(d=d):
            slots.clear_plan_cache()  # parse + validate the files again, as a first landing does
            swap(d)

        def swap_first(d=d):
            slots.mapped_files.clear()  # and map + register the file again
            swap_fresh_plan(d)

        copies = iter([shutil.copytree(d, adapters_root / f"copy-{label}-{i}") for i in range(6)])

        def swap_same_layout(copies=copies):
            engine.swap_lora_slot_from_disk(next(copies), "swapbench", slot)

        def swap_pread(d=d):
            capacity, slots.mapped_files.capacity = slots.mapped_files.capacity, 0
            swap(d)
            slots.mapped_files.capacity = capacity

        tier = slots.host_tier
        slots.host_tier = None  # disk path every time
        first = timed(swap_first, device, reps=5, warmup=2)
        disk = timed(swap_fresh_plan, device, reps=5, warmup=1)
        disk_cached = timed(swap, device, reps=5, warmup=1)
        pread = timed(swap_pread, device, reps=5, warmup=1)
        same_layout = timed(swap_same_layout, device, reps=5, warmup=1)
        slots.host_tier = tier
        row = {
            "adapter_bytes": plan.data_bytes,
            "h2d_floor_ms": h2d_ms(plan.data_bytes, device),
            "h2d_slot_floor_ms": h2d_ms(slots.pool.layout.slot_bytes, device),
            "disk_warm_ms": median(disk),
            "disk_warm_min_ms": min(disk),
            "disk_warm_cached_plan_ms": median(disk_cached),
            "disk_first_ms": median(first),
            "disk_pread_cached_plan_ms": median(pread),
            "disk_new_file_known_layout_ms": median(same_layout),
            "plan_ms": median(timed(lambda d=d: plan_adapter(d, "x", slots.model_config,
                                                             slots.pool_config), "cpu", reps=5)),
        }
        if tier is not None and tier.enabled:
            swap()  # lands from disk and fills the tier
            sync(device)
            hits = tier.hits
            t = timed(swap, device, reps=5, warmup=1)
            assert tier.hits == hits + 6, "host tier was not hit"
            row["host_tier_ms"] = median(t)
            row["host_tier_min_ms"] = min(t)
            # the promotion operation (the promoter picks the slot: the name's own) of a new
            # version of the same files, their image in the tier
            engine.promote_lora_slot_from_disk(d, "promotebench")
            sync(device)
            hits = tier.hits
            t = timed(lambda d=d: engine.promote_lora_slot_from_disk(d, "promotebench"), device,
                      reps=5, warmup=1)
            assert tier.hits == hits + 6, "host tier was not hit"
            engine.unload_adapter("promotebench")
            row["host_tier_promote_ms"] = median(t)
        if peft is not None:
            sync(device)
            t0 = time.perf_counter()
            peft.load_adapter(str(d), adapter_name=f"loadbench_{label}")
            sync(device)
            row["peft_load_adapter_ms"] = (time.perf_counter() - t0) * 1e3
            peft.delete_adapter(f"loadbench_{label}")
        slots.host_tier = None
        # last: it bypasses the engine, so the name leaves first (no route to the slot it writes)
        engine.unload_adapter("swapbench")
        row["breakdown_ms"] = breakdown(slots, d, device, slot)
        slots.host_tier = tier
        out[label] = row
    return out


def breakdown(slots, d: Path, device: str, slot: int, reps: int = 5) -> dict:
    """Median ms of each phase of a cached-plan disk landing, synchronized after each."""
    phases: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def phase(name):
        sync(device)
        t0 = time.perf_counter()
        yield
        sync(device)
        phases.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

    slots.plan_from_disk(d, "breakdown")  # warm the plan cache
    for _ in range(reps + 1):
        with phase("identity"):
            ident = adapter_identity(d)
        with phase("plan"):
            plan = slots.plan_from_disk(d, "breakdown", ident)
        with phase("read"):
            data = read_adapter_data(plan, slots.staging, slots.mapped_files, ident)
        with phase("check"):
            staged = stage(plan, data, slots.recipes.get(plan))
        with phase("begin"):
            landing = slots.begin(slot)
        with phase("write"):
            landing.write_staged(staged)
        with phase("commit"):
            landing.commit(0)  # a version no registry names
        host = slots.staging.host(plan.data_bytes)
        with phase("read_only"):
            read_chunks(plan.source, plan.data_offset, host, None)
    return {k: median(v[1:]) for k, v in phases.items()}


def report(name: str, res: dict) -> str:
    rows = []
    for label in ("bf16", "fp32"):
        r = res.get(label)
        if not r:
            continue
        floor = r["h2d_floor_ms"]
        rows.append({"model": name, "file": label, "MB": r["adapter_bytes"] / 1e6,
                     "h2d_floor_ms": floor, "disk_warm_ms": r["disk_warm_ms"],
                     "disk/floor": r["disk_warm_ms"] / floor,
                     "disk_cached_plan_ms": r.get("disk_warm_cached_plan_ms", float("nan")),
                     "cached/floor": r.get("disk_warm_cached_plan_ms", float("nan")) / floor,
                     "first_ms": r.get("disk_first_ms", float("nan")),
                     "pread_ms": r.get("disk_pread_cached_plan_ms", float("nan")),
                     "new_file_ms": r.get("disk_new_file_known_layout_ms", float("nan")),
                     "host_tier_ms": r.get("host_tier_ms", float("nan")),
                     "tier/slot_floor": r.get("host_tier_ms", float("nan")) / r["h2d_slot_floor_ms"],
                     "tier_promote_ms": r.get("host_tier_promote_ms", float("nan")),
                     "promote/slot_floor": r.get("host_tier_promote_ms", float("nan"))
                     / r["h2d_slot_floor_ms"],
                     "plan_ms": r["plan_ms"],
                     "peft_load_ms": r.get("peft_load_adapter_ms", float("nan"))})
    return table(rows, list(rows[0]) if rows else [])


def main() -> None:
    from bench.decode import make_engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pair = build_any(args.model, args.device, Path(tmp))
        if pair.hf is not None:
            peft = make_peft(pair, 1, Path(tmp) / "adapters")
        else:  # built only quantized (llama3-70b-fp8): the bf16 file alone, no PEFT baseline
            peft = None
            write_random_adapters(pair, 1, Path(tmp) / "adapters")
        engine = make_engine(pair, args.device, 2, max_num_seqs=8, host_tier_bytes=4 << 30)
        res = run(engine, Path(tmp) / "adapters", peft, args.device, slot=1)
    merge_results(results_path(args.device), "swap", args.model, res)
    print(report(args.model, res))


if __name__ == "__main__":
    main()
