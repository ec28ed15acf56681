"""Many adapters behind one engine (issue 28): 1,000 adapters on local disk behind a directory
adapter source (`--adapter-source`), 32 slots, a host tier of 8 GB, Zipf request traces. What
the eviction policy ("cost": decayed, cost-weighted use counts in the host tier, and slots
giving up first the adapters the tier holds; "lru": most recent at both, as before) does to
the hit rate, against the clairvoyant bound on the same trace and capacities.

    python bench/many_adapters.py --simulate              # CPU, virtual time (~minutes)
    python bench/many_adapters.py                         # the device run: llama3-8b, cuda
    python bench/many_adapters.py --tiny --adapters 50 --requests 200   # CPU smoke run

hit_rate: the share of requests that needed no read from disk: their adapter was in a slot
(or already on its way into one for an earlier request, or draining from one) or in the host
tier; 1 - (landings - host-tier landings) / requests, counted by the engine (ready_on_arrival:
the share resident at once; tier_landings, disk_reads: counts). clairvoyant_hit_rate: Belady's
MIN (bench/cluster_sim.py) over the slots and the tier's images as one cache of 32 + N
adapters on the same trace. It bounds every eviction policy that serves requests in arrival
order: slots and tier together never hold more than 32 + N distinct adapters (the tier copies
adapters that also sit in slots, so usually fewer), a request without its adapter there costs
a read that brings it in (no bypass: it lands into a slot), and MIN is optimal for a
demand-filled cache. The engine may reorder within a landing's wait (a request for a resident
adapter runs while an earlier one waits), which could beat the bound by a hair; it did not in
these runs. lru_hit_rate: the same trace on an engine whose tier is "lru" (the behaviour
before issue 28); hit_rate is the "cost" policy's.

Trace (bench/cluster_sim.py's `arrivals`): Poisson arrivals at --rate, adapters drawn
Zipf(alpha) over --adapters (ranks shuffled), each request --prompt-len prompt tokens and
32-96 generated tokens, holding its adapter's slot for its whole run (busy slots are never
victims). Loads: zipf1.1, zipf0.8, and shift1.1 (Zipf 1.1 whose hot set is redrawn every
--shift-s seconds).

--simulate drives the real engine (scheduler, adapter manager, promotions, SlotTable,
HostTier and its EvictionPolicy) on a tiny model on the CPU in virtual time; only the
forward pass is replaced, by a step time fitted to the H200's Llama-3-8B decode steps
(bench/cluster_sim.py measured_times, the newest H200 decode: ~5.7 ms + 0.023 ms per token
in the step since 20261203-h200.json, ~7.0 + 0.028 before, so a request runs ~0.2-0.7 s).
Promotions run inline and take no virtual time: on the H200 a disk read runs on the
promotion worker beside the steps and a tier landing is one ~1.7 ms copy, against runs
of hundreds of ms, so what is resident when is modelled; what is not is the promotion
path's throughput (one at a time, ~50 ms each from start to commit for the 8B
on the H200: at 60 requests/s it fell behind there). The tier holds as many images as
--host-tier-gb holds of the 8B's 86.6 MB r16 slots (8 GB: 92), of the tiny model's.
Adapters are registered the way the server's source look-up does it: the first request
for a name finds it in the source directory and registers it (no registration up front).

The device run (default) serves the same kind of trace through AsyncEngine (the server's
engine thread) in real time, each request first looked up in the source the way the
server does, and reports TTFT (after the first --ttft-skip of the trace: the cold start;
ttft_p99_ms_all counts it), the time spent in that look-up, landing times and the hit rates;
JSON `many_adapters[<model>]`, the runs of one trace merged across commands (--policies cost,
then --policies lru fit the device's 10 minutes each). With --register-first (default) every
name of the trace is looked up and registered through the source before the trace, as on a
server that has seen each name once; --no-register-first leaves each name's first sight in
the trace. A name's registration from a source reads its config and header only (its
weights are checked in the slot when it lands: AdapterSource.verify_on_landing). When it
read and checked the whole file (~40-85 ms of CPU per 84 MB, on threads that barely ran in
parallel), the H200's look-ups at 40 requests/s reached a p99 of 57 s (105 s before
registration was single-flight per name), and that was the TTFT p99 (session 24).
The adapter files: --distinct-files random r16 files (bench/common.write_random_adapters),
each adapter's directory holding its own config and a hard link to one of them (1,000 x 84 MB would not fit
the device machine's disk; the engine keys adapters by directory, so they are 1,000 adapters
to every cache, while the page cache holds the few files: a read is a warm one). Simulation JSON:
`many_adapters["simulate"]`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.churn_sim import VirtualClock  # noqa: E402
from bench.cluster_sim import (  # noqa: E402
    Request,
    ServiceTimes,
    arrivals,
    clairvoyant_hit_rate,
    measured_times,
)
from bench.common import (  # noqa: E402
    build_pair,
    hf_config,
    merge_results,
    pct,
    results_path,
    table,
    write_random_adapters,
)
from metrale.adapters.sources import AdapterSources  # noqa: E402
from metrale.config import EVICTION_POLICIES, EngineConfig, ModelConfig, PoolConfig  # noqa: E402
from metrale.engine.llm_engine import LLMEngine  # noqa: E402
from metrale.engine.sampler import SampledTokens  # noqa: E402
from metrale.engine.sampling_params import SamplingParams  # noqa: E402
from metrale.pool.eviction import EvictionConfig, EvictionPolicy, Offer  # noqa: E402
from metrale.pool.layout import SlotLayout  # noqa: E402
from metrale.server.source_registration import SourceRegistrar  # noqa: E402

SLOTS = 32
WARM_ADAPTERS = 4  # the device run's warm-up lands these (not in the trace) first
LOADS = {"zipf1.1": (1.1, False), "zipf0.8": (0.8, False), "shift1.1": (1.1, True)}
# When measured_times() finds no H200 results: its figures from 20261130-h200.json.
FALLBACK_TIMES = ServiceTimes(0.00697, 2.85e-05, 0.0198, 0.0215, "constants (20261130-h200.json)")


def slot_bytes_8b() -> int:
    """The bytes of one Llama-3-8B r16 all-linear slot in bf16 (86,638,592)."""
    cfg = ModelConfig.from_hf_dict(hf_config("llama3-8b").to_dict())
    return SlotLayout(cfg, PoolConfig(1, 16), torch.bfloat16).slot_bytes


def tier_entries(host_tier_gb: float) -> int:
    """Images of 8B slots that --host-tier-gb (decimal GB) holds: 8 GB -> 92."""
    return int(host_tier_gb * 1e9) // slot_bytes_8b()


def make_load(args, name: str) -> list[Request]:
    alpha, shifts = LOADS[name]
    seconds = args.requests / args.rate * 1.5 + 1.0  # enough arrivals, then cut
    load = arrivals(args.adapters, alpha, args.rate, seconds, args.shift_s if shifts else None,
                    args.seed)[:args.requests]
    if len(load) < args.requests:
        raise SystemExit(f"the trace has {len(load)} requests, fewer than --requests")
    return load


def write_adapters(pair, root: Path, distinct: int, names: list[str]) -> Path:
    """root/source/<name> for each name: its own adapter_config.json and a hard link to
    one of `distinct` copies of one random r16 file. Returns the source directory."""
    write_random_adapters(pair, 1, root / "template")
    template = root / "template" / "a0"
    files = []
    for j in range(distinct):
        files.append(root / "weights" / f"w{j}.safetensors")
        files[-1].parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template / "adapter_model.safetensors", files[-1])
    source = root / "source"
    for i, name in enumerate(names):
        d = source / name
        d.mkdir(parents=True)
        shutil.copyfile(template / "adapter_config.json", d / "adapter_config.json")
        os.link(files[i % distinct], d / "adapter_model.safetensors")
    return source


def adapter_name(i: int) -> str:
    return f"a{i:04d}"


def names_of(n: int) -> list[str]:
    return [adapter_name(i) for i in range(n)]


def engine_config(args, device: str, slot_bytes: int, policy: str) -> EngineConfig:
    return EngineConfig(
        pool=PoolConfig(SLOTS, 16, host_tier_bytes=tier_entries(args.host_tier_gb) * slot_bytes,
                        eviction=policy),
        device=device, dtype="bfloat16" if device.startswith("cuda") else "float32",
        max_model_len=256, block_size=16, num_kv_blocks=args.max_num_seqs * 256 // 16,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False, async_promotions=not args.simulate)


class GdsfPolicy:
    """GDSF (Cherkasova 1998), for comparison only: priority = clock + uses x cost, the clock
    raised to each victim's priority on eviction; uses remembered for keys no longer held
    (ghosts x capacity of them), as the cost policy does. EvictionPolicy's interface."""

    def __init__(self, capacity: int, ghosts: float) -> None:
        self.capacity, self.clock = capacity, 0.0
        self.held: dict[str, tuple[float, int]] = {}  # key -> (priority, stamp)
        self.uses: OrderedDict[str, float] = OrderedDict()  # held and remembered keys
        self.max_remembered = int(capacity * (1 + ghosts))
        self.stamps = itertools.count()

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, key: object) -> bool:
        return key in self.held

    def keys(self) -> list[str]:
        return list(self.held)

    def _use(self, key: str, cost: float) -> None:
        self.uses[key] = self.uses.get(key, 0.0) + cost
        self.uses.move_to_end(key)
        if len(self.uses) > self.max_remembered:
            gone = next((k for k in self.uses if k not in self.held), None)
            if gone is not None:
                del self.uses[gone]
        self.held[key] = (self.clock + self.uses[key], next(self.stamps))

    def hit(self, key: str, cost: float = 1.0) -> None:
        self._use(key, cost)

    def offer(self, key: str, cost: float = 1.0) -> Offer:
        evicted = None
        if key not in self.held and len(self.held) >= self.capacity:
            evicted = min(self.held, key=self.held.get)
            self.clock = self.held.pop(evicted)[0]
        self._use(key, cost)
        return Offer(True, evicted)

    def discard(self, key: str) -> None:
        del self.held[key]


# --policies beyond the engine's own: the engine runs "cost" with its tier's policy replaced,
# or without the slots' preference for victims whose image the tier holds ("cost-tier")
COMPARISONS = ("cost-tier", "gdsf", "lfu")


def set_policy(engine: LLMEngine, name: str, args) -> None:
    """The tier's policy for a run: "cost" with --half-life / --ghosts / --admission, "lfu"
    (the cost policy without aging), "gdsf" (GdsfPolicy), "cost-tier" (cost in the tier, the
    slots' victims by recency alone, as under lru); "lru" as the engine built it."""
    tier = engine.lora.host_tier
    if name == "lru":
        return
    if name == "cost-tier":
        engine.lora.cheap_slots = lambda dirs: set()
    half_life = 1e12 if name == "lfu" else args.half_life
    tier.policy = GdsfPolicy(tier.max_entries, args.ghosts) if name == "gdsf" else \
        EvictionPolicy(tier.max_entries, EvictionConfig(
            "cost", half_life=half_life, ghosts=args.ghosts, admission=args.admission))


def counters(engine: LLMEngine) -> dict:
    tier, mgr = engine.lora.host_tier, engine.adapters
    return {"landings": mgr.num_promotions, "tier_hits": tier.hits,
            "ready_on_arrival": mgr.num_ready_on_arrival, "tier_refused": tier.refused}


def rates(before: dict, after: dict, requests: int) -> dict:
    d = {k: after[k] - before[k] for k in before}
    disk = d["landings"] - d["tier_hits"]
    return {"requests": requests, "hit_rate": 1 - disk / requests,
            "ready_on_arrival": d["ready_on_arrival"] / requests,  # share: resident at once
            "tier_landings": d["tier_hits"], "disk_reads": disk, "landings": d["landings"],
            "tier_refused": d["tier_refused"]}


def prompts(load: list[Request], vocab: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in load]


# --- the simulation: the real engine in virtual time ------------------------------------------


def simulate_run(pair, source: Path, load: list[Request], policy: str, args,
                 times: ServiceTimes) -> dict:
    slot_bytes = SlotLayout(pair.config, PoolConfig(1, 16), torch.float32).slot_bytes
    clock = VirtualClock()
    real_monotonic, real_perf = time.monotonic, time.perf_counter
    time.monotonic = time.perf_counter = clock
    try:
        engine = LLMEngine(pair.model_dir, engine_config(
            args, "cpu", slot_bytes, "lru" if policy == "lru" else "cost"), model=pair.ours)
        set_policy(engine, policy, args)

        def fake_run(batch, in_flight=None):
            clock.now += times.step(batch.num_tokens, 0)
            n = len(batch.sampling_seqs)  # token 1 for every sampling row, all finite
            return SampledTokens(batch.sampling_seqs, torch.ones(n, dtype=torch.int64),
                                 torch.zeros(n), torch.ones(n, dtype=torch.bool))

        engine.runner.run = fake_run
        sources = AdapterSources([source])
        ids = prompts(load, pair.config.vocab_size, args.prompt_len, args.seed)
        before, start, i, idle_steps = counters(engine), clock.now, 0, 0
        while i < len(load) or engine.has_unfinished_requests():
            while i < len(load) and start + load[i].arrival <= clock.now:
                r, name = load[i], adapter_name(load[i].adapter)
                if engine.registry.get(name) is None:  # the server's source look-up
                    engine.register_adapter(name, sources.find(name))
                engine.add_request(ids[i], SamplingParams(max_tokens=r.tokens, temperature=0,
                                                          ignore_eos=True),
                                   adapter=name, request_id=f"r{i}")
                i += 1
            if not engine.has_unfinished_requests():
                clock.now = start + load[i].arrival
                continue
            now = clock.now
            engine.step()
            if clock.now == now:  # nothing ran (a promotion's boundary): move on
                clock.now += 1e-4
                idle_steps += 1
        out = rates(before, counters(engine), len(load))
        out["virtual_s"] = clock.now - start
        out["idle_steps"] = idle_steps
        engine.check_integrity()
        return out
    finally:
        time.monotonic, time.perf_counter = real_monotonic, real_perf


def simulate(args) -> dict:
    torch.set_num_threads(1)
    try:
        times = measured_times()
    except SystemExit:
        times = FALLBACK_TIMES
    entries = tier_entries(args.host_tier_gb)
    rows, loads = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        pair = build_pair("tiny", "cpu", Path(tmp))
        source = write_adapters(pair, Path(tmp), args.distinct_files, names_of(args.adapters))
        for load_name in args.loads:
            load = make_load(args, load_name)
            bound = clairvoyant_hit_rate(load, SLOTS + entries)
            res = {"clairvoyant_hit_rate": bound}
            for policy in args.policies:
                t0 = time.perf_counter()
                run = simulate_run(pair, source, load, policy, args, times)
                run["wall_s"] = time.perf_counter() - t0
                res[policy] = run
                rows.append({"load": load_name, "policy": policy, **run,
                             "clairvoyant_hit_rate": bound,
                             "hit_over_clairvoyant": run["hit_rate"] / bound})
                print(table(rows[-1:], ROW_COLS), flush=True)
            if "cost" in res:
                res["hit_rate"] = res["cost"]["hit_rate"]
            if "lru" in res:
                res["lru_hit_rate"] = res["lru"]["hit_rate"]
            loads[load_name] = res
    print()
    print(table(rows, ROW_COLS))
    return {"mode": "simulate", "loads": loads, "rows": rows, "tier_entries": entries,
            "slots": SLOTS, "service_times": times.__dict__}


ROW_COLS = ["load", "policy", "hit_rate", "clairvoyant_hit_rate", "hit_over_clairvoyant",
            "ready_on_arrival", "tier_landings", "disk_reads", "tier_refused", "virtual_s"]


# --- the device run: AsyncEngine in real time --------------------------------------------------


async def register_all(engine, sources: SourceRegistrar, adapters: list[int],
                       at_once: int = 16) -> None:
    """The server's look-up (SourceRegistrar.ensure) for each adapter, `at_once` at a time
    (the files' checks bound how fast this goes)."""
    gate = asyncio.Semaphore(at_once)

    async def one(a: int) -> None:
        async with gate:
            await sources.ensure(engine, adapter_name(a))

    await asyncio.gather(*(one(a) for a in adapters))


async def serve_trace(engine, sources: SourceRegistrar, load: list[Request],
                      ids: list[list[int]]) -> list[tuple[float, float]]:
    """Each request at its arrival time; (TTFT, the part of it spent looking its adapter up
    and registering it) in seconds for each."""
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05

    async def one(r: Request, prompt: list[int]) -> tuple[float, float]:
        await asyncio.sleep(max(0.0, start + r.arrival - loop.time()))
        arrived = loop.time()
        name = adapter_name(r.adapter)
        await sources.ensure(engine, name)  # as the server does for every request
        registered = loop.time()
        params = SamplingParams(max_tokens=r.tokens, temperature=0, ignore_eos=True)
        first = None
        async for _ in engine.generate(prompt, params, adapter=name):
            first = first or loop.time()
        return first - arrived, registered - arrived

    return await asyncio.gather(*(one(r, p) for r, p in zip(load, ids)))


def device_run(pair, source: Path, load: list[Request], policy: str, args) -> dict:
    from metrale.server.async_engine import AsyncEngine  # prometheus_client: the device has it

    dtype = next(pair.ours.parameters()).dtype
    slot_bytes = SlotLayout(pair.config, PoolConfig(1, 16), dtype).slot_bytes
    llm = LLMEngine(pair.model_dir, engine_config(args, args.device, slot_bytes, policy),
                    model=pair.ours)
    engine = AsyncEngine(llm)
    landings: list[float] = []  # promotion start to commit, s (the engine thread appends)
    llm.lora.listeners.append(lambda e: landings.append(e.seconds) if e.error is None else None)
    engine.start()
    sources = SourceRegistrar(AdapterSources([source]))
    vocab = pair.config.vocab_size
    try:
        # warm-up (arena pinning, first landings, graphs) on adapters outside the trace
        warm = [Request(i, args.adapters + i % WARM_ADAPTERS, 0.01 * i, 16, 0)
                for i in range(16)]
        asyncio.run(serve_trace(engine, sources, warm, prompts(warm, vocab, args.prompt_len, 1)))
        registered_s = None
        if args.register_first:  # every name of the trace seen once: registered, not landed
            t0 = time.perf_counter()
            asyncio.run(register_all(engine, sources, sorted({r.adapter for r in load})))
            registered_s = time.perf_counter() - t0
        before = asyncio.run(engine.call(lambda: counters(llm)))
        mapped0, landed0 = llm.lora.mapped_files.registrations, len(landings)
        t0 = time.perf_counter()
        timed = asyncio.run(serve_trace(engine, sources, load,
                                        prompts(load, vocab, args.prompt_len, args.seed)))
        wall = time.perf_counter() - t0
        after = asyncio.run(engine.call(lambda: counters(llm)))
    finally:
        asyncio.run(engine.shutdown())
    skip = int(len(timed) * args.ttft_skip)  # the cold start: every adapter a miss at first
    ms, reg = [t * 1e3 for t, _ in timed[skip:]], [r * 1e3 for _, r in timed[skip:]]
    land = [t * 1e3 for t in landings[landed0:]]
    every = [t * 1e3 for t, _ in timed]
    return {**rates(before, after, len(load)), "ttft_p50_ms": pct(ms, 50),
            "ttft_p99_ms": pct(ms, 99), "ttft_max_ms": max(ms), "ttft_from_request": skip,
            "ttft_p99_ms_all": pct(every, 99), "wall_s": wall, "register_first_s": registered_s,
            "lookup_p50_ms": pct(reg, 50), "lookup_p99_ms": pct(reg, 99),
            "landing_p50_ms": pct(land, 50), "landing_p99_ms": pct(land, 99),
            "mapped_file_registrations": llm.lora.mapped_files.registrations - mapped0}


def device(args) -> dict:
    import gc

    entries = tier_entries(args.host_tier_gb)
    load_name = args.loads[0]
    load = make_load(args, load_name)
    bound = clairvoyant_hit_rate(load, SLOTS + entries)
    out = {"mode": "device", "load": load_name, "clairvoyant_hit_rate": bound,
           "tier_entries": entries, "slots": SLOTS, "trace": trace_key(args)}
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        pair = build_pair(args.model, args.device, Path(tmp))
        # the trace's adapters, and four outside it for the warm-up
        source = write_adapters(pair, Path(tmp), args.distinct_files,
                                names_of(args.adapters + WARM_ADAPTERS))
        for policy in args.policies:
            res = device_run(pair, source, load, policy, args)
            out[policy] = res
            print(policy, json.dumps(res), flush=True)
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return out


def trace_key(args) -> dict:
    """What makes two device runs' traces the same (their policies' results then merge)."""
    return {k: getattr(args, k) for k in ("loads", "adapters", "requests", "rate", "prompt_len",
                                          "host_tier_gb", "seed", "register_first", "model")}


def merged(res: dict, out: Path, key: str) -> dict:
    """A device run adds its policies to an earlier run's of the same trace in `out` (one
    command per policy fits the device's 10 minutes), then names the headline figures:
    hit_rate and ttft_p99_ms of "cost", lru_hit_rate and lru_ttft_p99_ms of "lru"."""
    old = json.loads(out.read_text()).get("many_adapters", {}).get(key) if out.exists() else None
    if old and old.get("trace") == res["trace"]:
        res = {**{p: old[p] for p in EVICTION_POLICIES if p in old}, **res}
    for policy, prefix in (("cost", ""), ("lru", "lru_")):
        if policy in res:
            res[f"{prefix}hit_rate"] = res[policy]["hit_rate"]
            res[f"{prefix}ttft_p99_ms"] = res[policy]["ttft_p99_ms"]
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--simulate", action="store_true",
                    help="the real engine on a tiny CPU model in virtual time (no GPU)")
    ap.add_argument("--model", default="llama3-8b", help="bench.common CONFIGS name (device run)")
    ap.add_argument("--tiny", action="store_true", help="--model tiny (a CPU smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=None,
                    help="trace length (default: 20,000 simulated, 6,000 on the device)")
    ap.add_argument("--rate", type=float, default=40.0,
                    help="requests per second (on the H200, 60/s outran the one-at-a-time "
                         "promotions of 8B adapters: ~50 ms each from start to commit)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--host-tier-gb", type=float, default=8.0)
    ap.add_argument("--shift-s", type=float, default=20.0, help="hot-set period of shift1.1")
    ap.add_argument("--loads", nargs="+", choices=list(LOADS), default=None,
                    help="default: all three simulated, zipf1.1 on the device")
    ap.add_argument("--policies", nargs="+", choices=[*EVICTION_POLICIES, *COMPARISONS],
                    default=list(EVICTION_POLICIES),
                    help="the engine's policies; --simulate also takes the comparison-only "
                         "cost-tier (cost without its slot-victim order), gdsf (GDSF's clock) "
                         "and lfu (cost without aging)")
    ap.add_argument("--half-life", type=float, default=EvictionConfig.half_life)
    ap.add_argument("--ghosts", type=float, default=EvictionConfig.ghosts)
    ap.add_argument("--admission", action=argparse.BooleanOptionalAction,
                    default=EvictionConfig.admission)
    ap.add_argument("--register-first", action=argparse.BooleanOptionalAction, default=True,
                    help="device run: look up and register every adapter of the trace through "
                         "the source before it (a server that has seen each name once); "
                         "--no-register-first leaves each name's look-up and registration (its "
                         "config and header) in its first request's TTFT")
    ap.add_argument("--ttft-skip", type=float, default=0.2,
                    help="device run: TTFT percentiles leave out this share of the trace's "
                         "first requests (the cold start); ttft_p99_ms_all counts them")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--distinct-files", type=int, default=8)
    ap.add_argument("--workdir", default=None, help="where the adapter files go (a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="results JSON (default: bench/results/<date>-<device>.json)")
    args = ap.parse_args(argv)
    if not args.simulate and set(args.policies) - set(EVICTION_POLICIES):
        ap.error(f"{', '.join(COMPARISONS)} are simulated only (--simulate)")
    if args.tiny:
        args.model = "tiny"
    args.requests = args.requests or (20_000 if args.simulate else 6_000)
    args.loads = args.loads or (list(LOADS) if args.simulate else ["zipf1.1"])
    res = simulate(args) if args.simulate else device(args)
    res.update(date=f"{datetime.date.today()}", command="python " + " ".join(
        sys.argv if argv is None else ["bench/many_adapters.py", *argv]),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    out = args.out or results_path("cpu" if args.simulate else args.device)
    if not args.simulate:
        res = merged(res, out, args.model)
    merge_results(out, "many_adapters", "simulate" if args.simulate else args.model, res)
    print(f"wrote {out}")
    return res


if __name__ == "__main__":
    main()
