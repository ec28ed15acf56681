"""DoRA's epilogue and the embedding LoRA, op by op: the torch reference and the Triton
kernels (Triton's interpreter on CPU) against a float64 per-token oracle written from the
formulas, and the pool's chunked gain computation against PEFT's own DoraLinearLayer."""

from __future__ import annotations

import pytest
import torch

from metrale.config import ModelConfig, PoolConfig
from metrale.ops import lora_ref as ref
from metrale.ops import lora_triton as lt
from metrale.pool import landing
from metrale.pool.layout import SlotLayout
from metrale.pool.pool import AdapterPool
from tests.helpers.kernels import KERNELS
from tests.helpers.tiny_models import hf_config

needs_kernels = pytest.mark.skipif(not KERNELS, reason="needs triton on CUDA or its interpreter")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
S, R = 4, 8


def _case(dims, seed=0, T=9, bias=True, dev="cpu"):
    """Random fused modules over one storage: per module A [S,R,in], Bt [S,R,out], ranks,
    scales, DoRA flags and gains; tokens over slots -1..S-1."""
    g = torch.Generator().manual_seed(seed)
    d_in = dims[0][0]
    slot_elems = sum(R * (i + o) for i, o in dims)
    storage = torch.zeros(S * slot_elems, device=dev)  # one storage: the kernels need that
    As, Bts, off = [], [], 0
    for i, o in dims:
        As.append(storage.as_strided((S, R, i), (slot_elems, i, 1), off))
        Bts.append(storage.as_strided((S, R, o), (slot_elems, o, 1), off + R * i))
        off += R * (i + o)
    ranks = torch.tensor([[4, 0, 8, 3], [2, 5, 8, 0]][:len(dims)], dtype=torch.int32)  # [M, S]
    for m, (i, o) in enumerate(dims):
        pad = torch.arange(R)[None, :, None] >= ranks[m][:, None, None]
        As[m].copy_((torch.randn(S, R, i, generator=g) / i**0.5).masked_fill(pad, 0))
        Bts[m].copy_(torch.randn(S, R, o, generator=g).masked_fill(pad, 0))
    cpu = dict(As=[a.cpu() for a in As], Bts=[b.cpu() for b in Bts])
    scales = torch.rand(len(dims), S, generator=g) + 0.5  # [M, S]
    doras = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 0]][:len(dims)], dtype=torch.int32)  # [M, S]
    gains = [torch.rand(S, o, generator=g) + 0.5 for _, o in dims]  # each [S, out]
    x = torch.randn(T, d_in, generator=g)
    slot_ids = torch.randint(-1, S, (T,), generator=g)
    slot_ids[:S + 1] = torch.arange(-1, S)  # every slot and the base model at least once
    total = sum(o for _, o in dims)
    b = torch.randn(total, generator=g) if bias else None
    y0 = torch.randn(T, total, generator=g)
    if b is not None:
        y0 = y0 + b  # what F.linear(x, W, b) hands the LoRA ops
    c = dict(ranks=ranks, scales=scales, doras=doras, gains=gains, x=x, slot_ids=slot_ids,
             bias=b, y0=y0)
    on_dev = {k: (v if v is None else [t.to(dev) for t in v] if isinstance(v, list)
                  else v.to(dev)) for k, v in c.items()}
    return dict(c, dims=dims, **cpu), dict(on_dev, dims=dims, As=As, Bts=Bts)


def _slices(dims):
    out, col = [], 0
    for _, o in dims:
        out.append(slice(col, col + o))
        col += o
    return out


def _oracle(c):
    """float64, token by token, from the formulas (DoRA: g * (y - b + delta) + b)."""
    y = c["y0"].double().clone()
    for t, s in enumerate(c["slot_ids"].tolist()):
        if s < 0:
            continue
        for m, sl in enumerate(_slices(c["dims"])):
            r = int(c["ranks"][m, s])
            if r == 0:
                continue
            a, bt = c["As"][m][s, :r].double(), c["Bts"][m][s, :r].double()
            delta = float(c["scales"][m, s]) * (c["x"][t].double() @ a.T @ bt)
            if c["doras"][m, s]:
                b = c["bias"][sl].double() if c["bias"] is not None else 0.0
                y[t, sl] = c["gains"][m][s].double() * (y[t, sl] - b + delta) + b
            else:
                y[t, sl] = y[t, sl] + delta
    return y


@pytest.mark.parametrize("bias", [True, False])
def test_reference_dora_epilogue_matches_oracle(bias):
    c, _ = _case([(32, 24), (32, 40)], bias=bias)
    y = c["y0"].clone()
    ref.lora_apply_fused_ref(y, c["x"], c["As"], c["Bts"], _slices(c["dims"]), c["slot_ids"],
                             list(c["scales"]), list(c["ranks"]), doras_list=list(c["doras"]),
                             gains_list=c["gains"], bias=c["bias"])
    torch.testing.assert_close(y.double(), _oracle(c), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("path", lt.PATHS)
@pytest.mark.parametrize("T,prefill", [(9, False), (80, True)])
def test_triton_dora_epilogue_matches_oracle(T, prefill, path):
    """Decode (a program per token) and prefill (slot-sorted blocks) kernels, each path."""
    c, d = _case([(32, 24), (32, 40)], T=T, dev=DEV)
    y = d["y0"].clone()
    order = lt.sort_tokens_by_slot(d["slot_ids"]) if prefill else None
    lt.lora_apply_fused(y, d["x"], d["As"], d["Bts"], _slices(c["dims"]), d["slot_ids"],
                        list(d["scales"]), list(d["ranks"]), order=order,
                        doras_list=list(d["doras"]), gains_list=d["gains"], bias=d["bias"],
                        path=path)
    torch.testing.assert_close(y.cpu().double(), _oracle(c), atol=1e-4, rtol=1e-4)


@needs_kernels
def test_triton_without_dora_tables_is_plain_lora():
    """No DoRA tables given: every slot gets the plain update (flags read as 0)."""
    c, d = _case([(32, 24)], dev=DEV)
    c["doras"] = torch.zeros_like(c["doras"])
    y = d["y0"].clone()
    lt.lora_apply_fused(y, d["x"], d["As"], d["Bts"], _slices(c["dims"]), d["slot_ids"],
                        list(d["scales"]), list(d["ranks"]))
    torch.testing.assert_close(y.cpu().double(), _oracle(c), atol=1e-4, rtol=1e-4)


def _embed_oracle(y0, ids, A, Bt, slot_ids, scales, ranks, doras, gains):
    y = y0.double().clone()
    for t, s in enumerate(slot_ids.tolist()):
        r = int(ranks[s]) if s >= 0 else 0
        if r == 0:
            continue
        h = A[s, :r, ids[t]].double()  # [r]: PEFT's F.embedding(ids, lora_embedding_A.T)
        delta = float(scales[s]) * (h @ Bt[s, :r].double())
        y[t] = gains[s].double() * (y[t] + delta) if doras[s] else y[t] + delta
    return y


@pytest.mark.parametrize("kernel", ["ref", "triton"])
def test_embedding_lora_matches_oracle(kernel):
    if kernel == "triton" and not KERNELS:
        pytest.skip("needs triton on CUDA or its interpreter")
    g = torch.Generator().manual_seed(1)
    V, H, T = 50, 24, 11
    ranks = torch.tensor([3, 0, 8, 5], dtype=torch.int32)
    pad = torch.arange(R)[None, :, None] >= ranks[:, None, None]
    A = torch.randn(S, R, V, generator=g).masked_fill(pad, 0)
    Bt = torch.randn(S, R, H, generator=g).masked_fill(pad, 0)
    scales = torch.rand(S, generator=g) + 0.5
    doras = torch.tensor([1, 0, 0, 1], dtype=torch.int32)
    gains = torch.rand(S, H, generator=g) + 0.5
    ids = torch.randint(0, V, (T,), generator=g)
    slot_ids = torch.tensor([-1, 0, 1, 2, 3, 0, 3, -1, 2, 0, 3])
    y0 = torch.randn(T, H, generator=g)
    want = _embed_oracle(y0, ids, A, Bt, slot_ids, scales, ranks, doras, gains)
    dev = DEV if kernel == "triton" else "cpu"
    args = [t.to(dev) for t in (ids, A, Bt, slot_ids, scales, ranks, doras, gains)]
    y = y0.to(dev).clone()
    if kernel == "ref":
        ref.lora_embed_ref(y, *args)
    else:
        lt.lora_embed(y, *args)
    torch.testing.assert_close(y.cpu().double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1 << 22, 64])
def test_pool_gains_equal_peft_dora_norm(chunk, monkeypatch):
    """compute_gains (chunked over output rows) gives PEFT's m / ||W + s B A|| (its
    DoraLinearLayer.get_weight_norm), for a fused q/k/v slice and a transposed
    (embedding-style) base weight."""
    from peft.tuners.lora.dora import DoraLinearLayer

    monkeypatch.setattr(landing, "GAIN_CHUNK_ELEMS", chunk)  # 64: one row per chunk
    model = ModelConfig.from_hf_dict(hf_config("llama").to_dict())
    layout = SlotLayout(model, PoolConfig(2, 8, ("q_proj", "v_proj"),
                                          extra_targets=("embed_tokens",)), torch.float32)
    g = torch.Generator().manual_seed(2)
    # Parameters, as a model's are: the gains must not drag an autograd graph along (it
    # kept every landing's fp32 copies of W alive: ~W's size in fp32 leaked per landing)
    weights = {k: torch.nn.Parameter(torch.randn(*reversed(model.linear_shape(k[1])), generator=g))
               for k in layout.module_keys}
    weights[(0, "embed_tokens")] = torch.randn(model.vocab_size, model.hidden_size,
                                               generator=g).T  # E^T, a strided view
    pool = AdapterPool(layout, "cpu", weights)
    slot, rank, scale = 1, 5, 0.7
    ranks = torch.zeros(pool.ranks[slot].shape, dtype=torch.int32)
    scales, doras = torch.zeros(ranks.shape), torch.zeros_like(ranks)
    for layer, module in layout.module_keys:
        d_in, d_out = model.linear_shape(module)
        pool.lora_a(layer, module)[slot, :rank] = torch.randn(rank, d_in, generator=g)
        pool.lora_bt(layer, module)[slot, :rank] = torch.randn(rank, d_out, generator=g) * 0.3
        pool.magnitude(layer, module)[slot, 0] = torch.rand(d_out, generator=g) + 0.5
        m = layout.module_index(module)
        ranks[layer, m], scales[layer, m], doras[layer, m] = rank, scale, int(layer != 2)
    landing.write_tables(pool.slot_tensors[slot], layout, weights, ranks, scales, doras)
    assert pool.gains.grad_fn is None and not pool.gains.requires_grad
    for layer, module in layout.module_keys:
        a = pool.lora_a(layer, module)[slot, :rank]
        b = pool.lora_bt(layer, module)[slot, :rank].T  # PEFT's lora_B.weight [out, r]
        norm = DoraLinearLayer(fan_in_fan_out=False).get_weight_norm(
            weights[(layer, module)], b @ a, scale)
        want = pool.magnitude(layer, module)[slot, 0] / norm if layer != 2 else torch.ones(norm.shape)
        torch.testing.assert_close(pool.gain(layer, module)[slot], want, atol=1e-6, rtol=1e-5)
        assert torch.equal(pool.gain(layer, module)[0], torch.ones(norm.shape))  # other slot
    landing.zero_slot(pool.slot_tensors[slot])  # back to plain: gains 1, flags 0
    assert torch.equal(pool.gains[slot], torch.ones_like(pool.gains[slot]))
    assert not pool.doras[slot].any()
