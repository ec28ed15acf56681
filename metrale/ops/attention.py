"""Paged attention over the block KV cache: metrale.ops.attention_triton's kernels on CUDA,
the torch reference below elsewhere (CPU, and the kernels' tests' ground truth)."""

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
    softcap: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D], causal within each sequence; positions: [T] (the varlen
    split merge reads them). softcap and window (Gemma 2 / 3, a windowed Phi-3): scores
    capped, keys before the window hidden."""
    if not q.is_cuda:
        if softcap is not None or window is not None:
            return paged_attention_per_sequence(q, k_cache, v_cache, meta, scale, softcap,
                                                window)
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
    if meta.is_prefill and meta.num_decodes:
        return mixed_attention(q, k_cache, v_cache, meta, scale, positions, softcap, window)
    if meta.is_prefill:
        return paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                             meta.cu_query, meta.max_query_len, scale, meta.prefill_tiles,
                             positions, softcap=softcap, window=window)
    # a decode step has one query per sequence (cu_query is 0..B)
    return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                        softcap=softcap, window=window)


def mixed_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, positions: torch.Tensor | None = None,
    softcap: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """A mixed step whose first meta.num_decodes sequences decode: those through the decode
    kernel (split-K over each context), the prompt chunks through the varlen kernel. One
    varlen launch for both wasted a whole query tile on each decode row: on an H100 (8B,
    256 decodes beside ~500 prompt tokens) it took 2.6x the decode kernel's time."""
    d = meta.num_decodes
    chunk_cu = meta.scratch.get("chunk_cu")
    if chunk_cu is None:  # the same for every layer of the step
        chunk_cu = meta.scratch["chunk_cu"] = meta.cu_query[d:] - d
    out = torch.empty_like(q)  # [T, H, D]
    out[:d] = paged_decode(q[:d], k_cache, v_cache, meta.block_tables[:d], meta.context_lens[:d],
                           scale, softcap=softcap, window=window)
    out[d:] = paged_prefill(q[d:], k_cache, v_cache, meta.block_tables[d:], meta.context_lens[d:],
                            chunk_cu, meta.max_query_len, scale, meta.prefill_tiles,
                            None if positions is None else positions[d:], softcap=softcap,
                            window=window)
    return out


def paged_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """A decode step (one query per sequence) as one batched SDPA over gathered, padded K/V;
    anything else sequence by sequence."""
    if not meta.is_prefill and q.shape[0] == meta.context_lens.shape[0]:
        index = meta.scratch.get("decode_ref")
        if index is None:  # the same for every layer of the step
            index = meta.scratch["decode_ref"] = decode_ref_index(
                meta.block_tables, meta.context_lens, k_cache.shape[1])
        buffers = None
        if not isinstance(index[0], slice):  # gathered K/V: one pair of buffers per step
            shape = (index[0].numel(), *k_cache.shape[1:])
            buffers = meta.scratch.get("decode_ref_kv")
            if buffers is None or buffers[0].shape != shape or buffers[0].dtype != k_cache.dtype:
                buffers = meta.scratch["decode_ref_kv"] = (
                    k_cache.new_empty(shape), v_cache.new_empty(shape))
        return paged_decode_ref(q, k_cache, v_cache, scale, index, buffers)
    return paged_attention_per_sequence(q, k_cache, v_cache, meta, scale)


def decode_ref_index(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
) -> tuple[torch.Tensor | slice, int, torch.Tensor]:
    """(blocks [B, nb], longest context, key mask [B, 1, 1, L]) for paged_decode_ref; for one
    sequence of consecutive blocks (a lone request) a slice: its K/V a view, not a gather."""
    max_ctx = int(context_lens.max())
    n_blocks = -(-max_ctx // block_size)
    # -1 padding of shorter tables -> block 0: read, then masked away
    blocks = block_tables[:, :n_blocks].long().clamp_min(0)  # [B, nb]
    valid = torch.arange(max_ctx, device=block_tables.device) < context_lens.unsqueeze(1)  # [B, L]
    if blocks.shape[0] == 1:
        row = blocks[0].tolist()
        if row == list(range(row[0], row[0] + len(row))):
            blocks = slice(row[0], row[0] + len(row))
    return blocks, max_ctx, valid[:, None, None, :]


def paged_decode_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
    index: tuple[torch.Tensor | slice, int, torch.Tensor],
    buffers: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """q: [B, H, D] at each sequence's last position -> [B, H, D]: one gather of the blocks
    into [B, L, KV, D], one masked SDPA. index: the step's decode_ref_index; buffers: the
    step's gathered K and V (an allocation per layer cost more than the gather)."""
    B, H, D = q.shape
    KV = k_cache.shape[2]
    blocks, max_ctx, valid = index
    if isinstance(blocks, slice):  # one sequence, consecutive blocks: a view
        k = k_cache[blocks].flatten(0, 1)[None, :max_ctx]  # [1, L, KV, D]
        v = v_cache[blocks].flatten(0, 1)[None, :max_ctx]
    else:
        flat = blocks.flatten()  # [B * nb]
        k = torch.index_select(k_cache, 0, flat, out=buffers[0])  # [B * nb, bs, KV, D]
        v = torch.index_select(v_cache, 0, flat, out=buffers[1])
        k = k.view(B, -1, KV, D)[:, :max_ctx]  # [B, L, KV, D]
        v = v.view(B, -1, KV, D)[:, :max_ctx]
        # Keys past a shorter sequence's context are stale cache memory, perhaps NaN (a
        # freed block of a poisoned request): a masked score still adds -inf to it and a
        # zero weight still multiplies it, so zero them, or NaN reaches this request.
        pad = ~valid.view(B, max_ctx)[:, :, None, None]  # [B, L, 1, 1]
        k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
    # GQA without repeating K/V: head h reads kv head h // G, so the G query heads of a
    # kv head ride as G query rows of that head: q [B, KV, G, D] against k [B, KV, L, D]
    o = F.scaled_dot_product_attention(
        q.reshape(B, KV, H // KV, D), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=valid, scale=scale,
    )  # [B, KV, G, D]
    return o.reshape(B, H, D)


def paged_attention_per_sequence(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One SDPA per sequence (with softcap an explicit softmax: SDPA has no cap)."""
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
        k_pos = torch.arange(ctx_len, device=q.device).unsqueeze(0)  # [1, ctx]
        mask = k_pos <= q_pos  # [n, ctx]
        if window is not None:
            mask &= k_pos > q_pos - window
        if softcap is None:
            o = F.scaled_dot_product_attention(
                qi.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # [H|KV, n|ctx, D]
                attn_mask=mask, scale=scale, enable_gqa=True,
            )  # [H, n, D]
        else:
            group = q.shape[1] // k.shape[1]
            kh = k.transpose(0, 1).repeat_interleave(group, 0).float()  # [H, ctx, D]
            vh = v.transpose(0, 1).repeat_interleave(group, 0).float()
            scores = qi.transpose(0, 1).float() @ kh.transpose(1, 2) * scale  # [H, n, ctx]
            scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            o = (scores.softmax(-1) @ vh).to(q.dtype)  # [H, n, D]
        out[start:end] = o.transpose(0, 1)
    return out
