"""`metrale peer serve`: an adapter store that exports every PEFT adapter of a
directory to engines. Its memory is a LoraSlots with one slot per adapter, filled at
start-up through the same validating disk path as an engine's and never changed after;
leases work as for an engine exporting its own READY slots: one protocol for both.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from metrale.adapters.peft_config import PeftAdapterConfig
from metrale.adapters.plan import plan_adapter
from metrale.adapters.targets import ModuleTarget
from metrale.config import EXTRA_TARGETS, LINEAR_MODULES, POOL_MODULES, ModelConfig, PoolConfig
from metrale.errors import AdapterConfigError, AdapterError
from metrale.names import validate_adapter_name
from metrale.peer.errors import NixlUnavailableError
from metrale.peer.exporter import AdapterExporter
from metrale.peer.http_server import PeerHTTPServer
from metrale.peer.nixl_shim import load_nixl
from metrale.pool.swap import LoraSlots

log = logging.getLogger("metrale.peer")

_UNBOUNDED_RANK = 1 << 16  # only to discover ranks before the pool is sized


def discover_adapters(adapters_dir: str | Path) -> dict[str, Path]:
    """{adapter id (= directory name): path} of every subdir holding adapter_config.json."""
    root = Path(adapters_dir)
    if not root.is_dir():
        raise AdapterConfigError(f"{root} is not a directory of PEFT adapters")
    found = {p.name: p for p in sorted(root.iterdir())
             if p.is_dir() and (p / "adapter_config.json").is_file()}
    if not found:
        raise AdapterConfigError(f"{root} holds no adapter (no subdir with adapter_config.json)")
    for name in found:
        validate_adapter_name(name)
    return found


class StoreNames:
    """The names a store or publisher serves, one per slot: a name added for a slot
    replaces the slot's old one (a publisher's older version landed there)."""

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}

    def add(self, name: str, slot: int) -> None:
        self._slots = {n: s for n, s in self._slots.items() if s != slot} | {name: slot}

    def slot_of(self, name: str) -> int | None:
        return self._slots.get(name)

    def routes(self) -> dict[str, int]:
        return dict(self._slots)


class AdapterStore:
    def __init__(self, adapters_dir: str | Path, model: ModelConfig, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, max_lora_rank: int | None = None) -> None:
        self.paths = discover_adapters(adapters_dir)
        self.configs: dict[str, PeftAdapterConfig] = {}
        targets = []
        probe = probe_pool(max_lora_rank)
        for name, path in self.paths.items():
            with _naming(path):  # the file too: a per-expert layout shows in tensor names
                plan = plan_adapter(path, name, model, probe)
                self.configs[name] = plan.config
                targets += plan.targets
        self.slots = LoraSlots(model, fitted_pool(targets, len(self.paths), max_lora_rank), device, dtype)
        self.names = StoreNames()
        for slot, (name, path) in enumerate(self.paths.items()):
            with _naming(path):  # full validation
                self.slots.land(slot, slot, self.slots.prepare_disk(path, name))
            self.names.add(name, slot)
        self.pinned = _pin_host(self.slots.pool.buffer)
        log.info("peer store: %d adapters, %.1f MiB (%s, %s%s)", len(self.paths),
                 self.slots.pool.buffer.numel() * self.slots.pool.buffer.element_size() / 2**20,
                 device, dtype, ", pinned" if self.pinned else "")

    def exporter(self, transports: tuple[str, ...] = ("http",)) -> AdapterExporter:
        return AdapterExporter(self.slots, self.names, peft_for=self.configs.get,
                               transports=transports)


def probe_pool(max_rank: int | None = None) -> PoolConfig:
    """A pool config that serves every target, only to resolve configs before sizing."""
    return PoolConfig(1, max_rank or _UNBOUNDED_RANK, POOL_MODULES, extra_targets=EXTRA_TARGETS)


def fitted_pool(targets: list[ModuleTarget], slots: int, max_rank: int | None = None) -> PoolConfig:
    """The pool the targets need (the manifest lists tensors, so engines never depend on
    its max rank or module set): expert memory only for a store holding expert LoRA."""
    modules = {t.module for t in targets}
    return PoolConfig(slots, max_rank or max((t.rank for t in targets), default=1),
                      tuple(m for m in POOL_MODULES if m in modules) or LINEAR_MODULES[:1],
                      extra_targets=tuple(m for m in EXTRA_TARGETS if m in modules))


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Prefix an adapter refusal with the adapter's directory, keeping its class."""
    try:
        yield
    except AdapterError as e:
        if str(path) in str(e):
            raise
        raise type(e)(f"{path}: {e}") from e


def _pin_host(buffer: torch.Tensor) -> bool:
    """Page-lock a host store in place (addresses unchanged) when a GPU may read it."""
    if buffer.device.type != "cpu" or not torch.cuda.is_available():
        return False
    try:
        nbytes = buffer.numel() * buffer.element_size()
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        return int(getattr(err, "value", err)) == 0
    except Exception as e:  # pinning is an optimisation, never a reason to refuse to serve
        log.warning("peer store: could not pin host memory: %s", e)
        return False


def resolve_transports(choice: str) -> tuple[str, ...]:
    if choice == "http":
        return ("http",)
    if choice == "nixl":
        load_nixl()  # a clear error naming the pip command when missing
        return ("nixl",)
    if choice == "auto":
        try:
            load_nixl()
        except NixlUnavailableError as e:
            log.warning("peer store: NIXL unavailable (%s); serving HTTP only", e)
            return ("http",)
        return ("http", "nixl")
    raise AdapterConfigError(f"transport {choice!r}: choose nixl, http or auto")


def serve_store(adapters_dir: str | Path, model: ModelConfig, *, device: str = "cpu",
                dtype: torch.dtype = torch.float32, max_lora_rank: int | None = None,
                host: str = "127.0.0.1", port: int = 7460, transport: str = "auto",
                client_allow: Iterable[str] | None = None,
                announce: Callable[[str], object] = print) -> None:
    """Load, validate and serve until SIGINT/SIGTERM."""
    store = AdapterStore(adapters_dir, model, device=device, dtype=dtype, max_lora_rank=max_lora_rank)
    transports = resolve_transports(transport)
    exporter = store.exporter(transports).start()
    server = PeerHTTPServer(exporter, host, port, client_allow)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    announce(f"metrale peer: serving {len(store.paths)} adapter(s) on {server.url} "
             f"(transports: {', '.join(transports)}); ids:")
    # One line per id with the source that registers it: `metrale peer list` prints the same.
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    for adapter_id in store.paths:
        announce(f"  {adapter_id}\tpeer://{host}:{port}/{adapter_id}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        exporter.close()
        server.server_close()
