"""On-demand registration from --adapter-source: a request naming an adapter nobody
registered finds it in a source and registers it before it is admitted. One registration
per name at a time: requests racing for one new name share its look-up and the check of its
config and header. Its weights are not read here: its first landing checks them, before a
slot is chosen (AdapterSource.verify_on_landing), and a file refused there is remembered for a while. On
the H200's many-adapters trace (1,000 adapters, 40 requests/s) reading and checking each new
file at registration held look-ups to a p99 of 57 s; header-only, 44 ms (session 24)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from metrale.adapters.sources import AdapterSources
from metrale.errors import AdapterError, AdapterExistsError, SlotBusyError
from metrale.names import is_valid_name

if TYPE_CHECKING:  # engine_api imports the settings, which hold a registrar
    from metrale.server.engine_api import EngineAPI


class SourceRegistrar:
    """Registers a name found in `sources` on first use, single-flight per name."""

    def __init__(self, sources: AdapterSources) -> None:
        self.sources = sources
        self._inflight: dict[str, asyncio.Task] = {}  # name -> its registration

    async def ensure(self, engine: EngineAPI, name: str) -> None:
        """Register `name` from the sources unless the engine knows it (the engine's own
        404 follows when no source holds it; a bad file's AdapterError is raised to every
        request that waited for it). A registered name from a remote store gets its cached
        copy back. Look-ups and fetches run on their source's own threads (never the
        event loop's default executor, which admin calls use)."""
        if not is_valid_name(name):
            return
        if await engine.is_known(name):
            if self.sources.from_remote(name):  # a thread hop only for a copy that may be gone
                fetch = await asyncio.to_thread(self.sources.refresh, name)
                if fetch is not None:
                    await asyncio.wait({asyncio.wrap_future(fetch)})  # best effort: never raises
            return
        task = self._inflight.get(name)
        if task is None or task.get_loop() is not asyncio.get_running_loop():
            task = asyncio.ensure_future(self._register(engine, name))
            self._inflight[name] = task
            task.add_done_callback(lambda t: self._finished(name, t))
        await asyncio.shield(task)  # one request leaving does not cancel the others' wait

    def landing_refused(self, name: str) -> None:
        """A landing refused `name`'s bytes (the registry remembers that for a while): its
        copy is dropped from its store's cache, so the landing after that fetches it again."""
        if self.sources.from_remote(name):
            self.sources.refused(name)

    def in_flight(self) -> int:
        return len(self._inflight)

    async def _register(self, engine: EngineAPI, name: str) -> None:
        found = await asyncio.wrap_future(self.sources.lookup(name))
        if found is None:
            return
        try:  # confined to its root: every read at every landing resolves inside it again
            await engine.register(name, found, verify_on_landing=True)
        except (AdapterExistsError, SlotBusyError):
            # registered by an admin meanwhile; or being unloaded with requests in flight
            # (draining): admission then refuses it as unknown (404), as it does any
            # draining name, not as a busy slot (409)
            pass
        except AdapterError as e:  # refused for its content: not kept, not fetched at once again
            await asyncio.to_thread(self.sources.remember_refusal, name, e)
            raise

    def _finished(self, name: str, task: asyncio.Task) -> None:
        if self._inflight.get(name) is task:
            del self._inflight[name]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have left before it failed
