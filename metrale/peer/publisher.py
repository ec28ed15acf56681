"""A trainer's side of a push (docs/DESIGN.md, "Peers"): an RL loop's adapter versions,
landed from its memory into a small pool with a disk landing's checks (no file is
written) and served over the peer protocol as a store's; push() registers each version.

Only the newest version is ever landed later (the registry routes new requests to it),
so the pool keeps it and reuses the older slots, except one a lease still reads from.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from metrale.adapters.peft_config import PeftAdapterConfig
from metrale.adapters.plan import AdapterPlan, plan_from_tensors, resolve_targets
from metrale.adapters.safetensors_file import TensorEntry
from metrale.config import ModelConfig
from metrale.errors import AdapterConfigError
from metrale.peer.exporter import AdapterExporter
from metrale.peer.http_server import PeerHTTPServer
from metrale.peer.manifest import DTYPE_NAMES
from metrale.peer.store import StoreNames, fitted_pool, probe_pool, resolve_transports
from metrale.pool.landing import Landing
from metrale.pool.staged import stage
from metrale.pool.swap import LoraSlots, Prepared

log = logging.getLogger("metrale.peer")


def _plain(value: object) -> object:
    """JSON for what PEFT's LoraConfig.to_dict holds besides plain values (sets, enums)."""
    return sorted(value) if isinstance(value, set | frozenset) else str(value)


class AdapterPublisher:
    def __init__(self, model_dir: str | Path, peft_config: Mapping | object, *,
                 device: str = "cuda", dtype: torch.dtype = torch.bfloat16, slots: int = 3,
                 host: str = "127.0.0.1", port: int = 0, transport: str = "auto") -> None:
        """peft_config: the LoRA config of every version (a dict or PEFT's LoraConfig);
        the pool is sized to it. slots >= 2: the newest version and one being read."""
        if slots < 2:
            raise AdapterConfigError(f"slots must be >= 2 (the newest and one being read), got {slots}")
        raw = peft_config if isinstance(peft_config, Mapping) else peft_config.to_dict()
        self.config = PeftAdapterConfig.from_dict(json.loads(json.dumps(raw, default=_plain)))
        model, rank = ModelConfig.from_dir(model_dir), self.config.max_rank()
        targets = resolve_targets(self.config, model, probe_pool(rank))
        self.slots = LoraSlots(model, fitted_pool(targets, slots, rank), device, dtype)
        self.ids, self._newest = StoreNames(), None
        self._lock = threading.Lock()  # the slot table: publishes here, leases on HTTP threads
        self._versions = itertools.count(1)
        self._sections: dict[tuple, tuple] = {}  # tensor layout -> _section (the last one)
        self.exporter = AdapterExporter(self.slots, self.ids, call=self._call,
                                        peft_for=lambda _: self.config,
                                        transports=resolve_transports(transport)).start()
        self.server = PeerHTTPServer(self.exporter, host, port).start()
        self.address = self.server.url.removeprefix("http://")

    def _call(self, fn: Callable[[], object]) -> object:
        with self._lock:
            return fn()

    def publish(self, tensors: Mapping[str, torch.Tensor]) -> str:
        """Land a new version of the adapter from `tensors` (PEFT's keys, e.g. a
        get_peft_model_state_dict); returns its source, peer://host:port/<id>."""
        version = next(self._versions)
        adapter_id = f"v{version}"
        prepared = self._prepare(tensors)
        with self._lock:
            newest = () if self._newest is None else (self._newest,)
            slot = self.slots.table.select_victim(pinned=newest)  # POOL_FULL: all being read
            self.slots.land(slot, version, prepared)
            self.ids.add(adapter_id, slot)
            self._newest = slot
        return f"peer://{self.address}/{adapter_id}"

    def _prepare(self, tensors: Mapping[str, torch.Tensor]) -> Prepared:
        """The tensors as one data section on the pool's device, planned and checked."""
        layout = tuple((key, t.dtype, t.shape) for key, t in tensors.items())
        section = self._sections.get(layout)
        if section is None:  # a training loop pushes one layout: planned once (~10 ms on an 8B)
            section = self._section(layout)
            self._sections = {layout: section}
        plan, data, views = section
        with torch.no_grad():  # one multi-tensor copy: a call per tensor cost ~2 ms on an 8B
            torch._foreach_copy_(views, list(tensors.values()))
        if plan.spans:  # keys that land nowhere (e.g. frozen copies) are not staged
            data = torch.cat([data[a:b] for a, b in plan.spans])
        staged = stage(plan, data, self.slots.recipes.get(plan))  # raises on NaN/Inf, naming a tensor
        return Prepared(functools.partial(Landing.write_staged, staged=staged))

    def _section(self, layout: tuple) -> tuple[AdapterPlan, torch.Tensor, list[torch.Tensor]]:
        """(plan, data, views): the plan of this tensor layout and a data section on the
        pool's device with a typed view per tensor to copy the next version into."""
        entries, offset = [], 0
        for key, dtype, shape in layout:
            name = DTYPE_NAMES.get(dtype)
            if name is None:
                raise AdapterConfigError(f"tensor {key!r}: dtype {dtype} is not a float dtype")
            offset = -(-offset // dtype.itemsize) * dtype.itemsize  # a typed view needs alignment
            nbytes = math.prod(shape) * dtype.itemsize
            entries.append(TensorEntry(key, name, tuple(shape), offset, offset + nbytes))
            offset += nbytes
        plan = plan_from_tensors("published", self.config, "publisher", entries, offset,
                                 self.slots.model_config, self.slots.pool_config)
        data = torch.zeros(offset, dtype=torch.uint8, device=self.slots.pool.device)  # pads stay 0
        views = [data[e.begin:e.end].view(dtype).view(shape)
                 for e, (_, dtype, shape) in zip(entries, layout)]
        return plan, data, views

    def push(self, name: str, tensors: Mapping[str, torch.Tensor], *, server: str | None = None,
             llm=None, api_key: str | None = None, timeout_s: float = 30.0) -> str:
        """publish(), then register the result as the new version of `name` on a running
        server (its base URL; vLLM's /v1/load_lora_adapter with load_inplace) or an LLM
        in this process. Returns the version's source."""
        source = self.publish(tensors)
        start = time.perf_counter()
        if llm is not None:
            llm.register_adapter(name, source, reload=True)
        elif server is not None:
            body = json.dumps({"lora_name": name, "lora_path": source, "load_inplace": True})
            request = urllib.request.Request(f"{server.rstrip('/')}/v1/load_lora_adapter",
                                             body.encode(), {"Content-Type": "application/json"})
            if api_key is not None:
                request.add_header("Authorization", f"Bearer {api_key}")
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                reply.read()
        else:
            raise ValueError("push needs a server URL or an LLM")
        log.info("pushed %s as %r in %.2f ms", source, name, (time.perf_counter() - start) * 1e3)
        return source

    def close(self) -> None:
        self.server.close()
        self.exporter.close()
