"""metrale.ops.moe_triton against its plain-torch oracles, the kernels in Triton's
interpreter: the routing's expert blocks, the grouped GEMM, per-pair expert LoRA."""

from __future__ import annotations

import pytest
import torch

from metrale.ops import moe_triton
from tests.helpers.kernels import KERNELS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(not KERNELS, reason="needs Triton (compiled or interpreted)")


def _routing(T: int, k: int, E: int, seed: int) -> torch.Tensor:
    """[T, k] distinct experts per token, as top-k picks them."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)


@pytest.mark.parametrize("T,k,E", [(1, 1, 4), (5, 2, 8), (40, 4, 6), (300, 4, 16), (64, 8, 128)])
def test_route_blocks_puts_every_pair_once_in_a_block_of_its_expert(T, k, E):
    """The torch oracle by its invariants; the one-launch kernel gives its arrays exactly."""
    experts = _routing(T, k, E, seed=T)
    counts = torch.full((E,), 99, dtype=torch.int32, device=DEVICE)  # stale counts must not leak in
    b = moe_triton.route_blocks_ref(experts, E, counts)
    if KERNELS:
        kernel_counts = torch.full((E,), 99, dtype=torch.int32, device=DEVICE)
        got = moe_triton.route_blocks(experts, E, kernel_counts)
        for name in ("pairs", "block_expert", "used_rows", "experts"):
            assert torch.equal(getattr(got, name), getattr(b, name)), name
        assert torch.equal(kernel_counts, counts)
        assert (got.n_pairs, got.block_m) == (b.n_pairs, b.block_m)
    P, bm = T * k, b.block_m
    assert b.n_pairs == P and torch.equal(b.experts, experts.reshape(-1).to(torch.int32))
    assert torch.equal(counts, torch.bincount(experts.reshape(-1), minlength=E).to(torch.int32))
    used = int(b.used_rows)
    assert used == sum(-(-int(c) // bm) * bm for c in counts)
    assert b.block_expert.numel() * bm >= used
    rows = b.pairs[:used].view(-1, bm)
    assert torch.all(b.pairs[used:] == P)
    seen = []
    for blk, (expert, pairs) in enumerate(zip(b.block_expert.tolist(), rows)):
        real = pairs[pairs < P]
        assert len(real), f"block {blk} below used_rows holds no pair"
        assert torch.all(b.experts[real.long()] == expert), blk
        assert torch.all(real[1:] > real[:-1])  # pair order within an expert
        seen += real.tolist()
    assert sorted(seen) == list(range(P))


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_div", [1, 3])
def test_grouped_gemm_equals_the_per_expert_reference(dtype, rows_div):
    torch.manual_seed(0)
    T, k, E, N, K = 7, 3, 5, 40, 72  # tiles cut N and K short
    experts = _routing(T, k, E, seed=1)
    x = torch.randn(T * k // rows_div, K).to(DEVICE, dtype)
    w = torch.randn(E, N, K).to(DEVICE, dtype)
    blocks = moe_triton.route_blocks(experts, E)
    got = moe_triton.grouped_gemm(x, w, blocks, rows_div)
    want = moe_triton.grouped_gemm_ref(x, w, blocks.experts, rows_div)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # the oracle itself, from first principles for one pair
    p = 10
    e = int(experts.reshape(-1)[p])
    torch.testing.assert_close(want[p].float(), (x[p // rows_div].float() @ w[e].float().T),
                               rtol=tol, atol=tol)


def _expert_lora(S: int, E: int, R: int, ranks: list[int], n_in: int, n_out: int):
    a = torch.zeros(S, R * E, n_in)
    bt = torch.zeros(S, R * E, n_out)
    for s, r in enumerate(ranks):  # slot s's rank-r factors stacked per expert
        a[s, :r * E] = torch.randn(r * E, n_in)
        bt[s, :r * E] = torch.randn(r * E, n_out)
    table = torch.zeros(S, 3, dtype=torch.int32)  # [S, layers]: a strided column, as the pool's
    table[:, 1] = torch.tensor(ranks, dtype=torch.int32)
    scales = torch.zeros(S, 3)
    scales[:, 1] = torch.tensor([0.5, 2.0, 1.5][:S])  # none 1: a dropped scale shows
    a, bt, table, scales = (t.to(DEVICE) for t in (a, bt, table, scales))
    return moe_triton.ExpertLora(a, bt, table[:, 1], scales[:, 1], E, R)


@kernels
@pytest.mark.parametrize("rows_div", [1, 2])
@pytest.mark.parametrize("config", [None, moe_triton.ExpertLoraConfig(4, 16, 4)],
                         ids=["default", "split"])
@pytest.mark.parametrize("slots", [[0, -1, 2, 1, 2, 0], [2] * 6, [-1, 1, -1, 1, 1, -1]],
                         ids=["mixed", "one-adapter", "none"])
def test_expert_lora_in_the_gemm_equals_the_per_pair_reference(rows_div, config, slots):
    """The shrink launch and the grouped GEMM's epilogue: blocks whose pairs share an
    adapter (the dot), blocks mixing adapters, base rows and a rank-0 slot (the gather)."""
    torch.manual_seed(2)
    T, k, E, n_in, n_out = 6, 2, 4, 24, 40
    lora = _expert_lora(S=3, E=E, R=4, ranks=[2, 0, 4], n_in=n_in, n_out=n_out)
    slot_ids = torch.tensor(slots, device=DEVICE)  # base rows and the rank-0 slot 1 add nothing
    experts = _routing(T, k, E, seed=3)
    x = torch.randn(T * k // rows_div, n_in).to(DEVICE)
    w = torch.randn(E, n_out, n_in).to(DEVICE)
    blocks = moe_triton.route_blocks(experts, E)
    delta = moe_triton.expert_shrink(x, slot_ids, blocks.experts, lora, rows_div, config)
    got = moe_triton.grouped_gemm(x, w, blocks, rows_div, lora=delta)
    y0 = moe_triton.grouped_gemm_ref(x, w, blocks.experts, rows_div)
    want = y0.clone()
    moe_triton.expert_lora_ref(want, x, slot_ids, blocks.experts, lora, rows_div)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    untouched = ((slot_ids < 0) | (slot_ids == 1)).repeat_interleave(k)
    torch.testing.assert_close(got[untouched], y0[untouched], rtol=1e-4, atol=1e-4)
    if not untouched.all():
        assert not torch.allclose(got[~untouched], y0[~untouched], rtol=1e-2, atol=1e-2)
    if slots != [0, -1, 2, 1, 2, 0]:
        return
    experts = blocks.experts
    y0 = torch.zeros(T * k, n_out).to(DEVICE)
    want = y0.clone()
    moe_triton.expert_lora_ref(want, x, slot_ids, experts, lora, rows_div)
    # the oracle from PEFT's ParamWrapper layout: expert e's delta weight is B_e A_e with
    # A_e = A[e*r:(e+1)*r] and B_e's column j = B^T row j*E + e
    p = 4  # token 2 (slot 2, rank 4)
    s, e, r = 2, int(experts[p]), 4
    delta_w = lora.bt[s, torch.arange(r, device=DEVICE) * E + e].T @ lora.a[s, e * r:(e + 1) * r]  # [out, in]
    torch.testing.assert_close(want[p], y0[p] + float(lora.scales[s]) * (delta_w @ x[p // rows_div]),
                               rtol=1e-4, atol=1e-4)
