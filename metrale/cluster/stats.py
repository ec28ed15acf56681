"""What a replica reports to the router (Ray Serve's routing stats, read by
router.AdapterAffinityRouter.view): residency, idle slots and load. Computed on the
engine thread, between steps."""

from __future__ import annotations

from collections import Counter

from metrale.engine.llm_engine import LLMEngine
from metrale.engine.residency import Residence


def routing_stats(engine: LLMEngine) -> dict:
    ready, landing, idle, slots = [], [], 0, 0
    for row in engine.residency():
        slots += row.slot is not None
        if row.registered and row.state is Residence.READY:
            ready.append(row.name)
            idle += row.refs == 0 and not row.pinned  # a promotion may take it now
        elif row.registered and row.state is Residence.LOADING:
            landing.append(row.name)
        elif row.state is Residence.EMPTY:
            idle += 1
    promoting = engine.adapters.promoting()
    if promoting:
        landing.append(promoting)
    landing += [name for name, seqs in engine.adapters.pending.items() if seqs]  # next in line
    scheduler = engine.scheduler
    per_adapter = Counter(s.adapter for s in list(scheduler.running) + list(scheduler.waiting)
                          if s.adapter)
    return {
        "ready": sorted(ready), "warm": sorted(set(landing)), "idle_slots": idle, "slots": slots,
        # requests waiting for a promotion are queued in `waiting` too
        "load": len(scheduler.running) + len(scheduler.waiting),
        "adapter_load": dict(per_adapter),
    }
