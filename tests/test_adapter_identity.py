"""adapter_identity: the cache key of plans, host-tier images and file mappings. Files
whose stats are unchanged reuse a remembered digest, except files changed too recently
for their stats to tell a rewrite apart (Linux stamps files at a coarse tick)."""

from __future__ import annotations

import json
import os
import time

import pytest

from metrale.adapters import identity as ident
from metrale.adapters.identity import adapter_identity


@pytest.fixture
def adapter(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (d / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return d


def _frozen_stats(monkeypatch, changed_ns: int) -> None:
    """Every file reports the same stat, as two versions written in one tick would."""
    monkeypatch.setattr(ident, "file_stat", lambda st: (1, 2, 3, changed_ns, changed_ns))


def test_a_rewrite_that_keeps_every_stat_field_is_seen_while_the_files_are_fresh(
        adapter, monkeypatch):
    _frozen_stats(monkeypatch, time.time_ns())  # changed just now
    first = adapter_identity(adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 32}))
    second = adapter_identity(adapter)
    assert first is not None and second is not None
    assert first.plan_digest != second.plan_digest


def test_settled_files_reuse_the_digest_without_reading(adapter, monkeypatch):
    _frozen_stats(monkeypatch, time.time_ns() - 10 * ident._SETTLED_NS)
    first = adapter_identity(adapter)

    def no_reads(*args, **kwargs):
        raise AssertionError("the files were read again")

    monkeypatch.setattr(ident, "open_regular", no_reads)
    assert adapter_identity(adapter) == first


def test_any_real_rewrite_changes_the_identity(adapter):
    old = time.time_ns() - 10 * ident._SETTLED_NS
    for f in adapter.iterdir():
        os.utime(f, ns=(old, old))
    first = adapter_identity(adapter)
    assert adapter_identity(adapter) == first  # remembered (ctime is still recent: re-read)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 64}))
    assert adapter_identity(adapter).plan_digest != first.plan_digest
