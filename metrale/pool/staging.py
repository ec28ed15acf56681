"""Reusable staging memory for landings: pinned host bytes and a device buffer, grown to
the largest adapter seen, so a steady stream of promotions allocates nothing.

A disk read overlaps its stages: threads pread CHUNK-sized pieces into the pinned buffer
(page-cache copies of one thread top out far below PCIe) and each piece's H2D copy is
queued on a side stream as it arrives; the current stream waits on an event, no host sync.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from metrale.adapters.confined import open_fd
from metrale.errors import AdapterFileError

CHUNK = 4 << 20  # bytes per read and per H2D copy
# Page-cache copies ran at ~2 GB/s per thread on the H200 machine (run 1: 4 threads, 16 MB
# chunks read 84 MB in ~20 ms), so spread a landing over many threads.
READ_THREADS = min(16, os.cpu_count() or 4)


@functools.cache
def _readers() -> ThreadPoolExecutor:
    """One pool of reader threads per process, shared by every staging buffer."""
    return ThreadPoolExecutor(READ_THREADS, thread_name_prefix="metrale-read")


def _grow(n: int) -> int:
    return max(1 << 20, 1 << (n - 1).bit_length())


class ShortReadError(OSError):
    """The file ended before the bytes its header promised."""


def pread_into(fd: int, out: memoryview, offset: int) -> None:
    """Fill `out` from the file at `offset`, looping over short reads."""
    done = 0
    while done < len(out):
        got = os.preadv(fd, [out[done:]], offset + done)
        if got == 0:
            raise ShortReadError(f"file ended after {done} of {len(out)} bytes at {offset}")
        done += got


class StagingBuffers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Pinned host memory only helps (and only exists) with a CUDA device.
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.uint8)
        self._dev = torch.empty(0, dtype=torch.uint8, device=device)
        self._stream = torch.cuda.Stream(device) if self._pin else None
        self._copies_done: torch.cuda.Event | None = None  # last H2D reading the host buffer

    def host(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer of at least nbytes (pinned when a GPU is used)."""
        if self._copies_done is not None:
            self._copies_done.synchronize()  # earlier async copies may still read it
            self._copies_done = None
        if self._host.numel() < nbytes:
            self._host = torch.empty(_grow(nbytes), dtype=torch.uint8, pin_memory=self._pin)
        return self._host[:nbytes]

    def _device(self, nbytes: int) -> torch.Tensor:
        if self._dev.numel() < nbytes:
            self._dev = torch.empty(_grow(nbytes), dtype=torch.uint8, device=self.device)
        return self._dev[:nbytes]

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Move staged bytes to the device in one copy (the same tensor on a CPU engine)."""
        if self.device.type == "cpu":
            return host
        dev = self._device(host.numel())
        dev.copy_(host, non_blocking=self._pin)
        return dev

    def stream(self, nbytes: int,
               fill: Callable[[memoryview, Callable[[int, int], None] | None], None]) -> torch.Tensor:
        """nbytes from byte streams, on the device (the host buffer on a CPU engine).
        fill(out, on_range) fills `out` and calls on_range(a, b), from the calling thread,
        as each piece out[a:b] is in (in any order); each piece goes on to the device then."""
        return self._staged(nbytes, lambda host, upload: fill(memoryview(host.numpy()), upload))

    def read_file(self, path: str, offset: int, nbytes: int, root: Path | None = None) -> torch.Tensor:
        """nbytes of the file at offset, on the device (the host buffer on a CPU engine).
        Raises OSError (ShortReadError if the file is shorter than promised); root: as
        read_chunks'."""
        return self._staged(nbytes, lambda host, upload: read_chunks(path, offset, host, upload, root))

    def _staged(self, nbytes: int,
                fill: Callable[[torch.Tensor, Callable[[int, int], None] | None], None]) -> torch.Tensor:
        """fill(host, upload) fills a host buffer of nbytes and calls upload(a, b) as
        host[a:b] is complete (None on a CPU engine: the host buffer is the result)."""
        host = self.host(nbytes)
        if self._stream is None:
            fill(host, None)
            return host
        dev = self._device(nbytes)
        current = torch.cuda.current_stream(self.device)
        side = self._stream
        side.wait_stream(current)  # earlier landings may still read the device buffer

        def upload(a: int, b: int) -> None:
            with torch.cuda.stream(side):
                dev[a:b].copy_(host[a:b], non_blocking=True)

        try:
            fill(host, upload)
        finally:  # also after a failed read: the copies already queued still use `host`
            done = torch.cuda.Event()
            done.record(side)
            current.wait_event(done)
            self._copies_done = done
        return dev


def read_chunks(path: str, offset: int, host: torch.Tensor,
                on_chunk: Callable[[int, int], None] | None, root: Path | None = None) -> None:
    """host[:] = the file's bytes at offset, CHUNK-sized preads on the reader threads;
    on_chunk(a, b) runs on the calling thread as each piece (in file order) is in. root:
    the file is opened so that it cannot resolve outside it (AdapterFileError if it does,
    adapters.confined)."""
    n = host.numel()
    mv = memoryview(host.numpy()).cast("B")
    spans = [(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK)]
    fd = os.open(path, os.O_RDONLY) if root is None else open_fd(path, root, AdapterFileError)
    try:
        if len(spans) <= 1:
            for a, b in spans:
                pread_into(fd, mv[a:b], offset + a)
                if on_chunk:
                    on_chunk(a, b)
            return
        futures = [_readers().submit(pread_into, fd, mv[a:b], offset + a) for a, b in spans]
        try:
            for (a, b), fut in zip(spans, futures):  # in file order: reads finish ~in order
                fut.result()
                if on_chunk:
                    on_chunk(a, b)
        finally:
            for fut in futures:  # never close fd under a running read
                fut.cancel()
            for fut in futures:
                if not fut.cancelled():
                    fut.exception()
    finally:
        os.close(fd)
