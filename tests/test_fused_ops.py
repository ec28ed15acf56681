"""Fused RMSNorm and rotary kernels (CUDA path of metrale.model.layers) against the torch
code they replace: exact in float32 up to summation order, within an ulp in bf16.
Interpreted on CPU (tests/conftest.py turns the interpreter on), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from metrale.config import ModelConfig
from metrale.model.layers import RMSNorm, RotaryEmbedding
from metrale.ops import fused_triton as fused
from tests.helpers.kernels import KERNELS
from tests.helpers.tiny_models import hf_config

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not KERNELS, reason="needs triton on CUDA or its interpreter")
# bf16: two roundings (as torch does them) may each land an ulp apart after fp32 math in
# another order; the interpreter also truncates where compiled code rounds to nearest
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -6, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [64, 96, 4096])
def test_rmsnorm_matches_torch(dtype, N):
    g = torch.Generator().manual_seed(N)
    norm = RMSNorm(N, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(N, generator=g))
    norm = norm.to(DEV, dtype)
    x = (3 * torch.randn(7, 3 * N, generator=g)).to(DEV, dtype)[:, N:2 * N]  # row stride 3N
    got = fused.rmsnorm(x, norm.weight, 1e-5)
    want = norm.to("cpu")(x.cpu())  # the torch path (CPU tensors never take the fused one)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,heads", [("llama", (4, 2)), ("llama", (32, 8))])
def test_rotary_matches_torch(dtype, arch, heads):
    H, KV = heads
    cfg = ModelConfig.from_hf_dict(hf_config(arch, num_attention_heads=H, num_key_value_heads=KV,
                                             hidden_size=16 * H, rope_theta=500000.0).to_dict())
    rot = RotaryEmbedding(cfg, 300)
    g = torch.Generator().manual_seed(H)
    T, D = 9, cfg.head_dim
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=g).to(dtype)  # q, k as strided views
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + KV) * D].view(T, KV, D)
    pos = torch.tensor([0, 1, 2, 17, 5, 299, 64, 3, 100])
    want_q, want_k = rot(pos, q, k)  # CPU: the torch path
    got_q, got_k = fused.rotary(pos.to(DEV), q.to(DEV), k.to(DEV), rot.cos.to(DEV), rot.sin.to(DEV))
    torch.testing.assert_close(got_q.cpu(), want_q, **TOL[dtype])
    torch.testing.assert_close(got_k.cpu(), want_k, **TOL[dtype])


@pytest.mark.gpu
def test_gpu_llama8b_sizes():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(4096, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(4096, generator=g))
    x = torch.randn(64, 4096, generator=g).to(torch.bfloat16)
    want = norm(x)
    got = fused.rmsnorm(x.cuda(), norm.weight.to("cuda", torch.bfloat16), 1e-5)
    torch.testing.assert_close(got.cpu(), want.to(torch.bfloat16), **TOL[torch.bfloat16])
    cfg = ModelConfig.from_hf_dict(hf_config("llama", hidden_size=4096, num_attention_heads=32,
                                             num_key_value_heads=8, rope_theta=5e5).to_dict())
    rot = RotaryEmbedding(cfg, 4096)
    qkv = torch.randn(64, 48 * 128, generator=g).to(torch.bfloat16)
    q, k = qkv[:, :4096].view(64, 32, 128), qkv[:, 4096:5120].view(64, 8, 128)
    pos = torch.randint(0, 4096, (64,), generator=g)
    want_q, want_k = rot(pos, q, k)
    got_q, got_k = fused.rotary(pos.cuda(), q.cuda(), k.cuda(), rot.cos.cuda(), rot.sin.cuda())
    torch.testing.assert_close(got_q.cpu(), want_q, **TOL[torch.bfloat16])
    torch.testing.assert_close(got_k.cpu(), want_k, **TOL[torch.bfloat16])
