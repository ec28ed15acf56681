"""MappedFiles bookkeeping on the CPU, with CUDA's registration calls faked: a file is
mapped at its second landing, entries are evicted least recently used for room, never
while borrowed, a rewritten file is not mapped under its old identity, and everything
is unregistered before it is unmapped. (Copies from real registrations: GPU tests in
test_host_tier.py.)"""

from __future__ import annotations

import os
import time

import pytest
import torch

from metrale.adapters.identity import adapter_identity
from metrale.pool import mapped_files
from metrale.pool.mapped_files import MappedFiles


class _FakeCudart:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        assert flags == mapped_files._READ_ONLY and ptr not in self.registered
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        del self.registered[ptr]
        return 0


class _FakeEvent:
    synchronized = 0

    def record(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        _FakeEvent.synchronized += 1


@pytest.fixture
def cudart(monkeypatch):
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return fake


def _adapter(root, name: str, size: int):
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    (d / "adapter_model.safetensors").write_bytes(
        (2).to_bytes(8, "little") + b"{}" + bytes(range(256)) * (size // 256))
    return d


def _land(files: MappedFiles, d) -> bytes | None:
    ident = adapter_identity(d)
    with files.borrow(ident, str(d / "adapter_model.safetensors")) as host:
        return None if host is None else bytes(host[10:20].tolist())


def test_second_landing_maps_and_lru_makes_room(tmp_path, cudart):
    a, b = _adapter(tmp_path, "a", 4096), _adapter(tmp_path, "b", 2048)
    size_a = (a / "adapter_model.safetensors").stat().st_size
    files = MappedFiles(size_a + 16, torch.device("cuda"))
    assert _land(files, a) is None and files.registrations == 0  # first landing: read
    assert _land(files, a) == bytes(range(10))[:10] and files.registrations == 1
    assert _land(files, a) is not None and files.hits == 1
    assert _land(files, b) is None  # b's first
    assert _land(files, b) is not None  # mapped; a evicted for room
    assert len(files) == 1 and files.registrations == 2 and len(cudart.registered) == 1
    files.close()
    assert not cudart.registered and len(files) == 0


def test_a_borrowed_entry_is_never_evicted(tmp_path, cudart):
    a, b = _adapter(tmp_path, "a", 4096), _adapter(tmp_path, "b", 4096)
    files = MappedFiles(5000, torch.device("cuda"))
    _land(files, a)
    ident_a = adapter_identity(a)
    with files.borrow(ident_a, str(a / "adapter_model.safetensors")) as host_a:
        assert host_a is not None
        _land(files, b)
        assert _land(files, b) is not None  # over capacity: a is borrowed, so both stay
        assert len(cudart.registered) == 2
        assert host_a[10] == 0  # still readable
    assert _land(files, a) is not None  # still mapped: a hit
    files.clear()
    assert not cudart.registered


def test_a_rewritten_file_is_not_mapped_under_its_old_identity(tmp_path, cudart):
    a = _adapter(tmp_path, "a", 4096)
    files = MappedFiles(1 << 20, torch.device("cuda"))
    old = adapter_identity(a)
    time.sleep(0.01)
    weights = a / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-256])  # in place: same inode, new size
    with files.borrow(old, str(weights)):  # first: read (nothing mapped)
        pass
    with files.borrow(old, str(weights)) as host:
        assert host is None  # the file no longer matches the identity: never mapped
    assert files.registrations == 0 and _land(files, a) is None  # its new identity: first


def test_collected_without_close_unregisters_first(tmp_path, cudart):
    a = _adapter(tmp_path, "a", 4096)
    files = MappedFiles(1 << 20, torch.device("cuda"))
    _land(files, a)
    _land(files, a)
    assert len(cudart.registered) == 1
    del files
    assert not cudart.registered


def test_cpu_devices_never_map(tmp_path):
    a = _adapter(tmp_path, "a", 4096)
    files = MappedFiles(1 << 20, torch.device("cpu"))
    assert _land(files, a) is None and _land(files, a) is None and files.capacity == 0
    assert os.path.exists(a)
