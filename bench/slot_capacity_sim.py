"""How low can TTFT p99 go with 8 slots under bench/churn.py's load? An event simulation
of slot occupancy alone: no GPU, no engine; every cost is an input, taken from the H200
churn run (bench/results/20261201-h200.json, churn.llama3.2-1b).

    python bench/slot_capacity_sim.py [--slots 8] [--seeds 5]

Model: the churn trace (32 adapters, Zipf 1.1, Poisson 150 req/s for 8 s, the same
`bench.churn.trace`). A request holds its adapter's slot from admission until its last
token: `first_token_ms` then `gen` tokens at `itl_ms` each. Batches are unbounded and
steps free, so a request whose adapter is resident starts at once; one whose adapter is
not waits for a slot no request holds, then pays `landing_ms`. Everything favours the
scheduler except the slots themselves, so the figures are lower bounds for any policy
that never preempts a running request (what the engine guarantees: a busy slot is never
replaced mid-decode).

Policies: "free" lands into a slot when one empties by itself; "drain" also stops
admitting new requests to the slot that would empty first (the engine's slot drain),
so a waiting adapter gets it as soon as its running requests end; "oracle-drain" drains
for every waiting adapter at once, the slots emptying soonest first.
"""

from __future__ import annotations

import argparse
import heapq
import statistics

from bench.churn import trace


def simulate(arrivals: list[tuple[float, str]], slots: int, policy: str, gen: int,
             itl_ms: float, first_token_ms: float, landing_ms: float) -> list[float]:
    """TTFT (ms) of every request."""
    hold = first_token_ms + gen * itl_ms  # ms a request holds its slot
    resident: dict[str, int] = {}  # adapter -> slot
    running: dict[int, list[float]] = {s: [] for s in range(slots)}  # slot -> end times
    draining: set[int] = set()
    last_used: dict[int, float] = {s: -1.0 for s in range(slots)}
    waiting: list[tuple[float, str]] = []
    ttft: list[float] = []
    events = [t * 1e3 for t, _ in arrivals]
    heapq.heapify(events)
    pending = sorted((t * 1e3, a) for t, a in arrivals)
    i = 0
    while events:
        now = heapq.heappop(events)
        while i < len(pending) and pending[i][0] <= now:
            waiting.append(pending[i])
            i += 1
        for s in running:
            running[s] = [e for e in running[s] if e > now]
            if not running[s] and s in draining:  # drained: its adapter leaves for a cold one
                draining.discard(s)
                resident = {a: x for a, x in resident.items() if x != s}
        still = []
        for arrived, adapter in waiting:  # resident adapters start at once (oldest first)
            s = resident.get(adapter)
            if s is not None and s not in draining:
                running[s].append(now + hold)
                last_used[s] = now
                heapq.heappush(events, now + hold)
                ttft.append(now - arrived + first_token_ms)
            else:
                still.append((arrived, adapter))
        waiting, still = still, []
        for arrived, adapter in waiting:  # then cold adapters, oldest first, into free slots
            s = resident.get(adapter)
            free = [f for f in running if not running[f]]
            if s is None and free:
                s = min(free, key=lambda f: last_used[f])
                resident = {a: x for a, x in resident.items() if x != s}
                resident[adapter] = s
                start = now + landing_ms
                running[s].append(start + hold)
                last_used[s] = start
                heapq.heappush(events, start + hold)
                ttft.append(start - arrived + first_token_ms)
            elif s is not None and not running[s]:  # its own slot drained
                running[s].append(now + hold)
                heapq.heappush(events, now + hold)
                ttft.append(now - arrived + first_token_ms)
            else:
                still.append((arrived, adapter))
        waiting = still
        cold = {a for _, a in waiting if a not in resident}
        if policy != "free" and cold:
            want = len(cold) if policy == "oracle-drain" else 1
            busy = sorted((max(running[s]), s) for s in running if running[s] and s not in draining)
            for end, s in busy[:max(0, want - len(draining))]:
                draining.add(s)
                heapq.heappush(events, end)
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--itl-ms", type=float, default=2.33, help="churn promote ITL p50")
    ap.add_argument("--first-token-ms", type=float, default=4.0, help="a prefill step")
    ap.add_argument("--landing-ms", type=float, default=0.5, help="host tier, 1B slot")
    ap.add_argument("--resident-ttft-p99-ms", type=float, default=10.8,
                    help="the all-resident run's TTFT p99 (the 5x line's base)")
    args = ap.parse_args()
    print(f"slots {args.slots}, hold {args.first_token_ms + args.gen * args.itl_ms:.1f} ms, "
          f"5x resident p99 = {5 * args.resident_ttft_p99_ms:.0f} ms")
    for policy in ("free", "drain", "oracle-drain"):
        p99s, p50s = [], []
        for seed in range(args.seeds):
            arrivals = [(t, a) for t, _, a in trace(32, 8.0, 150.0, 1000, seed=seed)]
            ttft = sorted(simulate(arrivals, args.slots, policy, args.gen, args.itl_ms,
                                   args.first_token_ms, args.landing_ms))
            p99s.append(ttft[int(0.99 * (len(ttft) - 1))])
            p50s.append(statistics.median(ttft))
        print(f"{policy:13} TTFT p50 {statistics.mean(p50s):6.1f} ms  p99 "
              f"{statistics.mean(p99s):6.1f} ms (seeds: {', '.join(f'{p:.0f}' for p in p99s)})")


if __name__ == "__main__":
    main()
