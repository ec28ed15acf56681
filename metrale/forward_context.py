"""The forward context: per-batch data the layers read without looking anything up.

The runner sets it around one forward pass; layers read token slot indices, the
pool views and attention metadata from here, never adapters by name.

It sits at the top of the package, importing nothing from metrale, because both
sides of it meet here: the engine writes it, the model and the ops read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """How the flat token batch maps onto sequences and KV blocks.

    Sequence i owns new tokens [cu_query[i], cu_query[i+1]) whose keys sit at
    positions context_lens[i] - num_new .. context_lens[i] - 1 of its sequence.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64: flat KV index (block * block_size + offset) per token
    context_lens: torch.Tensor  # [B] int32: tokens in KV after this step, per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    cu_query: torch.Tensor  # [B + 1] int32: query token offsets per sequence
    max_query_len: int
    max_context_len: int
    # varlen steps in a CUDA graph: [N, 2] (sequence, query tile) rows, -1 padded
    # (metrale.ops.attention_triton.prefill_tiles); None: built from cu_query. With
    # num_decodes, the tiles of the prompt chunks alone (sequences num_decodes.., their
    # tokens from cu_query[num_decodes] on, numbered from 0)
    prefill_tiles: torch.Tensor | None = None
    # a mixed step's first num_decodes sequences are decodes (one query each, tokens
    # 0..num_decodes-1): the decode kernel serves them, the varlen kernel the chunks
    num_decodes: int = 0
    # values the torch reference derives from the above once per step, not once per layer
    scratch: dict = field(default_factory=dict)


class LoraViews(Protocol):
    """What the LoRA ops read from the adapter pool (metrale.pool.pool.AdapterPool).

    A protocol rather than the pool's class: the pool lands adapters with the ops'
    kernels, so naming it here would make ops and pool import each other."""

    def fused_views(self, layer: int, modules: tuple[str, ...], out_slices: tuple[slice, ...]):
        """(As, Bts, out_slices, scales, ranks, doras, gains) of the served modules, or None."""
        ...

    def expert_views(self, layer: int, module: str):
        """A stacked expert module's metrale.ops.moe_triton.ExpertLora, or None if not served."""
        ...


@dataclass
class LoraBatch:
    """Which slot each token reads; absent when no token uses an adapter."""

    pool: LoraViews
    slot_ids: torch.Tensor  # [T] int64, -1 = base model only
    order: torch.Tensor | None = None  # [T] tokens sorted by slot, for CUDA prefill kernels
    # (slot, token slice or index tensor) per slot used, grouped once per batch for the
    # CPU reference path (metrale.ops.lora_ref.token_groups); None: grouped per call
    groups: list[tuple[int, torch.Tensor | slice]] | None = None


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    lora: LoraBatch | None = None


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


def get_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("model forward called outside forward_context(...)")
    return _current
