"""Multi-LoRA ops: the torch reference against a float64 per-token oracle, and the Triton
kernels against the reference.

The engine's two paths (lora_launch.PATHS, chosen per shape by lora_launch.PATH_TABLE) and
bench/lora_fused.py's one-launch kernel, which the benchmarks time beside them, are held to
the same reference.

Triton on CPU runs in its interpreter, which must be switched on before triton is first
imported (triton jits its own library, tl.min & co, at import): tests/conftest.py does it,
and `test_triton_kernels_can_run_here` fails if that ever stops working.
With CUDA the same small-shape kernel tests run compiled, and the `gpu` tests add
realistic sizes and CUDA-graph replay across an adapter swap.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import lora_fused
from metrale.ops import lora_kernels, triton_utils
from metrale.ops import lora_launch as launch
from metrale.ops import lora_ref as ref
from metrale.ops import lora_triton as lt
from tests.helpers.kernels import KERNELS

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not KERNELS, reason="needs triton on CUDA or its interpreter")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}
ALL_PATHS = ("fused", *lt.PATHS)  # "fused": bench/lora_fused.py's kernel


def apply_path(path, *args, **kw):
    """lora_apply_fused on one of the engine's paths (None: the table's), or bench's
    one-launch kernel."""
    if path == "fused":
        lora_fused.apply_fused(*args, **kw)
    else:
        lt.lora_apply_fused(*args, path=path, **kw)


class Pool:
    """An adapter pool laid out like metrale.pool: one storage; per slot, for each module,
    A [R, in] then Bt [R, out]. The ranks/scales tables are strided views (stride M) of one
    [S, M] tensor each, as the engine slices its [S, layers, modules] tables."""

    def __init__(self, S, R, dims, dtype, device=DEV, seed=0, padding=0.0, ranks=None):
        g = torch.Generator().manual_seed(seed)
        slot_elems = sum(R * (i + o) for i, o in dims)
        self.storage = torch.empty(S * slot_elems, dtype=dtype, device=device)
        self.As, self.Bts, off = [], [], 0
        for i, o in dims:
            self.As.append(self.storage.as_strided((S, R, i), (slot_elems, i, 1), off))
            self.Bts.append(self.storage.as_strided((S, R, o), (slot_elems, o, 1), off + R * i))
            off += R * (i + o)
        if ranks is None:  # each module sees every rank 0..R somewhere (as far as S allows)
            ranks = torch.randint(0, R + 1, (len(dims), S), generator=g, dtype=torch.int32)
            n = min(S, R + 1)
            for m in range(len(dims)):
                ranks[m, :n] = torch.randperm(R + 1, generator=g)[:n].int()
        ranks = torch.as_tensor(ranks, dtype=torch.int32)  # [M, S]
        self.ranks = ranks.T.contiguous().to(device).T  # [M, S] view of an [S, M] table
        scales = torch.rand(S, len(dims), generator=g) * 1.5 + 0.5  # [S, M]
        self.scales = scales.to(device).T  # [M, S]
        self.ranks_list, self.scales_list = list(self.ranks), list(self.scales)
        for m, (i, o) in enumerate(dims):
            pad = torch.arange(R)[None, :, None] >= ranks[m][:, None, None]  # [S, R, 1]
            a = torch.randn(S, R, i, generator=g) / i**0.5  # [S, R, in]
            b = torch.randn(S, R, o, generator=g) / R**0.5  # [S, R, out]
            self.As[m].copy_(a.masked_fill(pad, padding))
            self.Bts[m].copy_(b.masked_fill(pad, padding))


def oracle(y, x, pool, cols, slot_ids):
    """float64, one token and one module at a time, slicing each adapter to its rank."""
    out = y.double().clone()  # [T, sum(out)]
    for t, s in enumerate(slot_ids.tolist()):
        if s < 0:
            continue
        for m, col in enumerate(cols):
            r = int(pool.ranks[m, s])
            a = pool.As[m][s, :r].double()  # [r, in]
            b = pool.Bts[m][s, :r].double()  # [r, out_m]
            h = x[t].double() @ a.T  # [r]
            out[t, col:col + b.shape[1]] += pool.scales[m, s].double() * (h @ b)
    return out


def slot_batch(T, S, seed, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, S, (T,), generator=g)
    if T > 1:
        ids[0] = -1  # some base-only tokens
    else:
        ids.clamp_(min=0)  # a lone token uses an adapter
    return ids.to(dtype).to(DEV)


def fused_io(T, dims, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, dims[0][0], generator=g).to(DEV, dtype)  # [T, in]
    width = sum(o for _, o in dims)
    y0 = torch.randn(T, width, generator=g).to(DEV, dtype)  # [T, sum(out)] poison
    cols = [sum(o for _, o in dims[:m]) for m in range(len(dims))]
    slices = [slice(c, c + o) for c, (_, o) in zip(cols, dims, strict=True)]
    return x, y0, cols, slices


def assert_close(got, want, dtype):
    torch.testing.assert_close(got.double(), want.double(), rtol=TOL[dtype], atol=TOL[dtype])


# --- the reference against the float64 oracle --------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_ref_matches_oracle(dtype, T):
    dims = [(64, 64), (64, 32), (64, 32)]
    pool = Pool(S=10, R=8, dims=dims, dtype=dtype, device="cpu", seed=T)
    x, y0, cols, slices = fused_io(T, dims, dtype, seed=T + 1)
    x, y0 = x.cpu(), y0.cpu()
    ids = slot_batch(T, 10, seed=T + 2).cpu()
    want = oracle(y0, x, pool, cols, ids)

    y = y0.clone()
    ref.lora_apply_fused_ref(y, x, pool.As, pool.Bts, slices, ids, pool.scales_list)
    assert_close(y, want, dtype)
    y = y0.clone()  # skipping padding through ranks gives the same answer
    ref.lora_apply_fused_ref(y, x, pool.As, pool.Bts, slices, ids, pool.scales_list,
                             pool.ranks_list)
    assert_close(y, want, dtype)

    for m, sl in enumerate(slices):  # one module at a time, and shrink then expand
        y = y0[:, sl].clone()
        ref.lora_apply_ref(y, x, pool.As[m], pool.Bts[m], ids, pool.scales[m])
        assert_close(y, want[:, sl], dtype)
        h = ref.lora_shrink_ref(x, pool.As[m], ids)  # [T, R]
        assert h.dtype == torch.float32 and not h[ids < 0].any()
        y = y0[:, sl].clone()
        ref.lora_expand_ref(y, h, pool.Bts[m], ids, pool.scales[m])
        assert_close(y, want[:, sl], dtype)


def test_ref_leaves_base_only_batches_alone():
    pool = Pool(S=4, R=8, dims=[(64, 32)], dtype=torch.float32, device="cpu")
    x, y0, _, _ = fused_io(6, [(64, 32)], torch.float32, seed=3)
    x, y0 = x.cpu(), y0.cpu()
    ids = torch.full((6,), -1)
    y = y0.clone()
    ref.lora_apply_ref(y, x, pool.As[0], pool.Bts[0], ids, pool.scales[0])
    ref.lora_apply_fused_ref(y, x, pool.As, pool.Bts, [slice(0, 32)], ids, pool.scales_list)
    assert torch.equal(y, y0)
    assert not ref.lora_shrink_ref(x, pool.As[0], ids).any()


# --- the Triton kernels against the reference (interpreter on CPU, compiled on CUDA) ------

# decode: per-token programs; prefill: more than DECODE_MAX_T tokens, sorted by slot inside;
# unsorted: prefill kernels fed an identity order, so a block holds many slots; segments:
# the engine's order (each slot's run padded with -1 rows to whole blocks).
MODES = {"decode": (7, None), "prefill": (40, None), "unsorted": (40, "identity"),
         "segments": (40, "segments")}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def mode_inputs(mode, S, seed, slot_dtype=torch.int64):
    T, order = MODES[mode]
    ids = slot_batch(T, S, seed, slot_dtype)
    if order == "segments":
        return T, ids, lt.slot_order(ids)
    return T, ids, (torch.arange(T, device=DEV) if order == "identity" else None)


def pools(S, R, dims, dtype, seed, ranks=None):
    """(clean pool for the reference, same pool with NaN rank padding for the kernels)."""
    return (Pool(S, R, dims, dtype, seed=seed, ranks=ranks),
            Pool(S, R, dims, dtype, seed=seed, padding=float("nan"), ranks=ranks))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(MODES))
def test_shrink_expand_match_ref(mode, dtype):
    seed = list(MODES).index(mode) * 10 + DTYPES.index(dtype)
    clean, nan = pools(S=10, R=8, dims=[(64, 48)], dtype=dtype, seed=seed)
    T, ids, order = mode_inputs(mode, 10, seed, torch.int32 if seed % 2 else torch.int64)
    x, _, _, _ = fused_io(T, [(64, 48)], dtype, seed)

    h = torch.full((T, 8), float("nan"), device=DEV)  # poisoned: every entry must be written
    lt.lora_shrink(x, nan.As[0], ids, nan.ranks[0], order=order, out=h)
    want_h = ref.lora_shrink_ref(x, clean.As[0], ids)
    torch.testing.assert_close(h, want_h, rtol=1e-4, atol=1e-4)
    assert not h[ids < 0].any()

    # y is a column window of a wider poisoned buffer: row stride != width, edges untouched
    wide0 = torch.randn(T, 64, device=DEV).to(dtype)
    wide = wide0.clone()
    y = wide[:, 8:56]  # [T, 48]
    lt.lora_expand(y, want_h, nan.Bts[0], ids, nan.scales[0], nan.ranks[0], order=order)
    want = wide0[:, 8:56].clone()
    ref.lora_expand_ref(want, want_h, clean.Bts[0], ids, clean.scales[0])
    assert_close(y, want, dtype)
    assert torch.equal(wide[:, :8], wide0[:, :8]) and torch.equal(wide[:, 56:], wide0[:, 56:])
    assert torch.equal(y[ids < 0], wide0[:, 8:56][ids < 0])


GROUPS = {"qkv_gqa": [(64, 64), (64, 32), (64, 32)], "gate_up": [(64, 96), (64, 96)]}


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("group", list(GROUPS))
def test_fused_apply_matches_ref(group, mode, dtype):
    dims = GROUPS[group]
    seed = 100 + list(MODES).index(mode) * 10 + DTYPES.index(dtype) + 50 * (group == "gate_up")
    clean, nan = pools(S=12, R=8, dims=dims, dtype=dtype, seed=seed)
    T, ids, order = mode_inputs(mode, 12, seed)
    x, y0, _, slices = fused_io(T, dims, dtype, seed)
    y = y0.clone()
    lt.lora_apply_fused(y, x, nan.As, nan.Bts, slices, ids, nan.scales_list, nan.ranks_list,
                        order=order)
    want = y0.clone()
    ref.lora_apply_fused_ref(want, x, clean.As, clean.Bts, slices, ids, clean.scales_list)
    assert_close(y, want, dtype)
    assert torch.equal(y[ids < 0], y0[ids < 0])


@pytest.fixture
def small_k(monkeypatch):
    """K blocks of 16/32 columns, so that the tests' small `in` splits K in both configs
    (with the H200 blocks, in <= 256 is a single K block and split-K goes untested)."""
    monkeypatch.setattr(launch, "DECODE_CFG", dict(launch.DECODE_CFG, BLOCK_K=16))
    monkeypatch.setattr(launch, "PREFILL_CFG", dict(launch.PREFILL_CFG, BLOCK_K=32))
    assert launch.split_k(3, 256, 2, launch.config(3, False, 16))[0] > 1


@needs_kernels
@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_rank_tiles_split_k_and_separate_tables(mode, path, small_k):
    """R=80 needs two rank tiles (fused: one 128-row tile); in=256 splits K (atomic adds
    into h, or per-split partials; small_k makes that so at decode's BLOCK_K too); the
    ranks and scales tables are separate tensors, so the wrapper stacks them."""
    dims = [(256, 40), (256, 24)]
    ranks = [[0, 1, 63, 64, 65, 80], [80, 17, 0, 72, 8, 1]]
    clean, nan = pools(S=6, R=80, dims=dims, dtype=torch.float32, seed=7, ranks=ranks)
    T = 3 if mode == "decode" else lt.DECODE_MAX_T + 16
    ids = slot_batch(T, 6, seed=8)
    x, y0, _, slices = fused_io(T, dims, torch.float32, seed=9)
    y = y0.clone()
    ranks = [r.clone() for r in nan.ranks_list]
    scales = [s.clone().double() for s in nan.scales_list]  # wrong dtype: converted
    apply_path(path, y, x, nan.As, nan.Bts, slices, ids, scales, ranks)
    want = oracle(y0, x, clean, [0, 40], ids)
    assert_close(y, want, torch.float32)


@needs_kernels
def test_base_only_batch_is_untouched():
    _, nan = pools(S=4, R=8, dims=[(64, 32), (64, 32)], dtype=torch.bfloat16, seed=11)
    for T in (5, 40):
        x, y0, _, slices = fused_io(T, [(64, 32), (64, 32)], torch.bfloat16, seed=T)
        ids = torch.full((T,), -1, device=DEV)
        y = y0.clone()
        lt.lora_apply_fused(y, x, nan.As, nan.Bts, slices, ids, nan.scales_list, nan.ranks_list)
        assert torch.equal(y, y0)
        h = torch.full((T, 8), float("nan"), device=DEV)
        assert not lt.lora_shrink(x, nan.As[0], ids, nan.ranks[0], out=h).any()


# --- the paths: split (partials), atomic (memset + atomic adds), bench's fused (one launch) --

PATH_RANKS = [[4, 8, 16, 4, 16, 8, 0], [8, 16, 4, 0, 4, 16, 8], [16, 4, 8, 8, 0, 4, 16]]


def dora_tables(S, dims, seed, dora):
    """(doras_list, gains_list, bias) for a group: every other slot DoRA, or None."""
    if not dora:
        return None, None, None
    g = torch.Generator().manual_seed(seed)
    doras = [torch.tensor([(s + m) % 2 for s in range(S)], dtype=torch.int32, device=DEV)
             for m in range(len(dims))]
    gains = [(torch.rand(S, o, generator=g) + 0.5).to(DEV) for _, o in dims]
    bias = torch.randn(sum(o for _, o in dims), generator=g)
    return doras, gains, bias


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("T", [1, 7, 33, 64])
@pytest.mark.parametrize("path", ALL_PATHS)
def test_paths_match_ref(path, T, dora, dtype, small_k):
    """The q/k/v group with ranks 4/8/16 (and 0) mixed per slot and module, NaN rank padding,
    tokens on every slot and on -1, DoRA on or off, through each path at decode sizes
    (in=64 in four K splits: small_k)."""
    dims = GROUPS["qkv_gqa"]
    S, seed = 7, 1000 + T + 7 * dora + 3 * ALL_PATHS.index(path)
    clean, nan = pools(S=S, R=16, dims=dims, dtype=dtype, seed=seed, ranks=PATH_RANKS)
    ids = slot_batch(T, S, seed)
    x, y0, _, slices = fused_io(T, dims, dtype, seed)
    doras, gains, bias = dora_tables(S, dims, seed, dora)
    if bias is not None:
        bias = bias.to(DEV, dtype)
        y0 = (y0.float() + bias.float()).to(dtype)  # y holds x W^T + bias on entry
    y = y0.clone()
    apply_path(path, y, x, nan.As, nan.Bts, slices, ids, nan.scales_list, nan.ranks_list,
               doras_list=doras, gains_list=gains, bias=bias)
    want = y0.clone()
    ref.lora_apply_fused_ref(want, x, clean.As, clean.Bts, slices, ids, clean.scales_list,
                             clean.ranks_list, doras_list=doras, gains_list=gains, bias=bias)
    assert_close(y, want, dtype)
    assert torch.equal(y[ids < 0], y0[ids < 0])
    if path == "split":  # no atomics: bit for bit the same on a second run
        again = y0.clone()
        lt.lora_apply_fused(again, x, nan.As, nan.Bts, slices, ids, nan.scales_list,
                            nan.ranks_list, doras_list=doras, gains_list=gains, bias=bias,
                            path=path)
        assert torch.equal(again, y)


@needs_kernels
@pytest.mark.parametrize("dora", [False, True])
@pytest.mark.parametrize("path", lt.PATHS)
def test_lora_linear_is_the_gemm_then_the_delta(path, dora, small_k):
    """lora_linear(x, base, b, ...) == base(x) = F.linear(x, W, b) then lora_apply_fused
    (bias, DoRA): the layers call the former (it overlaps the shrink with the GEMM on CUDA)."""
    dims = GROUPS["qkv_gqa"]
    T, S, seed = 9, 7, 77 + dora
    clean, nan = pools(S=S, R=16, dims=dims, dtype=torch.float32, seed=seed, ranks=PATH_RANKS)
    ids = slot_batch(T, S, seed)
    x, y0, _, slices = fused_io(T, dims, torch.float32, seed)
    doras, gains, bias = dora_tables(S, dims, seed, dora)
    bias = None if bias is None else bias.to(DEV)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(y0.shape[1], x.shape[1], generator=g).to(DEV)  # [sum(out), in]
    base = functools.partial(torch.nn.functional.linear, weight=weight, bias=bias)
    got = lt.lora_linear(x, base, bias, nan.As, nan.Bts, slices, ids, nan.scales_list,
                         nan.ranks_list, doras_list=doras, gains_list=gains, path=path)
    want = torch.nn.functional.linear(x, weight, bias)
    ref.lora_apply_fused_ref(want, x, clean.As, clean.Bts, slices, ids, clean.scales_list,
                             clean.ranks_list, doras_list=doras, gains_list=gains, bias=bias)
    assert_close(got, want, torch.float32)


@needs_kernels
@pytest.mark.parametrize("cfg", [
    dict(min_block_n=16, max_block_n=16, max_block_k=16),  # many runs, K loop of 4
    dict(programs=1, min_block_n=16, max_block_n=16),  # one run per token, chunk loop
    dict(programs=1 << 20, l2_bytes=1 << 30, min_block_n=16, max_block_n=32),  # run per chunk
    dict(l2_bytes=1),  # the A re-read cap wins: one run per (token, module)
])
def test_fused_tilings(cfg, monkeypatch):
    """The fused kernel's column runs and chunk loops: every tiling gives the reference,
    including runs that straddle the end of the narrower k/v modules."""
    monkeypatch.setattr(lora_fused, "FUSED_CFG", dict(lora_fused.FUSED_CFG, **cfg))
    dims = [(64, 96), (64, 48), (64, 80)]
    clean, nan = pools(S=7, R=16, dims=dims, dtype=torch.float32, seed=5, ranks=PATH_RANKS)
    ids = slot_batch(5, 7, seed=6)
    x, y0, _, slices = fused_io(5, dims, torch.float32, seed=7)
    y = y0.clone()
    lora_fused.apply_fused(y, x, nan.As, nan.Bts, slices, ids, nan.scales_list, nan.ranks_list)
    want = oracle(y0, x, clean, [s.start for s in slices], ids)
    assert_close(y, want, torch.float32)


@needs_kernels
def test_split_partials_hold_the_shrink():
    """shrink into a workspace(partials=True): several splits (in=1024: four K blocks)
    whose sum is h on the rows expand reads."""
    dims = [(1024, 32), (1024, 32)]
    clean, nan = pools(S=7, R=16, dims=dims, dtype=torch.float32, seed=3, ranks=PATH_RANKS[:2])
    ids = slot_batch(3, 7, seed=4)
    x, _, _, _ = fused_io(3, dims, torch.float32, seed=5)
    parts = launch.shrink(x, nan.As, ids, nan.ranks_list, None,
                          launch.workspace(x, nan.As, None, partials=True))
    assert parts.shape[0] > 1 and parts.shape[1:] == (3, 32)
    h = parts.sum(0)
    for m in range(2):
        want = ref.lora_shrink_ref(x, clean.As[m], ids)  # [T, R]
        for t, s in enumerate(ids.tolist()):
            r = int(clean.ranks[m, s]) if s >= 0 else 0
            torch.testing.assert_close(h[t, m * 16:m * 16 + r], want[t, :r], rtol=1e-5, atol=1e-5)


MEASURED = Path(__file__).resolve().parents[1] / "bench/results/lora_kernels-20261201-040001.json"


def test_path_table_follows_the_measurements():
    """Past 64 tokens, wherever one path was faster by 5% or more in both slot spreads of
    the committed H200 measurement (a group's LoRA alone, Llama-3-8B), PATH_TABLE picks it;
    at decode sizes it keeps atomic, the path of every end-to-end decode measurement
    (docs/DESIGN.md: split alone was faster there for some groups, not end to end)."""
    runs = defaultdict(list)
    for row in json.loads(MEASURED.read_text())["rows"]:
        runs[row["T"], row["group"]].append(row["split_us"] / row["atomic_us"])
    checked = 0
    for (T, group), ratios in sorted(runs.items()):
        if T <= lt.DECODE_MAX_T:
            assert launch.choose_path(T) == "atomic", (T, group)
            continue
        want = "split" if max(ratios) <= 0.95 else "atomic" if min(ratios) >= 1 / 0.95 else None
        if want:
            assert launch.choose_path(T) == want, (group, T, ratios)
            checked += 1
    assert checked >= 3


def test_every_size_has_a_path():
    assert {launch.choose_path(T) for T in (1, 8, 64, 65, 1 << 20)} == set(lt.PATHS)


@needs_kernels
def test_the_engine_refuses_the_bench_only_path():
    _, nan = pools(S=2, R=4, dims=[(16, 8)], dtype=torch.float32, seed=1)
    x, y, _, slices = fused_io(2, [(16, 8)], torch.float32, seed=2)
    with pytest.raises(ValueError, match="path must be one of"):
        lt.lora_apply_fused(y, x, nan.As, nan.Bts, slices, slot_batch(2, 2, seed=3),
                            nan.scales_list, nan.ranks_list, path="fused")


@pytest.mark.skipif(triton_utils.triton is None, reason="triton is not installed")
def test_triton_kernels_can_run_here():
    """tests/conftest.py switches the interpreter on before anything imports triton.
    If this fails, something imported triton first, and every kernel test here would
    silently skip instead of running."""
    assert KERNELS


@needs_kernels
def test_interpreter_is_recognised():
    """The kernels pick exact fp32 dots by this (the interpreter's bf16 tl.dot is wrong)."""
    kernel = triton_utils.jit_kernel(lora_kernels.shrink_kernel, torch.device(DEV))
    assert triton_utils.is_interpreted(kernel) == (DEV == "cpu")


# --- realistic sizes, compiled on a GPU (Llama-3-8B projections, R=16, 32 slots) ---------

GPU_GROUPS = {
    "qkv": [(4096, 4096), (4096, 1024), (4096, 1024)],
    "o": [(4096, 4096)],
    "gate_up": [(4096, 14336), (4096, 14336)],
    "down": [(14336, 4096)],
}


@functools.cache
def gpu_pools(group, dtype):
    return pools(S=32, R=16, dims=GPU_GROUPS[group], dtype=dtype, seed=len(group))


def rel_err(got, want, base):
    """||got - want|| / ||want - base||: error relative to the LoRA delta, not to y
    (a batch whose delta is zero must then match exactly)."""
    delta = (want.double() - base.double()).norm().clamp_min(1e-30)
    return ((got.double() - want.double()).norm() / delta).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", [None, *ALL_PATHS])
@pytest.mark.parametrize("T", [1, 8, 64, 2048])
@pytest.mark.parametrize("group", list(GPU_GROUPS))
def test_gpu_fused_matches_ref(group, T, path):
    if path == "fused" and T > lt.DECODE_MAX_T:
        pytest.skip("the fused kernel is for decode batches")
    dims = GPU_GROUPS[group]
    clean, nan = gpu_pools(group, torch.bfloat16)
    ids = slot_batch(T, 32, seed=T)
    x, y0, _, slices = fused_io(T, dims, torch.bfloat16, seed=T)
    y = y0.clone()
    apply_path(path, y, x, nan.As, nan.Bts, slices, ids, nan.scales_list, nan.ranks_list)
    want = y0.clone()
    ref.lora_apply_fused_ref(want, x, clean.As, clean.Bts, slices, ids, clean.scales_list)
    assert rel_err(y, want, y0) < 1e-2
    assert torch.equal(y[ids < 0], y0[ids < 0])

    h = lt.lora_shrink(x, nan.As[0], ids, nan.ranks[0])
    want_h = ref.lora_shrink_ref(x, clean.As[0], ids)
    assert rel_err(h, want_h, torch.zeros_like(want_h)) < 1e-3
    y = y0[:, slices[0]].clone()
    lt.lora_expand(y, want_h, nan.Bts[0], ids, nan.scales[0], nan.ranks[0])
    want = y0[:, slices[0]].clone()
    ref.lora_expand_ref(want, want_h, clean.Bts[0], ids, clean.scales[0])
    assert rel_err(y, want, y0[:, slices[0]]) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [8, 300])
def test_gpu_fp32_pool_is_exact(T):
    """fp32 pools take "ieee" dots, not tf32: tight agreement with the reference."""
    dims = [(1024, 512), (1024, 256)]
    clean, nan = pools(S=16, R=16, dims=dims, dtype=torch.float32, seed=T)
    ids = slot_batch(T, 16, seed=T)
    x, y0, _, slices = fused_io(T, dims, torch.float32, seed=T)
    y = y0.clone()
    lt.lora_apply_fused(y, x, nan.As, nan.Bts, slices, ids, nan.scales_list, nan.ranks_list)
    want = y0.clone()
    ref.lora_apply_fused_ref(want, x, clean.As, clean.Bts, slices, ids, clean.scales_list)
    assert rel_err(y, want, y0) < 1e-5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("T", [1, 16, 512])
def test_gpu_cuda_graph_replays_across_adapter_swap(T, path):
    """A graph captured once keeps serving after new adapters (weights, ranks, scales) land in
    the slots and the batch's slot ids change: the kernels read all of it from device memory."""
    dims = GPU_GROUPS["qkv"]
    pool = Pool(S=8, R=16, dims=dims, dtype=torch.bfloat16, seed=1)
    other = Pool(S=8, R=16, dims=dims, dtype=torch.bfloat16, seed=2)
    x, y0, _, slices = fused_io(T, dims, torch.bfloat16, seed=T)
    ids = slot_batch(T, 8, seed=1)
    y = torch.empty_like(y0)

    def step():
        y.copy_(y0)
        apply_path(path, y, x, pool.As, pool.Bts, slices, ids, pool.scales_list,
                   pool.ranks_list)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile kernels and cache descriptors before capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for swap in (False, True):
        if swap:
            pool.storage.copy_(other.storage)
            pool.ranks.copy_(other.ranks)
            pool.scales.copy_(other.scales)
            ids.copy_(slot_batch(T, 8, seed=2))
        graph.replay()
        want = y0.clone()
        ref.lora_apply_fused_ref(want, x, pool.As, pool.Bts, slices, ids, pool.scales_list)
        assert rel_err(y, want, y0) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ids", [[3, 3, 3, 3], [-1, 2, 2, -1, 5], [1, 4, 1, -1, 4, 1], [-1, -1]])
def test_ref_with_batch_groups_is_bit_exact(dtype, ids):
    """The engine's once-per-batch groups (slices for contiguous slots, index tensors
    otherwise) give exactly what per-call grouping gives."""
    dims = [(64, 64), (64, 32), (64, 32)]
    pool = Pool(S=6, R=8, dims=dims, dtype=dtype, device="cpu", seed=len(ids))
    x, y0, _, slices = fused_io(len(ids), dims, dtype, seed=7)
    x, y0 = x.cpu(), y0.cpu()
    slot_ids = torch.tensor(ids)
    groups = ref.token_groups(ids)
    assert all(isinstance(idx, slice) for s, idx in groups if ids.count(s) == 1)
    for ranks in (None, pool.ranks_list):
        want, got = y0.clone(), y0.clone()
        ref.lora_apply_fused_ref(want, x, pool.As, pool.Bts, slices, slot_ids,
                                 pool.scales_list, ranks)
        ref.lora_apply_fused_ref(got, x, pool.As, pool.Bts, slices, slot_ids,
                                 pool.scales_list, ranks, groups=groups)
        assert torch.equal(got, want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 32, 300])
def test_gpu_overlapped_lora_linear_in_a_graph(T):
    """The shrink on the side stream sees the x written just before each replay, and the
    result equals the one-stream computation bit for bit (split path: no atomics), across
    replays with new x, new slot ids and a swapped adapter."""
    dims = GPU_GROUPS["qkv"]
    pool = Pool(S=8, R=16, dims=dims, dtype=torch.bfloat16, seed=3)
    other = Pool(S=8, R=16, dims=dims, dtype=torch.bfloat16, seed=4)
    x, _, _, slices = fused_io(T, dims, torch.bfloat16, seed=T)
    g = torch.Generator().manual_seed(T)
    weight = (torch.randn(sum(o for _, o in dims), dims[0][0], generator=g) / 64).to(
        DEV, torch.bfloat16)
    ids = slot_batch(T, 8, seed=1)
    out = torch.empty(T, weight.shape[0], dtype=torch.bfloat16, device=DEV)

    def linear():
        return lt.lora_linear(x, functools.partial(torch.nn.functional.linear, weight=weight),
                              None, pool.As, pool.Bts, slices, ids,
                              pool.scales_list, pool.ranks_list, path="split")

    def step():
        out.copy_(linear())

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for round_ in range(4):
        x.copy_(torch.randn(x.shape, generator=g).to(DEV, torch.bfloat16))
        ids.copy_(slot_batch(T, 8, seed=10 + round_))
        if round_ == 2:
            pool.storage.copy_(other.storage)
        graph.replay()
        want = torch.nn.functional.linear(x, weight)  # the one-stream computation
        lt.lora_apply_fused(want, x, pool.As, pool.Bts, slices, ids, pool.scales_list,
                            pool.ranks_list, path="split")
        torch.cuda.synchronize()
        assert torch.equal(out, want)


# --- the engine's slot order (host side, no kernel) --------------------------------------

@pytest.mark.parametrize("T,S,seed", [(1, 4, 0), (40, 3, 1), (256, 64, 2), (300, 200, 3), (65, 1, 4)])
def test_segment_order_gives_every_block_one_slot(T, S, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, S, T)
    bt = launch.sorted_block_t(T)
    order = launch.segment_order(ids)
    assert len(order) % bt == 0 and len(order) <= launch.segment_order_rows(T, S)
    for block in order.reshape(-1, bt):  # one adapter a block, padding after its tokens
        toks = block[block >= 0]
        assert len(set(ids[toks])) <= 1
        assert (block[:len(toks)] >= 0).all()
    real = order[order >= 0]
    # every adapter token once, base tokens never; by slot, in token order within one
    assert sorted(real) == sorted(np.flatnonzero(ids >= 0))
    assert list(real) == sorted(real, key=lambda t: (ids[t], t))
    padded = launch.segment_order(ids, launch.segment_order_rows(T, S))
    assert len(padded) == launch.segment_order_rows(T, S) and (padded[len(order):] == -1).all()
    assert np.array_equal(padded[:len(order)], order)


def test_segment_order_refuses_a_buffer_too_short():
    ids = np.arange(40) % 3
    with pytest.raises(ValueError, match="does not fit"):
        launch.segment_order(ids, 16)
