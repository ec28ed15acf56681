"""Paged attention: the Triton decode (split-K, GQA) and varlen prefill kernels against
the torch reference, which itself is checked against a float64 dense oracle.

On CPU the kernels run in Triton's interpreter at tiny sizes (tests/conftest.py turns it
on); on a GPU the `gpu` tests add realistic sizes in bf16.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from metrale.forward_context import AttentionMetadata
from metrale.ops import attention_triton as at
from metrale.ops.attention import paged_attention_ref
from tests.helpers.kernels import KERNELS

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not KERNELS, reason="needs triton on CUDA or its interpreter")


def make_case(ctx_lens, new_lens, H, KV, D, bs, dtype, device=DEV, seed=0, spare_blocks=3):
    """Random caches with each sequence's blocks scattered (shuffled) over the cache;
    block tables padded with -1 to a fixed width. Returns q [T, H, D] and metadata."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-c // bs) for c in ctx_lens]
    width = max(need) + 1  # a fixed, wider table: entries past the context are never read
    num_blocks = sum(need) + spare_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables, at_ = [], 0
    for n in need:
        tables.append(ids[at_:at_ + n] + [-1] * (width - n))
        at_ += n
    k = torch.randn(num_blocks, bs, KV, D, generator=g).to(dtype).to(device)
    v = torch.randn(num_blocks, bs, KV, D, generator=g).to(dtype).to(device)
    T = sum(new_lens)
    q = torch.randn(T, H, D, generator=g).to(dtype).to(device)
    cu = [0]
    for n in new_lens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        is_prefill=any(n != 1 for n in new_lens),
        slot_mapping=torch.zeros(T, dtype=torch.int64, device=device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        cu_query=torch.tensor(cu, dtype=torch.int32, device=device),
        max_query_len=max(new_lens), max_context_len=max(ctx_lens),
    )
    return q, k, v, meta


def dense_oracle(q, k, v, meta, scale, softcap=None, window=None):
    """float64, one query row at a time, straight from the definitions (Gemma's: scores
    capped at softcap * tanh(s / softcap); a query at p sees keys p - window < t <= p)."""
    bs = k.shape[1]
    G = q.shape[1] // k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    cu, ctxs = meta.cu_query.tolist(), meta.context_lens.tolist()
    for i, ctx in enumerate(ctxs):
        blocks = meta.block_tables[i, :-(-ctx // bs)].long().cpu()
        ki = k.cpu()[blocks].flatten(0, 1)[:ctx].double()  # [ctx, KV, D]
        vi = v.cpu()[blocks].flatten(0, 1)[:ctx].double()
        n = cu[i + 1] - cu[i]
        for j in range(n):
            pos = ctx - n + j
            qj = q[cu[i] + j].cpu().double()  # [H, D]
            lo = 0 if window is None else max(0, pos - window + 1)
            kk = ki[lo:pos + 1].repeat_interleave(G, dim=1)  # [keys, H, D]
            vv = vi[lo:pos + 1].repeat_interleave(G, dim=1)
            scores = torch.einsum("hd,thd->ht", qj, kk) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            w = torch.softmax(scores, dim=-1)
            out[cu[i] + j] = torch.einsum("ht,thd->hd", w, vv)
    return out


def rel_err(got, want):
    want = want.double().cpu()
    return ((got.double().cpu() - want).norm() / want.norm()).item()


def test_reference_matches_oracle():
    q, k, v, meta = make_case([7, 1, 13], [3, 1, 5], H=4, KV=2, D=8, bs=4,
                              dtype=torch.float32, device="cpu")
    ref = paged_attention_ref(q, k, v, meta, 0.3)
    assert rel_err(ref, dense_oracle(q, k, v, meta, 0.3)) < 1e-6


DECODE_CASES = {  # (context lengths, H, KV, D, block size, forced splits)
    "gqa-split": ([1, 5, 16, 37, 70], 8, 2, 16, 4, 3),
    "mha-nosplit": ([1, 9, 33], 2, 2, 32, 8, 1),
    "odd-group-pad-d": ([3, 65, 130], 6, 2, 24, 16, 4),  # G=3 and D=24 are padded in-kernel
    "auto-splits": ([2, 300], 4, 1, 16, 16, None),
}


@needs_kernels
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_matches_reference(case, dtype):
    ctx, H, KV, D, bs, splits = DECODE_CASES[case]
    q, k, v, meta = make_case(ctx, [1] * len(ctx), H, KV, D, bs, dtype, seed=len(case))
    want = dense_oracle(q, k, v, meta, D ** -0.5)
    got = at.paged_decode(q, k, v, meta.block_tables, meta.context_lens, D ** -0.5,
                          num_splits=splits)
    assert got.dtype == dtype and not got.isnan().any()
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), meta, D ** -0.5)
    assert rel_err(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_kernels
def test_decode_more_splits_than_tiles_and_int64_tables():
    """Splits that get no keys merge in with zero weight; int64 metadata (the CUDA-graph
    runner's static buffers) reads the same as int32."""
    q, k, v, meta = make_case([1, 3, 70], [1, 1, 1], 4, 2, 16, 4, torch.float32, seed=9)
    want = dense_oracle(q, k, v, meta, 0.25)
    got = at.paged_decode(q, k, v, meta.block_tables.long(), meta.context_lens.long(), 0.25,
                          num_splits=8)
    assert rel_err(got, want) < 1e-5


PREFILL_CASES = {  # (context lengths, new tokens per sequence, H, KV, D, block size)
    "fresh": ([5, 1, 70], [5, 1, 70], 4, 2, 16, 4),
    "prefix-hit": ([20, 67, 9], [3, 60, 9], 4, 1, 16, 8),  # cached context before the queries
    "mha-pad-d": ([130, 17], [130, 2], 2, 2, 24, 16),
    "odd-group": ([9, 40], [9, 13], 6, 2, 16, 4),  # G=3: query heads padded to 4 per group
}


@needs_kernels
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_reference(case, dtype):
    ctx, new, H, KV, D, bs = PREFILL_CASES[case]
    q, k, v, meta = make_case(ctx, new, H, KV, D, bs, dtype, seed=3)
    want = dense_oracle(q, k, v, meta, D ** -0.5)
    got = at.paged_prefill(q, k, v, meta.block_tables, meta.context_lens, meta.cu_query,
                           meta.max_query_len, D ** -0.5)
    assert got.dtype == dtype and not got.isnan().any()
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_kernels
@pytest.mark.parametrize("split_keys,block_m", [(None, 64), (64, 16), (128, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_chunks_decodes_and_empty_rows(dtype, split_keys, block_m):
    """One varlen launch as a mixed step makes it: prompt chunks that attend to earlier
    chunks and cached blocks, decode rows (one query each), and sequences with no query
    (a padded CUDA-graph row), over a fixed-length tile list padded with -1 rows, with
    the keys split (split-K) into slices some rows see nothing of."""
    ctx, new = [40, 1, 23, 9, 200, 1], [7, 1, 1, 0, 70, 0]
    q, k, v, meta = make_case(ctx, new, 4, 2, 16, 4, dtype, seed=13)
    want = dense_oracle(q, k, v, meta, 0.25)
    tiles = at.prefill_tiles(meta.cu_query.tolist(),
                             at.max_prefill_tiles(sum(new) + 30, len(ctx), block_m), block_m)
    assert tiles[-1] == (-1, 0)
    got = at.paged_prefill(q, k, v, meta.block_tables, meta.context_lens, meta.cu_query, 0,
                           0.25, torch.tensor(tiles, dtype=torch.int64, device=q.device),
                           split_keys=split_keys, block_m=block_m)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), meta, 0.25)
    assert rel_err(ref, want) < 1e-5


@needs_kernels
@pytest.mark.parametrize("softcap, window", [(None, None), (2.0, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_sends_its_decodes_to_the_decode_kernel(dtype, softcap, window):
    """mixed_attention: the step's first num_decodes sequences (one query each) through
    paged_decode, the prompt chunks after them through paged_prefill with their own tile
    list, into one output that equals the dense oracle row for row."""
    from metrale.ops.attention import mixed_attention

    ctx, new = [70, 5, 33, 1, 40, 200], [1, 1, 1, 1, 7, 70]
    q, k, v, meta = make_case(ctx, new, 4, 2, 16, 4, dtype, seed=31)
    want = dense_oracle(q, k, v, meta, 0.25, softcap, window)
    d = 4
    chunk_cu = [c - d for c in meta.cu_query.tolist()[d:]]
    tiles = at.prefill_tiles(chunk_cu, block_m=at.prefill_block_m(meta.max_query_len, 2))
    meta = dataclasses.replace(meta, num_decodes=d, prefill_tiles=torch.tensor(
        tiles, dtype=torch.int32, device=q.device), scratch={})
    got = mixed_attention(q, k, v, meta, 0.25, softcap=softcap, window=window)
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(got[:d], want[:d]) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_kernels
@pytest.mark.parametrize("softcap, window", [(2.0, None), (None, 5), (1.5, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_and_window_match_the_oracle(softcap, window, dtype):
    """Gemma's attention in the kernels: decode (forced splits, some before the window) and
    a mixed varlen step (split keys, prefix hits), against the oracle; the torch
    per-sequence reference too."""
    from metrale.ops.attention import paged_attention_per_sequence

    q, k, v, meta = make_case([1, 5, 37, 70], [1] * 4, 4, 2, 16, 4, dtype, seed=21)
    want = dense_oracle(q, k, v, meta, 0.5, softcap, window)
    for splits in (1, 4):
        got = at.paged_decode(q, k, v, meta.block_tables, meta.context_lens, 0.5,
                              num_splits=splits, softcap=softcap, window=window)
        assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2), splits
    ctx, new = [40, 1, 23, 200], [7, 1, 23, 70]
    q, k, v, meta = make_case(ctx, new, 4, 2, 16, 4, dtype, seed=22)
    want = dense_oracle(q, k, v, meta, 0.5, softcap, window)
    for split_keys, block_m in ((None, 64), (64, 16)):
        got = at.paged_prefill(q, k, v, meta.block_tables, meta.context_lens, meta.cu_query,
                               meta.max_query_len, 0.5, split_keys=split_keys, block_m=block_m,
                               softcap=softcap, window=window)
        assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2), split_keys
    ref = paged_attention_per_sequence(q.float(), k.float(), v.float(), meta, 0.5, softcap,
                                       window)
    assert rel_err(ref, want) < 1e-5


@needs_kernels
def test_outputs_fully_written():
    """Every output element is written: poison the allocator's memory, then compare."""
    q, k, v, meta = make_case([4, 33], [1, 1], 4, 2, 16, 4, torch.float32, seed=5)
    torch.empty(4096, device=DEV).fill_(float("nan"))  # poisoned memory for empty_like to reuse
    got = at.paged_decode(q, k, v, meta.block_tables, meta.context_lens, 0.25, num_splits=2)
    assert not got.isnan().any()




# --- realistic sizes, compiled, bf16 (Llama-3-8B: 32 heads, 8 KV heads, D 128) ------------

@pytest.mark.gpu
@pytest.mark.parametrize("batch,max_ctx", [(1, 4000), (32, 1500), (64, 300)])
def test_gpu_decode_bf16(batch, max_ctx):
    rng = random.Random(batch)
    ctx = [1, 16, 17] + [rng.randrange(1, max_ctx) for _ in range(batch - 3)] if batch > 3 \
        else [max_ctx]
    q, k, v, meta = make_case(ctx, [1] * batch, 32, 8, 128, 16, torch.bfloat16, seed=batch)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), meta, 128 ** -0.5)
    got = at.paged_decode(q, k, v, meta.block_tables, meta.context_lens, 128 ** -0.5)
    assert rel_err(got, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_prefill_bf16():
    ctx, new = [1, 300, 1000, 77], [1, 300, 200, 77]
    q, k, v, meta = make_case(ctx, new, 32, 8, 128, 16, torch.bfloat16, seed=11)
    ref = paged_attention_ref(q.float(), k.float(), v.float(), meta, 128 ** -0.5)
    got = at.paged_prefill(q, k, v, meta.block_tables, meta.context_lens, meta.cu_query,
                           meta.max_query_len, 128 ** -0.5)
    assert rel_err(got, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_graph_capturable():
    """Captured once, replayed with new context lengths and block tables copied into the
    same buffers: results follow the new contents."""
    q, k, v, meta = make_case([50, 700, 3], [1, 1, 1], 32, 8, 128, 16, torch.bfloat16, seed=2)
    tables, lens = meta.block_tables.clone(), meta.context_lens.clone()
    at.paged_decode(q, k, v, tables, lens, 0.1)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = at.paged_decode(q, k, v, tables, lens, 0.1)
    for new_lens in ([50, 700, 3], [1, 350, 2]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        new_meta = dataclasses.replace(meta, context_lens=lens, scratch={})  # no cached index
        ref = paged_attention_ref(q.float(), k.float(), v.float(), new_meta, 0.1)
        assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("ctx_lens", [[1], [5, 17, 3, 32, 9], [16, 16]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_ref_matches_per_sequence(ctx_lens, dtype):
    """The CPU decode path (one padded, masked SDPA for the batch) against attending each
    sequence alone, and both against the float64 oracle."""
    from metrale.ops.attention import paged_attention_per_sequence

    q, k, v, meta = make_case(ctx_lens, [1] * len(ctx_lens), H=6, KV=2, D=16, bs=4,
                              dtype=dtype, device="cpu", seed=len(ctx_lens))
    assert not meta.is_prefill
    got = paged_attention_ref(q, k, v, meta, 0.25)
    want = paged_attention_per_sequence(q, k, v, meta, 0.25)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(got, want.float()) < tol
    assert rel_err(got, dense_oracle(q.float(), k.float(), v.float(), meta, 0.25)) < max(tol, 1e-5)


def test_lone_sequence_with_consecutive_blocks_reads_a_view():
    """The decode reference's fast path (one sequence, blocks in a row: a view of the
    cache, no gather) against the float64 oracle, and the same sequence's blocks
    scattered (the gather) giving the same result."""
    from metrale.ops.attention import decode_ref_index

    q, k, v, meta = make_case([37], [1], H=6, KV=2, D=16, bs=4, dtype=torch.float32,
                              device="cpu", seed=21, spare_blocks=0)
    need = -(-37 // 4)
    order = meta.block_tables[0, :need].tolist()
    k_row, v_row = k[order].clone(), v[order].clone()  # the same K/V, laid out in a row
    k2, v2 = torch.zeros(need + 3, *k.shape[1:]), torch.zeros(need + 3, *v.shape[1:])
    k2[2:2 + need], v2[2:2 + need] = k_row, v_row
    meta2 = AttentionMetadata(False, meta.slot_mapping, meta.context_lens,
                              torch.tensor([list(range(2, 2 + need)) + [-1]], dtype=torch.int32),
                              meta.cu_query, 1, 37)
    assert isinstance(decode_ref_index(meta2.block_tables, meta2.context_lens, 4)[0], slice)
    want = dense_oracle(q, k, v, meta, 0.25)
    assert rel_err(paged_attention_ref(q, k2, v2, meta2, 0.25), want) < 1e-6
    assert rel_err(paged_attention_ref(q, k, v, meta, 0.25), want) < 1e-6
