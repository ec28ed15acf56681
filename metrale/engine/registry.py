"""AdapterRegistry: the one owner of adapter names, versions, pins and routing (name -> the
slot serving its current version). Each registration is an immutable AdapterVersion; a
landing commits only if its version is still current, so a reload can never be undone by
a landing that started before it. No I/O, no slot touched.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path

from metrale.adapters.confined import ConfinedDir
from metrale.errors import (
    AdapterConfigError,
    AdapterExistsError,
    DrainingAdapterError,
    InvalidNameError,
    MetraleError,
    SlotBusyError,
    UnknownAdapterError,
)
from metrale.names import validate_adapter_name
from metrale.pool.slots import SlotTable

PEER_SCHEME = "peer://"
_versions = itertools.count(1)


@dataclass(frozen=True)
class PeerRef:
    addr: str  # host:port of a peer store or engine
    adapter_id: str

    def __str__(self) -> str:
        return f"{PEER_SCHEME}{self.addr}/{self.adapter_id}"


def parse_peer_uri(uri: str) -> PeerRef:
    """peer://host:port/ADAPTER_ID -> PeerRef."""
    rest = uri[len(PEER_SCHEME):]
    addr, sep, adapter_id = rest.partition("/")
    if not uri.startswith(PEER_SCHEME) or not sep or not addr or not adapter_id:
        raise AdapterConfigError(f"peer source {uri!r} must look like peer://host:port/ADAPTER_ID")
    return PeerRef(addr, adapter_id)


@dataclass(frozen=True)
class AdapterSource:
    """Where an adapter's bytes come from: a PEFT directory or a peer.

    verify_on_landing: a directory whose weights were not read at registration (a name
    resolved on demand from --adapter-source): its first landing checks them before a slot
    is chosen (LoraSlots.bound_in_scratch), as a peer's bytes always are checked, and the
    first refusal stays with the version.

    root: the tree a directory was found in (an --adapter-source, an --adapter-root, a
    download cache; resolved, as `path` then is): every read of its files, at registration
    and at every landing, resolves inside it (adapters.confined). None: a directory the
    operator named (--adapter NAME=DIR, the Python API)."""

    path: Path | None = None
    peer: PeerRef | None = None
    peft: object = field(default=None, compare=False)  # a peer adapter's config override
    verify_on_landing: bool = field(default=False, compare=False)
    root: Path | None = None

    @classmethod
    def of(cls, spec: str | Path | ConfinedDir | AdapterSource,
           verify_on_landing: bool = False) -> AdapterSource:
        """verify_on_landing: mark a directory's weights as unread (a peer's always are). A
        ConfinedDir keeps its root."""
        if isinstance(spec, AdapterSource):
            source = spec
        elif isinstance(spec, ConfinedDir):
            source = cls(path=spec.path, root=spec.root)
        elif isinstance(spec, str) and spec.startswith(PEER_SCHEME):
            return cls(peer=parse_peer_uri(spec))
        elif isinstance(spec, (str, Path)):
            source = cls(path=Path(spec))
        else:
            raise AdapterConfigError(f"adapter source {spec!r} must be a directory or peer:// URI")
        if verify_on_landing and source.path is not None and not source.verify_on_landing:
            return replace(source, verify_on_landing=True)
        return source

    def __str__(self) -> str:
        return str(self.peer) if self.peer is not None else str(self.path)


@dataclass(frozen=True)
class AdapterVersion:
    name: str
    source: AdapterSource
    version: int  # process-wide, never reused: a reload always gets a new one
    pinned: bool = False


class AdapterRegistry:
    def __init__(self, reserved_names: tuple[str, ...] = ()) -> None:
        self._current: dict[str, AdapterVersion] = {}
        self._routes: dict[str, int] = {}  # name -> slot serving its current version
        # a pinned name's slot kept for its reloaded version while the old one drains
        self._held: dict[str, int] = {}
        self._draining: dict[str, int] = {}  # unloaded name -> slot still serving it
        # name -> (its version, the refusal of its bytes at a landing, until when): sources
        # whose weights only a landing checks (AdapterSource.verify_on_landing)
        self._refused: dict[str, tuple[int, MetraleError, float]] = {}
        self._reserved = {n.lower() for n in reserved_names}

    # --- reads -------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._current)

    def get(self, name: str) -> AdapterVersion | None:
        return self._current.get(name)

    def changeable(self, name: str) -> AdapterVersion:
        """current(name) for an operation that would change it: a draining name is busy."""
        self.refuse_draining(name)
        return self.current(name)

    def current(self, name: str) -> AdapterVersion:
        version = self._current.get(name)
        if version is None:
            if name in self._draining:
                raise DrainingAdapterError(f"adapter {name!r} is being unloaded")
            raise UnknownAdapterError(
                f"adapter {name!r} is not registered; register it first "
                f"(known: {', '.join(self.names()) or 'none'})")
        return version

    def is_current(self, version: AdapterVersion) -> bool:
        """Pinning keeps the version; only a reload or an unload replaces it."""
        current = self._current.get(version.name)
        return current is not None and current.version == version.version

    def refusal(self, version: AdapterVersion, now: float) -> MetraleError | None:
        """Why `version`'s bytes were refused at a landing, while that refusal lasts."""
        refused = self._refused.get(version.name)
        if refused is None or refused[0] != version.version or now >= refused[2]:
            return None
        return refused[1]

    def draining(self) -> dict[str, int]:
        return dict(self._draining)

    def slot_of(self, name: str) -> int | None:
        """The slot serving `name`'s current version to new requests, or None."""
        return self._routes.get(name)

    def routes(self) -> dict[str, int]:
        return dict(self._routes)

    def held_slot(self, name: str) -> int | None:
        """A pinned name's own slot, waiting for its reloaded version to land in it."""
        return self._held.get(name)

    def pinned_slots(self) -> set[int]:
        """Slots no other adapter may take: those of pinned names, routed or held."""
        return {s for n, s in self._routes.items() if self._current[n].pinned} \
            | set(self._held.values())

    def routed_slots(self) -> set[int]:
        return set(self._routes.values())

    def name_in(self, slot: int) -> str | None:
        """The name routed to `slot`, if any (for views and logs)."""
        return next((n for n, s in self._routes.items() if s == slot), None)

    # --- changes -----------------------------------------------------------------------

    def check_new(self, name: str, reload: bool) -> None:
        """Refusals of register(name, reload) that need no I/O: check before any file."""
        validate_adapter_name(name)
        if name.lower() in self._reserved:
            raise InvalidNameError(
                f"adapter name {name!r} is reserved: it names the base model; choose another")
        self.refuse_draining(name)
        if name in self._current and not reload:
            raise AdapterExistsError(
                f"adapter {name!r} is already registered; unload it first, or reload it to "
                "serve new files under the same name")

    def register(self, name: str, source: str | Path | AdapterSource, pinned: bool = False,
                 reload: bool = False) -> AdapterVersion:
        """A new current version of `name` (its files validated by the caller)."""
        self.check_new(name, reload)
        return self.install(self.new_version(name, source, pinned))

    def new_version(self, name: str, source: str | Path | AdapterSource,
                    pinned: bool = False) -> AdapterVersion:
        """A version not yet current: a landing installs it when it commits. A reload
        keeps the pin unless pinned is given as True."""
        old = self._current.get(name)
        return AdapterVersion(name, AdapterSource.of(source), next(_versions),
                              pinned or bool(old and old.pinned))

    def install(self, version: AdapterVersion) -> AdapterVersion:
        """`version` becomes its name's current one. The old version's slot takes no new
        requests; a pinned name keeps it, held for the new version."""
        self._current[version.name] = version
        self._refused.pop(version.name, None)
        slot = self._routes.pop(version.name, None)
        if version.pinned and slot is not None:
            self._held[version.name] = slot
        return version

    def route(self, version: AdapterVersion, slot: int) -> bool:
        """`slot` now holds `version`: route its name there if it is still current."""
        if not self.is_current(version):
            return False
        self._routes[version.name] = slot
        self._held.pop(version.name, None)
        return True

    def refuse(self, version: AdapterVersion, error: MetraleError, until: float) -> None:
        """A landing refused `version`'s bytes (a file only landings check): its requests
        fail with `error` until then (a fixed file is read again after it), a reload or an
        unload, without a read or a slot each."""
        if self.is_current(version):
            self._refused[version.name] = (version.version, error, until)

    def unroute(self, name: str) -> int | None:
        """`name` stops routing to its slot (drained for a landing); returns the slot."""
        return self._routes.pop(name, None)

    def set_pinned(self, name: str, pinned: bool) -> AdapterVersion:
        version = replace(self.current(name), pinned=pinned)
        self._current[name] = version
        if not pinned:
            self._held.pop(name, None)
        return version

    def unload(self, name: str, draining_slot: int | None) -> AdapterVersion:
        """The name admits nothing from now on; draining_slot serves its requests until drained."""
        self.refuse_draining(name)
        version = self.current(name)
        del self._current[name]
        self._refused.pop(name, None)
        self._routes.pop(name, None)
        self._held.pop(name, None)
        if draining_slot is not None:
            self._draining[name] = draining_slot
        return version

    def drained(self, name: str) -> None:
        self._draining.pop(name, None)

    def refuse_draining(self, name: str) -> None:
        if name in self._draining:
            raise SlotBusyError(
                f"adapter {name!r} is being unloaded and still serves in-flight requests in "
                f"slot {self._draining[name]}; retry when they finish")

    # --- invariants ---------------------------------------------------------------------

    def check_integrity(self, table: SlotTable) -> None:
        """Registry and slot table agree (tests and debugging)."""
        slots = list(self._routes.values())
        assert len(slots) == len(set(slots)), f"a slot routed twice: {self._routes}"
        for name, slot in self._routes.items():
            version = self._current.get(name)
            assert version is not None, f"route of unregistered {name!r}"
            assert table.holds(slot, version.version), \
                f"{name!r} routes to slot {slot}, which holds {table.info(slot)}"
        for name, slot in self._held.items():
            assert self._current[name].pinned and name not in self._routes, f"held {name!r}"
            table.check_slot(slot)
        for name, slot in self._draining.items():
            assert name not in self._current, f"{name!r} both registered and draining"
            table.check_slot(slot)
        table.check_integrity()
