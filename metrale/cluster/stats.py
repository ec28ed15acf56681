"""What a replica reports to the router (Ray Serve's routing stats): residency, idle
slots, queue depth and KV usage. Computed on the engine thread, between steps."""

from __future__ import annotations

from collections import Counter

from metrale.engine.llm_engine import LLMEngine


def routing_stats(engine: LLMEngine) -> dict:
    table, registry = engine.lora.table, engine.registry
    pinned = registry.pinned_slots()
    ready = sorted(registry.routes())
    landing, idle, slots = [], 0, len(table)
    for info in table.infos():
        # a promotion may take an idle READY slot or an EMPTY one now
        idle += info.state.value == "EMPTY" or (
            info.state.value == "READY" and info.ref_count == 0 and info.slot not in pinned)
    promoting = engine.adapters.promoting()
    if promoting:
        landing.append(promoting)
    landing += [name for name, seqs in engine.adapters.pending.items() if seqs]  # next in line
    scheduler = engine.scheduler
    per_adapter = Counter(s.adapter for s in list(scheduler.running) + list(scheduler.waiting)
                          if s.adapter)
    waiting = len(scheduler.waiting)  # requests waiting for a promotion are queued there too
    blocks = engine.blocks
    return {
        "ready": sorted(ready), "warm": sorted(set(landing)), "idle_slots": idle, "slots": slots,
        "running": len(scheduler.running), "waiting": waiting,
        "load": len(scheduler.running) + waiting,
        "adapter_load": dict(per_adapter),
        "kv_usage": 1.0 - blocks.num_free / blocks.num_blocks if blocks.num_blocks else 0.0,
    }
