"""Promote an adapter from a peer store (NIXL VRAM -> VRAM, on another GPU or the same
one), and time the raw device copy of the same bytes in the same run. `transport` is
what UCX reported carrying the READs (e.g. cuda_ipc), never assumed.

    PYTHONPATH=. python3 bench/peer_nvlink.py            # 2 GPUs: store on cuda:0, engine on cuda:1
                                                         # 1 GPU: both on cuda:0 (HTTP vs disk)
    PYTHONPATH=. python3 bench/peer_nvlink.py --model tiny --device cpu   # smoke run
    PYTHONPATH=. python3 bench/peer_nvlink.py --model llama3-8b --device cpu  # HTTP on one box

Each landing reports its phases (prepare_from_peer's `stats`): control (the one lease +
manifest round trip), validate (decode, check against the local layout, plan or reuse
the cached plan), transfer (NIXL READ, or the HTTP streams into pinned staging and
their device-side NaN/Inf check: the store serves byte ranges, so the engine reads
`http_streams` ranges at once, each on its own connection and thread; runs that do not
record that figure read one stream), check (NIXL: the in-slot NaN/Inf check) and the
rest (NIXL: descriptor lookups; the gain bound and the NaN/Inf check in one host sync,
the tables at commit, slot bookkeeping; the lease's release is queued, not waited for).
`tcp_floor_ms` is the HTTP fallback's floor in the same run: the same bytes between two
processes over the same number of plain loopback TCP streams (blocking sockets, no HTTP,
no H2D), connections included. On a GPU the bench first warms the peer as an engine
does when the first adapter from it is registered (warm_up_peer: lease, plan, the peer's
agent, a READ of a few bytes), so the first landing timed is the first one after start,
not a cold plan.

The adapter is Llama-3-8B shaped, r=16, all seven linear modules, bf16, written in
PEFT's file format (adapter_config.json + adapter_model.safetensors) with random
values: this measures bytes moved, and landings are checked against PEFT elsewhere.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import CONFIGS, gpu_tag, median, merge_results, results_path, table
from metrale.config import LINEAR_MODULES, ModelConfig, PoolConfig
from metrale.peer.client import DATA_SPAN, DATA_STREAMS
from metrale.peer.landing import prepare_from_peer, warm_up_nixl, warm_up_peer
from metrale.pool.swap import LoraSlots

RANK = 16
_versions = itertools.count(1)  # a bare pool's landings number their own versions


def land_from_disk(slots: LoraSlots, adapter: Path, slot: int, name: str) -> None:
    """A PEFT directory into `slot` of a bare pool: read and checked, then written (the
    pool-level landing an engine's swap runs)."""
    slots.land(slot, next(_versions), slots.prepare_disk(adapter, name))


def promote_from_peer(slots: LoraSlots, addr: str, adapter_id: str, name: str,
                      **kw) -> int:
    """A peer's adapter into the pool's victim slot (the pool-level landing an engine's
    promotion runs); kw go to prepare_from_peer. Returns the slot."""
    slot = slots.table.select_victim()
    prepared = prepare_from_peer(slots, addr, adapter_id, name, **kw)
    try:
        slots.land(slot, next(_versions), prepared)
    finally:
        prepared.close()
    return slot


def _tcp_sender(port_queue, nbytes: int, streams: int, reps: int) -> None:
    """The floor's other process: per rep, `streams` connections, each sent the range it
    asks for (16 bytes: start, stop) from one host buffer, blocking sends."""
    import socket

    data = memoryview(bytearray(nbytes))

    def send(conn: socket.socket) -> None:
        with conn:
            head = conn.recv(16, socket.MSG_WAITALL)
            conn.sendall(data[int.from_bytes(head[:8], "little"):int.from_bytes(head[8:], "little")])

    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        port_queue.put(server.getsockname()[1])
        for _ in range(reps * streams):
            threading.Thread(target=send, args=(server.accept()[0],)).start()


def tcp_floor_ms(nbytes: int, streams: int, reps: int = 7) -> float:
    """What plain loopback TCP moves the slot's bytes in, between two processes over the
    same number of streams as the HTTP fallback, connections included: blocking sockets,
    whole-piece receives, no HTTP, no H2D. Median of reps."""
    import multiprocessing
    import socket

    from metrale.peer.streams import split

    ctx = multiprocessing.get_context("spawn")
    port_queue = ctx.Queue()
    sender = ctx.Process(target=_tcp_sender, args=(port_queue, nbytes, streams, reps), daemon=True)
    sender.start()
    port = port_queue.get(timeout=60)
    out = memoryview(bytearray(nbytes))

    def receive(a: int, b: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(a.to_bytes(8, "little") + b.to_bytes(8, "little"))
            got = a
            while got < b:
                got += conn.recv_into(out[got:min(b, got + (8 << 20))], 0, socket.MSG_WAITALL)

    times = []
    try:
        for _ in range(reps):
            start = time.perf_counter()
            threads = [threading.Thread(target=receive, args=span) for span in split(nbytes, streams, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        sender.join(timeout=10)
        sender.kill()
    return median(times)


def write_model_and_adapter(root: Path, name: str) -> tuple[Path, Path]:
    import transformers

    model_dir = root / "model"
    transformers.LlamaConfig(**CONFIGS[name]).save_pretrained(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in LINEAR_MODULES:
            d_in, d_out = cfg.linear_shape(module)
            key = f"base_model.model.{cfg.module_path(layer, module)}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(RANK, d_in, generator=g) / 64).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(d_out, RANK, generator=g) / 64).bfloat16()
    adapter = root / "adapters" / "a0"
    adapter.mkdir(parents=True)
    save_file(tensors, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 32, "target_modules": list(LINEAR_MODULES),
        "bias": "none", "use_rslora": False}))
    return model_dir, adapter


def start_store(root: Path, model_dir: Path, device: str, transport: str):
    cmd = [sys.executable, "-m", "metrale", "peer", "serve", "--adapters", str(root / "adapters"),
           "--model", str(model_dir), "--device", device, "--dtype", "bfloat16",
           "--max-lora-rank", str(RANK), "--port", "0", "--transport", transport]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": os.environ.get(
        "CUDA_VISIBLE_DEVICES", "0,1")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        print("store:", line.rstrip(), flush=True)
        if "metrale peer: serving" in line:
            return proc, line.rsplit(" on ", 1)[1].split()[0].removeprefix("http://")
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("peer store did not start")


def peer_copy_ms(nbytes: int, src_dev: str, dst_dev: str, reps: int = 20) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=src_dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    times = []
    for _ in range(reps + 3):
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(dst_dev)
        times.append((time.perf_counter() - start) * 1e3)
    return median(times[3:])


PHASES = ("control_ms", "validate_ms", "transfer_ms", "check_ms")


def land_many(slots, addr: str, transport: str, reps: int, gpu: bool, engine_dev: str):
    """Promote `reps + 2` times; the first landing plans the manifest (cold), the rest
    reuse the plan. Returns (row, last slot)."""
    times, phases, slot = [], [], None
    for i in range(reps + 2):
        stats: dict = {}
        start = time.perf_counter()
        slot = promote_from_peer(slots, addr, "a0", f"{transport}{i}", transport=transport,
                                 stats=stats)
        if gpu:
            torch.cuda.synchronize(engine_dev)
        total = (time.perf_counter() - start) * 1e3
        times.append(total)
        rest = total - sum(stats.get(k, 0.0) for k in PHASES)
        phases.append({**{k: stats.get(k, 0.0) for k in PHASES}, "tables_and_rest_ms": rest,
                       "cached": stats.get("plan_cached"), "runs": stats.get("runs"),
                       "ucx_transport": stats.get("ucx_transport"),
                       "manifest_bytes": stats.get("manifest_bytes"), "tensors": stats.get("tensors")})
    warm = phases[2:]
    row = {"transport": transport, "promote_ms": median(times[2:]), "first_promote_ms": times[0],
           "first": phases[0],
           "warm": {k: median([p[k] for p in warm]) for k in (*PHASES, "tables_and_rest_ms")},
           "plan_cached": all(p["cached"] for p in warm), "runs": warm[-1]["runs"],
           "ucx_transport": warm[-1]["ucx_transport"],
           "manifest_bytes": warm[-1]["manifest_bytes"], "tensors": warm[-1]["tensors"]}
    return row, slot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--http-reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    gpu = args.device == "cuda"
    gpus = torch.cuda.device_count() if gpu else 0
    # one GPU: the store and the engine share it, which still times the HTTP fallback
    # against the disk path on the same bytes; NVLink needs the second GPU
    store_dev, engine_dev = ("cuda", "cuda:1" if gpus > 1 else "cuda:0") if gpu else ("cpu", "cpu")
    root = Path(tempfile.mkdtemp(prefix="metrale-nvlink-"))
    model_dir, adapter = write_model_and_adapter(root, args.model)
    proc, addr = start_store(root, model_dir, store_dev, "auto")
    try:
        slots = LoraSlots(ModelConfig.from_dir(model_dir), PoolConfig(4, RANK), engine_dev,
                          torch.bfloat16)
        start = time.perf_counter()
        warm_up_nixl(slots)  # as an engine on a GPU does when it starts
        warm_up_ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        # as an engine on a GPU does when the first adapter from this peer is registered
        peer_warm_up = warm_up_peer(slots, addr, "a0") if gpu else None
        peer_warm_up_ms = (time.perf_counter() - start) * 1e3 if gpu else None
        nbytes = slots.pool.layout.slot_bytes
        rows = []
        slot = None
        for transport in ("nixl", "http"):
            reps = args.reps if transport == "nixl" else args.http_reps
            try:
                row, slot = land_many(slots, addr, transport, reps, gpu, engine_dev)
                rows.append(row)
            except Exception as e:  # record what failed; the other transport still runs
                print(f"{transport}: FAILED {type(e).__name__}: {e}", flush=True)
                rows.append({"transport": transport, "promote_ms": float("nan"), "error": str(e)})
        # the peer-landed bytes equal a disk landing of the same files
        land_from_disk(slots, adapter, 3, "disk")
        cfg = slots.model_config
        same = slot is not None and all(
            torch.equal(slots.pool.lora_bt(layer, m)[3], slots.pool.lora_bt(layer, m)[slot])
            and torch.equal(slots.pool.lora_a(layer, m)[3], slots.pool.lora_a(layer, m)[slot])
            for layer in (0, cfg.num_layers - 1) for m in LINEAR_MODULES)
        disk = []
        for i in range(3):
            slots.clear_plan_cache()
            start = time.perf_counter()
            land_from_disk(slots, adapter, 3, f"disk{i}")
            if gpu:
                torch.cuda.synchronize(engine_dev)
            disk.append((time.perf_counter() - start) * 1e3)
        disk_cached = []  # the plan kept, as the peer's warm landings keep theirs
        for i in range(5):
            start = time.perf_counter()
            land_from_disk(slots, adapter, 3, f"disk-cached{i}")
            if gpu:
                torch.cuda.synchronize(engine_dev)
            disk_cached.append((time.perf_counter() - start) * 1e3)
        floor = peer_copy_ms(nbytes, "cuda:0", engine_dev) if gpu else float("nan")
        tcp_floor = tcp_floor_ms(nbytes, DATA_STREAMS)
    finally:
        proc.kill()
    by = {r["transport"]: r for r in rows}
    nixl = by["nixl"]
    transport = nixl.get("ucx_transport")
    result = {"adapter_bytes": nbytes, "gpus": gpus, "transport": transport,
              "peer_nixl_ms": nixl["promote_ms"], "peer_nixl_first_ms": nixl.get("first_promote_ms"),
              "nixl_warm_up_ms": warm_up_ms, "peer_warm_up_ms": peer_warm_up_ms,
              "peer_warm_up_transport": peer_warm_up,
              "peer_first_over_warm": nixl.get("first_promote_ms", float("nan")) / nixl["promote_ms"],
              "peer_http_ms": by["http"]["promote_ms"],
              "http_streams": DATA_STREAMS, "http_piece_bytes": DATA_SPAN,
              "tcp_floor_ms": tcp_floor,
              "peer_floor_ms": floor,
              "disk_ms": median(disk), "landed_bytes_equal_disk": same,
              "disk_plan_cached_ms": median(disk_cached[1:]),
              "http_over_disk": by["http"]["promote_ms"] / median(disk),
              "http_over_disk_plan_cached": by["http"]["promote_ms"] / median(disk_cached[1:]),
              "breakdown": {r["transport"]: {k: r[k] for k in r if k not in ("transport", "error")}
                            for r in rows if "error" not in r},
              "errors": {r["transport"]: r["error"] for r in rows if "error" in r},
              "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
              "date": time.strftime("%Y-%m-%d"),
              "command": f"PYTHONPATH=. python3 bench/peer_nvlink.py --model {args.model} "
                         f"--device {args.device}"}
    print(table([{"figure": k, "value": v} for k, v in result.items() if k != "breakdown"],
                ["figure", "value"]))
    for r in rows:
        if "error" in r:
            continue
        print(f"\n{r['transport']}: {r['tensors']} tensors, manifest {r['manifest_bytes']} bytes, "
              f"runs {r['runs']}, plan cached on repeats: {r['plan_cached']}")
        print(table([{"phase": k, "first_ms": round(r["first"][k], 3), "warm_ms": round(r["warm"][k], 3)}
                     for k in (*PHASES, "tables_and_rest_ms")], ["phase", "first_ms", "warm_ms"]))
    if gpus > 1 and transport == "cuda_ipc":  # the name this figure had on two GPUs
        result["peer_nvlink_ms"] = result["peer_nixl_ms"]
    key = f"{args.model}-peer" if gpus != 1 else f"{args.model}-peer-1gpu"
    merge_results(results_path(args.device), "swap", key, result)
    print("gpu:", gpu_tag(args.device) if gpu else "cpu")


if __name__ == "__main__":
    main()
