"""The FP8 GEMM (metrale.ops.fp8_linear) against its plain-torch reference in Triton's
interpreter, weight-only and with dynamic per-token FP8 activations: both forms (x W^T and
W x^T), per-row and block scales, split K (the last split sums the others' partials and
leaves its tile counter at 0 for the next launch), bias, ragged shapes; the activations'
rounding against torch's own float8_e4m3fn cast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.ops import fp8_linear as f
from metrale.ops.split_k import tile_counters
from tests.helpers.kernels import KERNELS

pytestmark = pytest.mark.skipif(not KERNELS, reason="needs Triton (compiled or interpreted)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(n: int, k: int, block, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if block is None:
        q, scale = f.quantize_rows(w)
        return q, scale, (1, k)
    bo, bi = block
    scale = torch.rand(-(-n // bo), -(-k // bi), generator=g) + 0.01  # [N blocks, K blocks]
    return (w * 30).clamp(-f.FP8_MAX, f.FP8_MAX).to(f.FP8_DTYPE), scale, block


@pytest.mark.parametrize("t, n, k, block, split, bias", [
    (3, 40, 96, None, 1, False),
    (5, 70, 256, None, 4, True),  # K splits of 64 over 4 programs, N ragged
    (17, 33, 128, (16, 32), 2, False),  # block scales applied per K tile
    (1, 64, 512, (8, 32), 8, True),
    (70, 48, 64, None, 1, True),  # past SPLIT_MAX_M: prefill tiles
    (9, 40, 96, None, 2, True),  # K not a multiple of the splits' tiles: masked along K
    (300, 40, 96, (16, 32), 1, True),  # from DENSE_MIN_M: dequantized for F.linear
])
@pytest.mark.parametrize("dynamic", [False, True])
def test_gemm_equals_reference(t, n, k, block, split, bias, dynamic):
    q, scale, blk = _weights(n, k, block, seed=t + n)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(k))
    b = torch.randn(n) if bias else None
    q, scale, x = q.to(DEVICE), scale.to(DEVICE), x.to(DEVICE)
    b = b.to(DEVICE) if b is not None else None
    want = f.fp8_linear_ref(x, q, scale, blk, b, dynamic)
    counters = tile_counters(n, x.device)
    forced = [f.GemmConfig(16, 16, 32, split, swap=swap) for swap in (False, True)]
    for cfg in (*forced, None):  # a forced split, both GEMM forms, then the chosen config
        for _ in range(2):  # a second launch reuses the counters the first reset
            got = f.fp8_linear(x, q, scale, blk, b, counters, cfg, dynamic=dynamic)
            torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)
    assert int(counters.abs().sum()) == 0
    if dynamic and t < f.DENSE_MIN_M:  # the rounding shows: not the weight-only answer
        assert not torch.allclose(want, f.fp8_linear_ref(x, q, scale, blk, b), rtol=1e-3)


def test_token_rounding_equals_torchs_float8_cast():
    """quantize_tokens' kernel rounds like torch's cast (nearest, ties to even) everywhere:
    ties, carries into the next binade, subnormals, the saturated maximum, a row of zeros,
    rows of very different magnitudes; each X_BLOCK columns of a row get their own scale,
    which maps that block's max |x| to FP8_MAX (computed here from the format)."""
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].sort().values  # every e4m3 value
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties
    k = 2 * f.X_BLOCK + 100  # three blocks, the last one partial
    ramp = torch.cat([grid, mids, mids * (1 + 2 ** -20), torch.tensor([448.0])])
    rows = [ramp, ramp.flip(0) * 1e-3, torch.randn(k, generator=g) * 1e-30,
            torch.randn(k, generator=g) * 1e4, torch.zeros(k)]
    x = torch.stack([F.pad(r, (0, k - len(r))) if len(r) < k else r[:k] for r in rows])
    x[3, f.X_BLOCK:2 * f.X_BLOCK] *= 1e-6  # a block far smaller than its neighbours
    x = x.to(DEVICE)
    blocks = F.pad(x, (0, 3 * f.X_BLOCK - k)).view(len(rows), 3, f.X_BLOCK)
    scale = (blocks.abs().amax(2) / f.FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    want = (blocks / scale[..., None]).view(len(rows), -1)[:, :k].to(torch.float8_e4m3fn)
    xq, xs = f.quantize_tokens(x)
    rq, rs = f.quantize_tokens_ref(x)
    assert torch.equal(xs, rs) and torch.equal(rs, scale)
    assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(rq.view(torch.uint8), want.view(torch.uint8))  # the ref is the cast
    assert xq[3, f.X_BLOCK:2 * f.X_BLOCK].float().abs().max() == f.FP8_MAX
    assert not xq[4].float().any()


def test_dequantize_kernel_equals_the_reference_bitwise():
    for block in (None, (16, 32)):
        q, scale, blk = _weights(70, 96, block, seed=3)
        q, scale = q.to(DEVICE), scale.to(DEVICE)
        want = f.dequantize(q, scale, blk)
        assert torch.equal(f.dequantize_to(q, scale, blk, torch.float32), want)


def test_a_wrong_scale_changes_the_answer():
    """The GEMM reads each block's own scale: one block's scale doubled moves its outputs."""
    q, scale, blk = _weights(32, 64, (16, 32), seed=1)
    x = torch.randn(4, 64).to(DEVICE)
    q, scale = q.to(DEVICE), scale.to(DEVICE)
    counters = tile_counters(32, x.device)
    base = f.fp8_linear(x, q, scale, blk, None, counters, f.GemmConfig(16, 16, 32, 2))
    scale[1, 1] *= 2
    moved = f.fp8_linear(x, q, scale, blk, None, counters, f.GemmConfig(16, 16, 32, 2))
    changed = (moved - base).abs().amax(0) > 1e-3  # [N]
    assert changed[16:].all() and not changed[:16].any()


def test_chosen_configs_split_only_skinny_gemms_and_fit_the_counters():
    sms = 132
    for m in (1, 8, 32, 64):
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            counters = tile_counters(n, torch.device("cpu")).numel()
            for cfg in (f.choose_config(m, n, k, 128, sms, counters),
                        f.choose_config_fp8x(m, n, k, 512, sms, counters)):
                tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
                assert cfg.block_m >= m or cfg.block_m == 64
                assert tiles <= counters and k // cfg.split_k >= cfg.block_k
    assert f.choose_config(512, 4096, 4096, 128, sms, 1024).split_k == 1


def test_inputs_it_cannot_tile_are_refused():
    q, scale, _ = _weights(32, 40, (16, 40), seed=2)  # K blocks of 40: no power-of-2 tile fits
    x = torch.randn(2, 40)
    assert not f.fits(x, (16, 20))
    with pytest.raises(ValueError, match="K blocks"):
        f.fp8_linear(x, q, scale, (16, 20), None, tile_counters(32, x.device))


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (57344, 8192)])
def test_gpu_gemm_at_model_shapes_replays_in_a_graph(n, k, dynamic):
    """bf16 activations at Llama-3-8B / 70B projection shapes, decode and prefill sizes:
    within bf16 rounding of the reference, and a captured graph's replays (the split-K
    counters reset by the kernel itself) equal the eager result bitwise."""
    q, scale, blk = _weights(n, k, None, seed=n)
    q, scale = q.cuda(), scale.cuda()
    counters = tile_counters(n, q.device)
    for t in (1, 7, 32, 64, 200, 300):
        x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
        want = f.fp8_linear_ref(x.float(), q, scale, blk, None, dynamic)  # fp32 math, same weights
        got = f.fp8_linear(x, q, scale, blk, None, counters, dynamic=dynamic)
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 1e-2, (t, float(err))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            f.fp8_linear(x, q, scale, blk, None, counters, dynamic=dynamic)  # warm-up
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = f.fp8_linear(x, q, scale, blk, None, counters, dynamic=dynamic)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, got), t
    assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("split", [1, 4])
def test_the_weight_only_gemm_takes_a_dense_weight_with_unit_scales(split):
    """bench/fp8_gemm.py times the kernel on a bf16 weight itself (bf16_split_us: a split-K
    GEMM for skinny-M dense projections); the codes' conversion is then a no-op and the
    result F.linear's."""
    g = torch.Generator().manual_seed(split)
    n, k, t = 72, 256, 5
    w = torch.randn(n, k, generator=g).to(DEVICE)
    x = torch.randn(t, k, generator=g).to(DEVICE)
    counters = tile_counters(n, x.device)
    for swap in (False, True):
        got = f.fp8_linear(x, w, torch.ones(n, 1, device=DEVICE), (1, k), None, counters,
                           f.GemmConfig(16, 16, 32, split, swap=swap))
        want = F.linear(x, w)
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)
    assert int(counters.abs().sum()) == 0
