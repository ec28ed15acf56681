"""Paged attention: write new K/V into the block cache, then attend each
sequence's queries over its cached context.

`paged_attention` dispatches by device: the Triton kernels of
metrale.ops.attention_triton on CUDA (decode: CUDA-graph capturable), and the plain
torch reference below elsewhere (CPU, and the ground truth for the kernels' tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.forward_context import AttentionMetadata
from metrale.ops.attention_triton import paged_decode, paged_prefill


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # k, v: [T, KV, D]; caches: [num_blocks, block_size, KV, D]; slot_mapping: [T]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D] -> out: [T, H, D]; causal within each sequence. positions: [T], each
    query's position (the varlen kernel's split merge reads it)."""
    if not q.is_cuda:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
    if meta.is_prefill:
        return paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                             meta.cu_query, meta.max_query_len, scale, meta.prefill_tiles,
                             positions)
    # a decode step has one query per sequence (cu_query is 0..B)
    return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """q: [T, H, D] -> out: [T, H, D]; causal within each sequence.

    A decode step (one query per sequence) runs as one batched SDPA over the sequences'
    gathered, padded K/V; anything else attends sequence by sequence."""
    if not meta.is_prefill and q.shape[0] == meta.context_lens.shape[0]:
        return paged_decode_ref(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    return paged_attention_per_sequence(q, k_cache, v_cache, meta, scale)


def paged_decode_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query per sequence, q: [B, H, D] -> [B, H, D], the query being its sequence's
    last position (it sees every cached key). One gather of all sequences' blocks into a
    [B, L, KV, D] tensor padded to the longest context, one SDPA with a padding mask:
    masked keys weigh exactly 0, so each row equals attending its own context alone."""
    B, H, D = q.shape
    block_size, KV = k_cache.shape[1], k_cache.shape[2]
    max_ctx = int(context_lens.max())
    n_blocks = -(-max_ctx // block_size)
    # -1 padding of shorter tables -> block 0: read, then masked away
    blocks = block_tables[:, :n_blocks].long().clamp_min(0)  # [B, nb]
    k = k_cache[blocks].flatten(1, 2)[:, :max_ctx]  # [B, L, KV, D]
    v = v_cache[blocks].flatten(1, 2)[:, :max_ctx]
    valid = torch.arange(max_ctx, device=q.device) < context_lens.unsqueeze(1)  # [B, L]
    # GQA without repeating K/V: head h reads kv head h // G, so the G query heads of a
    # kv head ride as G query rows of that head: q [B, KV, G, D] against k [B, KV, L, D]
    o = F.scaled_dot_product_attention(
        q.reshape(B, KV, H // KV, D), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale,
    )  # [B, KV, G, D]
    return o.reshape(B, H, D)


def paged_attention_per_sequence(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """q: [T, H, D] -> out: [T, H, D]; causal within each sequence, one SDPA per sequence."""
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    cu = meta.cu_query.tolist()
    ctx_lens = meta.context_lens.tolist()
    for i, ctx_len in enumerate(ctx_lens):
        start, end = cu[i], cu[i + 1]
        n_blocks = -(-ctx_len // block_size)
        blocks = meta.block_tables[i, :n_blocks].long()  # [nb]
        k = k_cache[blocks].flatten(0, 1)[:ctx_len]  # [ctx, KV, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx_len]
        qi = q[start:end]  # [n, H, D]
        n = end - start
        # query j sits at position ctx_len - n + j and sees keys 0..that position
        q_pos = torch.arange(ctx_len - n, ctx_len, device=q.device).unsqueeze(1)  # [n, 1]
        mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= q_pos  # [n, ctx]
        o = F.scaled_dot_product_attention(
            qi.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # [H|KV, n|ctx, D]
            attn_mask=mask, scale=scale, enable_gqa=True,
        )  # [H, n, D]
        out[start:end] = o.transpose(0, 1)
    return out
