"""An adapter pool's state, to prove an operation touched nothing; tiny pools to try it on."""

from __future__ import annotations

import hashlib

import torch

from metrale.config import ModelConfig, PoolConfig
from metrale.pool.swap import LoraSlots
from tests.helpers.tiny_models import hf_config


def snapshot(slots: LoraSlots) -> tuple:
    """Pool bytes, rank/scale tables and every slot's identity."""
    pool = slots.pool
    digest = hashlib.sha256()
    for t in (pool.buffer, pool.ranks, pool.scales):
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest(), slots.table.infos(), dict(slots.table._by_name)


def tiny_llama_slots(**pool_kw) -> LoraSlots:
    """CPU float32 slots for tiny_models' llama: 3 slots of rank 8 unless pool_kw says."""
    cfg = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    return LoraSlots(cfg, PoolConfig(**{"max_loras": 3, "max_lora_rank": 8, **pool_kw}),
                     "cpu", torch.float32)
