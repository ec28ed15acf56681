"""The 4-bit weight-only GEMM (metrale.ops.int4_linear) against its plain-torch reference in
Triton's interpreter: integer codes with zero points and a codebook without, group sizes
from 32 columns to one group per row, split K (the counters back at 0 after each launch),
K not a multiple of the packed chunk, bias, ragged shapes; the layout's pack/unpack, and
the reference's dequantization written out here element by element."""

from __future__ import annotations

import pytest
import torch

from metrale.ops import int4_linear as f
from metrale.ops.split_k import tile_counters
from tests.helpers.kernels import KERNELS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(not KERNELS, reason="needs Triton (compiled or interpreted)")
CODEBOOK = torch.linspace(-1, 1, 16) ** 3  # any 16 floats


def _weights(n: int, k: int, group: int, codes: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    groups = -(-k // group)
    scale = (torch.rand(n, groups, generator=g) + 0.1).half()
    zero = None if codes else torch.randint(0, 16, (n, groups), generator=g).to(torch.uint8)
    return q, scale, zero, CODEBOOK.clone() if codes else None


def test_pack_roundtrip_and_layout():
    q = torch.randint(0, 16, (3, 300))
    packed = f.pack(q)
    assert packed.shape == (3, 512 // 8) and packed.dtype == torch.int32
    assert torch.equal(f.unpack(packed, 300), q.to(torch.uint8))
    # column 256 + 32 * 5 + 2 * 3 + 1 (chunk 1, slice 5 = 4 * 1 + 1, pair 3, second) sits in
    # chunk 1's word 16 * 1 + 3 at bit 4 * 1 + 16, its pair's first at bit 4 * 1
    q = torch.randint(0, 16, (3, 512))
    packed = f.pack(q)
    assert (int(packed[1, 32 + 16 + 3]) >> 20) & 0xF == int(q[1, 256 + 160 + 7])
    assert (int(packed[1, 32 + 16 + 3]) >> 4) & 0xF == int(q[1, 256 + 160 + 6])


def test_dequantize_written_out():
    q, scale, zero, _ = _weights(5, 96, 32, codes=False, seed=1)
    w = f.dequantize(f.pack(q), scale, zero, None, 32, 96)
    for n, k in ((0, 0), (4, 95), (2, 33), (3, 64)):
        want = (float(q[n, k]) - float(zero[n, k // 32])) * float(scale[n, k // 32])
        assert float(w[n, k]) == pytest.approx(want, rel=1e-6)
    q, scale, _, book = _weights(5, 96, 64, codes=True, seed=2)
    w = f.dequantize(f.pack(q), scale, None, book, 64, 96)
    assert float(w[1, 70]) == pytest.approx(float(book[q[1, 70]]) * float(scale[1, 1]), rel=1e-6)


@kernels
@pytest.mark.parametrize("t, n, k, group, codes, split, bias", [
    (3, 40, 256, 32, False, 1, False),
    (1, 40, 512, 64, False, 2, True),
    (5, 70, 512, 128, False, 2, True),  # two chunks over two splits, N ragged
    (1, 64, 1024, 64, True, 4, False),  # NF4-like: codebook, no zero points
    (17, 33, 96, 96, False, 1, True),  # one group per row; K padded to the chunk
    (9, 40, 160, 32, True, 1, True),  # K = 5 groups, padded
    (70, 48, 256, 128, False, 1, True),  # past SPLIT_MAX_M
    (300, 40, 96, 32, False, 1, True),  # from DENSE_MIN_M: dequantized for F.linear
])
def test_gemm_equals_reference(t, n, k, group, codes, split, bias):
    q, scale, zero, book = _weights(n, k, group, codes, seed=t + n)
    packed = f.pack(q).to(DEVICE)
    scale = scale.to(DEVICE)
    zero = zero.to(DEVICE) if zero is not None else None
    book = book.to(DEVICE) if book is not None else None
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(k)).to(DEVICE)
    b = torch.randn(n).to(DEVICE) if bias else None
    want = f.int4_linear_ref(x, packed, scale, zero, book, group, b)
    counters = tile_counters(n, x.device)
    forced = f.GemmConfig(16, 16, f.CHUNK, split, swap=True)
    for cfg in (forced, None):
        for _ in range(2):  # a second launch reuses the counters the first reset
            got = f.int4_linear(x, packed, scale, zero, book, group, b, counters, cfg)
            torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)
    assert int(counters.abs().sum()) == 0


@kernels
def test_a_wrong_group_scale_moves_exactly_its_rows():
    q, scale, zero, _ = _weights(32, 256, 64, codes=False, seed=5)
    packed, x = f.pack(q).to(DEVICE), torch.randn(2, 256).to(DEVICE)
    counters = tile_counters(32, x.device)
    cfg = f.GemmConfig(16, 16, f.CHUNK, 2, swap=True)
    base = f.int4_linear(x, packed, scale.to(DEVICE), zero.to(DEVICE), None, 64, None, counters, cfg)
    scale[7, 2] *= 2
    moved = f.int4_linear(x, packed, scale.to(DEVICE), zero.to(DEVICE), None, 64, None, counters,
                          cfg)
    changed = (moved != base).any(0).nonzero().flatten().tolist()
    assert changed == [7]


@kernels
def test_dequantize_kernel_equals_the_reference_bitwise():
    for codes, group in ((False, 32), (True, 64), (False, 96)):
        q, scale, zero, book = _weights(70, 96, group, codes, seed=3)
        packed = f.pack(q).to(DEVICE)
        args = (packed, scale.to(DEVICE), zero.to(DEVICE) if zero is not None else None,
                book.to(DEVICE) if book is not None else None, group, 96)
        assert torch.equal(f.dequantize_to(*args, torch.float32), f.dequantize(*args))


def test_groups_that_straddle_a_32_column_slice_are_refused():
    x = torch.zeros(1, 128)
    with pytest.raises(ValueError, match="multiple of 32"):
        f.int4_linear(x, f.pack(torch.zeros(4, 128, dtype=torch.int32)), torch.ones(4, 3), None,
                      None, 48, None, tile_counters(4, x.device))


def test_scaled_sums_never_span_two_groups():
    """The kernel scales a sum of 32-column slices once: each sum must lie in one group."""
    for group, k in ((32, 4096), (64, 4096), (128, 4096), (256, 4096), (512, 4096),
                     (96, 4096), (384, 4096), (4096, 4096), (96, 96), (160, 5000)):
        per = f.flush_slices(group, k) * 32
        assert f.CHUNK % per == 0  # sums end at chunk (and split-K) boundaries
        starts = range(0, f.padded_k(k), per)
        assert all(min(s // group, (k - 1) // group) ==
                   min((s + per - 1) // group, (k - 1) // group) for s in starts), (group, k)


@kernels
@pytest.mark.parametrize("dtype", [
    torch.float16, torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE == "cpu", reason=(
        "the interpreter's bf16 dot is not the GPU's; bf16 and fp16 take the PTX pair op "
        "on the GPU only")))])
def test_zero_point_codes_enter_the_mma_exactly(dtype):
    """Integer weights q - zero times x, scaled per group, for every code and zero (0..16):
    the result matches the reference up to the reference's own rounding of W to x's dtype
    (on the GPU, fp16 and bf16 through the pair op that makes two biased integers at once)."""
    n, k, group = 48, 512, 128
    q = torch.arange(n * k).remainder(16).view(n, k)  # every code in every row
    zero = torch.arange(n * (k // group)).remainder(17).view(n, -1).to(torch.uint8)
    scale = (torch.rand(n, k // group, generator=torch.Generator().manual_seed(0)) + 0.5).half()
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    args = (f.pack(q).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), None, group, None)
    exact = x.double() @ f.dequantize(*args[:5], k).double().T
    got = f.int4_linear(x, *args, tile_counters(n, x.device), f.GemmConfig(16, 16, f.CHUNK, 2,
                                                                            swap=True))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.double(), exact, atol=tol * float(exact.abs().max()), rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 32])
@pytest.mark.parametrize("n, k", [(1536, 2048), (1000, 1000)])
@pytest.mark.parametrize("codes", [False, True], ids=["zero-points", "codebook"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gemm_at_decode_sizes_equals_the_exact_product(t, n, k, codes, dtype):
    """The configs the engine runs (chosen_config: 64- and 128-row tiles, split K) with the
    pair ops in bf16 and fp16, on shapes that tile evenly and shapes that do not (N and K
    ragged): zero-point codes exact, codebook values rounded to x's dtype before the MMA
    (their group's scale after it), each within bf16's rounding of the exact product."""
    group = 64 if codes else 128
    q, scale, zero, book = _weights(n, k, group, codes=codes, seed=t + n)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(k)).to(dtype).cuda()
    args = (f.pack(q).cuda(), scale.cuda(), zero.cuda() if zero is not None else None,
            book.cuda() if book is not None else None, group, None)
    exact = x.double() @ f.dequantize(*args[:5], k).double().T
    counters = tile_counters(n, x.device)
    got = f.int4_linear(x, *args, counters)
    torch.testing.assert_close(got.double(), exact, atol=8e-3 * float(exact.abs().max()), rtol=0)
    assert int(counters.abs().sum()) == 0
