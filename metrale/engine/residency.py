"""Residency: where every adapter lives, as rows, for every reader of adapter state. The
only module that reads the registry and the slot table together for a view, so a change
to either store changes `residency_rows` alone. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from metrale.engine.registry import AdapterRegistry, AdapterSource, AdapterVersion
from metrale.pool.slots import SlotInfo, SlotState, SlotTable


class Residence(Enum):
    READY = "READY"  # its bytes serve requests now
    LOADING = "LOADING"  # its bytes are being written into the row's slot
    COLD = "COLD"  # a registered name in no slot: its next request promotes it
    EMPTY = "EMPTY"  # a slot holding nothing


@dataclass(frozen=True)
class ResidencyRow:
    """One registered name, or one slot that no registered name routes to: every registered
    name has exactly one row, and so has every slot. uid, generation and last_used are the
    slot's (None when COLD)."""

    # on a slot row: the name it was unloaded under while it drains, else None
    name: str | None
    version: int | None  # the registry's; on a slot row, its bytes' (None unless READY)
    slot: int | None  # None when COLD
    state: Residence  # READY / LOADING / COLD for a name; READY / LOADING / EMPTY for a slot
    refs: int  # in-flight sequences reading the slot
    pinned: bool  # a slot no name routes to is never pinned
    registered: bool  # the name admits new requests (False on every slot row)
    source: AdapterSource | None = None  # None on slot rows
    uid: int | None = None
    generation: int | None = None
    last_used: int | None = None


def loading_of(promotion) -> dict[int, AdapterVersion]:
    """slot -> the version an in-flight promotion (AdapterManager.job, or None) writes
    there: the slot table knows nothing of a LOADING slot's adapter."""
    landing = getattr(promotion, "landing", None)
    return {landing.slot: promotion.version} if landing is not None and landing.is_open else {}


def residency_rows(registry: AdapterRegistry, table: SlotTable,
                   loading: Mapping[int, AdapterVersion] | None = None) -> list[ResidencyRow]:
    """Named rows sorted by name (registered and draining), then the other slots by index."""
    infos = table.infos()
    writing = {v.name: slot for slot, v in (loading or {}).items()
               if registry.is_current(v) and infos[slot].state is SlotState.LOADING}
    named, taken = [], set()
    for name in registry.names():
        version = registry.get(name)
        slot = registry.slot_of(name)
        slot = writing.get(name) if slot is None else slot
        taken.add(slot)
        named.append(ResidencyRow(
            name, version.version, slot, Residence.COLD, 0, version.pinned, True,
            version.source) if slot is None else _slot_row(
            infos[slot], name, version.version, version.pinned, True, version.source))
    for name, slot in registry.draining().items():
        taken.add(slot)
        named.append(_slot_row(infos[slot], name))
    named.sort(key=lambda r: r.name)
    return named + [_slot_row(i) for i in infos if i.slot not in taken]


def _slot_row(info: SlotInfo, name: str | None = None, version: int | None = None,
              pinned: bool = False, registered: bool = False,
              source: AdapterSource | None = None) -> ResidencyRow:
    version = info.version if version is None else version
    return ResidencyRow(name, version, info.slot, Residence(info.state.value), info.ref_count,
                        pinned, registered, source, info.uid, info.generation, info.last_used)
