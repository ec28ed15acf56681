"""Adapter files mapped read-only and registered with CUDA: a re-landing of an unchanged
file is one DMA from the page cache. On the H200 host 16 threads of preads move an 84 MB
adapter into pinned staging in ~3.5 ms, against a 1.56 ms H2D floor that a registered
mapping reaches. Registering costs more than one read (~6 ms for 84 MB), so a file is
mapped at its second landing.

Keys are AdapterIdentity, and the opened file's stat must match the key's. Registered
pages cannot be reclaimed by the OS: at most `capacity_bytes`, LRU; an entry is
unregistered only when no landing borrows it and its last copy finished.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.adapters.confined import open_fd
from metrale.adapters.identity import AdapterIdentity, file_stat
from metrale.errors import AdapterFileError

log = logging.getLogger("metrale.pool")
_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the mapping is PROT_READ
_SEEN_MAX = 4096


@dataclass
class _Entry:
    mapping: mmap.mmap
    host: torch.Tensor  # [file bytes] uint8 over the mapping, registered
    copied: torch.cuda.Event | None = None  # the last copy reading it
    borrowers: int = 0


class MappedFiles:
    def __init__(self, capacity_bytes: int, device: torch.device) -> None:
        self.capacity = capacity_bytes if device.type == "cuda" else 0
        self.device = device
        self._entries: OrderedDict[AdapterIdentity, _Entry] = OrderedDict()  # oldest first
        self._seen: OrderedDict[AdapterIdentity, None] = OrderedDict()  # landed once, unmapped
        self._bytes = 0
        self._lock = threading.Lock()  # promotion workers land too
        self.registrations = self.hits = 0
        # unmapping a still-registered range breaks later CUDA calls: unregister first,
        # also when the owner is dropped without close()
        self._finalizer = weakref.finalize(self, _release_all, self._entries)

    @contextlib.contextmanager
    def borrow(self, identity: AdapterIdentity | None, path: str,
               root: Path | None = None) -> Iterator[torch.Tensor | None]:
        """The whole file as a registered host tensor ([size] uint8), or None: read it
        another way. Copies from it must be queued on the current stream inside the block.
        root: the file is mapped only if it resolves inside it (adapters.confined)."""
        entry = self._acquire(identity, path, root) if identity is not None and self.capacity else None
        try:
            yield entry.host if entry is not None else None
        finally:
            if entry is not None:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
                with self._lock:
                    entry.copied, entry.borrowers = event, entry.borrowers - 1

    def clear(self) -> None:
        """Forget every idle entry and which files landed once (for benchmarks)."""
        with self._lock:
            self._seen.clear()
            for key in [k for k, e in self._entries.items() if not e.borrowers]:
                self._drop(key)

    def close(self) -> None:
        """Unregister and unmap everything (no landing may be borrowing)."""
        self.capacity = 0
        self._finalizer()

    def __len__(self) -> int:
        return len(self._entries)

    def _acquire(self, identity: AdapterIdentity, path: str, root: Path | None) -> _Entry | None:
        size = identity.data_stat[2]
        if size > self.capacity or size == 0:
            return None
        with self._lock:
            entry = self._entries.get(identity)
            if entry is not None:
                self._entries.move_to_end(identity)
                entry.borrowers += 1
                self.hits += 1
                return entry
            if self._seen.pop(identity, False) is False:  # a first landing: read it instead
                self._seen[identity] = None
                while len(self._seen) > _SEEN_MAX:
                    self._seen.popitem(last=False)
                return None
        entry = self._map(identity, path, root)
        if entry is None:
            return None
        with self._lock:
            if identity in self._entries:  # another worker mapped it meanwhile: use theirs
                _unmap(entry)
                entry = self._entries[identity]
            else:
                self._make_room(size)
                self._entries[identity] = entry
                self._bytes += size
                self.registrations += 1
            entry.borrowers += 1
            return entry

    def _map(self, identity: AdapterIdentity, path: str, root: Path | None) -> _Entry | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if root is None \
                else open_fd(path, root, AdapterFileError)  # never blocks on a FIFO
            try:
                if file_stat(os.fstat(fd)) != identity.data_stat:
                    return None  # rewritten (or replaced) since its identity was read
                mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
        except (OSError, ValueError, AdapterFileError):  # the reader that follows says why
            return None
        with warnings.catch_warnings():  # a read-only buffer: torch warns it is not writable
            warnings.simplefilter("ignore", UserWarning)
            host = torch.frombuffer(mapping, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), _READ_ONLY)
        if int(err) != 0:  # e.g. a platform without read-only registration: stop trying
            log.warning("cannot register %s for direct copies (cuda error %s); adapter files "
                        "will be read instead", path, int(err))
            self.capacity = 0
            del host
            mapping.close()
            return None
        return _Entry(mapping, host)

    def _make_room(self, size: int) -> None:
        for key in [k for k, e in self._entries.items() if not e.borrowers]:
            if self._bytes + size <= self.capacity:
                return
            self._drop(key)

    def _drop(self, key: AdapterIdentity) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.host.numel()
        _unmap(entry)


def _unmap(entry: _Entry) -> None:
    if entry.copied is not None:
        entry.copied.synchronize()  # a DMA may still read the pages
    torch.cuda.cudart().cudaHostUnregister(entry.host.data_ptr())
    entry.host = None  # the mapping cannot close while a tensor exports its buffer
    entry.mapping.close()


def _release_all(entries: OrderedDict[AdapterIdentity, _Entry]) -> None:
    while entries:
        _unmap(entries.popitem()[1])
