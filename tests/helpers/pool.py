"""An adapter pool's state, to prove an operation touched nothing; tiny pools to try it on."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import torch

from metrale.config import ModelConfig, PoolConfig
from metrale.peer.landing import prepare_from_peer
from metrale.pool.landing import slot_norms
from metrale.pool.swap import LoraSlots
from tests.helpers.tiny_models import hf_config


def snapshot(slots: LoraSlots) -> tuple:
    """Pool bytes, rank/scale tables and every slot's identity (version, uid, state...)."""
    pool = slots.pool
    digest = hashlib.sha256()
    for t in (pool.buffer, pool.ranks, pool.scales):
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest(), slots.table.infos()


def assert_refused_untouched(llm, adapter_dir, error: type[Exception], message: str) -> None:
    """Registering adapter_dir and swapping it into slot 0 each raise `error` matching
    `message`, and llm's pool bytes, tables and slot identities stay as they were."""
    import pytest

    before = snapshot(llm.engine.lora)
    with pytest.raises(error, match=message):
        llm.register_adapter("bad", adapter_dir)
    with pytest.raises(error, match=message):
        llm.engine.swap_lora_slot_from_disk(adapter_dir, "bad", 0)
    assert snapshot(llm.engine.lora) == before


_versions = itertools.count(10_000)  # bare pools in tests number their own versions


def land_disk(slots: LoraSlots, adapter_dir, slot: int, version: int | None = None) -> int:
    """A PEFT directory into `slot` of a bare pool (no registry): the pool-level landing the
    engine's promotions use. Returns the version number the slot now holds."""
    version = next(_versions) if version is None else version
    slots.land(slot, version, slots.prepare_disk(adapter_dir, Path(adapter_dir).name))
    return version


def land_peer(slots: LoraSlots, addr: str, adapter_id: str, slot: int | None = None,
              version: int | None = None, **kw) -> tuple[int, int]:
    """A peer's adapter into `slot` (None: the table's victim) of a bare pool; kw go to
    prepare_from_peer (peft, transport, timeout_s, peer_allow, stats, staging). Everything
    that may refuse runs before the slot is touched. Returns (slot, version)."""
    version = next(_versions) if version is None else version
    if slot is None:
        slot = slots.table.select_victim()  # POOL_FULL before contacting the peer
    else:
        slots.table.require_idle(slot)
    prepared = prepare_from_peer(slots, addr, adapter_id, kw.pop("name", adapter_id), **kw)
    try:
        slots.land(slot, version, prepared)
    finally:
        prepared.close()
    return slot, version


def norms_by_key(pool, slot: int) -> dict[tuple[int, str, str], float]:
    """The landing check's norm of every region of `slot`, by (layer, module, kind)."""
    values, _ = slot_norms(pool.slot_tensors[slot])
    return dict(zip(pool.norm_keys, values.tolist()))


def tiny_llama_slots(**pool_kw) -> LoraSlots:
    """CPU float32 slots for tiny_models' llama: 3 slots of rank 8 unless pool_kw says."""
    cfg = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    return LoraSlots(cfg, PoolConfig(**{"max_loras": 3, "max_lora_rank": 8, **pool_kw}),
                     "cpu", torch.float32)
