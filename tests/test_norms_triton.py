"""The landing check's one-launch region norms (metrale.ops.norms_triton) against the torch
reference (AdapterPool's per-group norms), in Triton's interpreter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from metrale.ops.norms_triton import KIND_A, KIND_B, KIND_MAX, region_descriptors, region_norms
from metrale.pool.landing import slot_norms
from tests.helpers.peers import adapter_dir, new_slots
from tests.helpers.pool import land_disk

pytest.importorskip("triton")


def _reference(x: torch.Tensor, kind: int) -> float:
    x = x.double()
    if kind == KIND_A:
        return float(x.norm(dim=1).max())
    if kind == KIND_B:
        return float(x.abs().sum(0).max())
    return float(x.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_regions_of_every_shape_and_kind(dtype):
    """Rows and columns past one block (16 x 256), ragged edges, one row, one column."""
    g = torch.Generator().manual_seed(0)
    shapes = [(37, 600, KIND_A), (37, 600, KIND_B), (3, 1000, KIND_MAX), (1, 1, KIND_A),
              (16, 256, KIND_B), (40, 7, KIND_A), (1, 513, KIND_MAX), (21, 300, KIND_B)]
    buffer = torch.zeros(sum(r * c for r, c, _ in shapes) + 100, dtype=dtype)
    rows, offset = [], 50
    for r, c, kind in shapes:
        buffer[offset:offset + r * c] = (torch.randn(r * c, generator=g) * 3).to(dtype)
        rows.append((offset, r, c, kind))
        offset += r * c
    out = region_norms(buffer, region_descriptors(rows, "cpu"))
    assert out.shape == (len(shapes) + 1,) and out[-1] == 0
    for got, (off, r, c, kind) in zip(out[:-1].tolist(), rows):
        want = _reference(buffer[off:off + r * c].reshape(r, c), kind)
        assert got == pytest.approx(want, rel=1e-5), (r, c, kind)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_makes_its_region_nan_and_only_it(value):
    buffer = torch.ones(3 * 40 * 300, dtype=torch.bfloat16)
    rows = [(i * 12000, 40, 300, kind) for i, kind in enumerate((KIND_A, KIND_B, KIND_MAX))]
    for poisoned in range(3):
        x = buffer.clone()
        x[poisoned * 12000 + 39 * 300 + 299] = value  # the last element: a ragged block's edge
        out = region_norms(x, region_descriptors(rows, "cpu"))[:-1].tolist()
        for i, got in enumerate(out):
            assert math.isnan(got) if i == poisoned else math.isfinite(got)


def test_a_pools_kernel_norms_equal_its_torch_norms():
    """A landed pool (adapters of other ranks and targets than the pool's; M regions with
    values): the kernel over the slot's norm descriptors gives what the torch path does, key for key."""
    slots = new_slots(max_loras=3, rank=8)
    for slot, name in enumerate(("a", "b", "c")):
        land_disk(slots, adapter_dir(name), slot)
    pool = slots.pool
    pool.magnitude(1, "o_proj")[2].uniform_(-4, 4)
    for slot in range(3):
        t = pool.slot_tensors[slot]
        want, finite = slot_norms(t)  # the torch reference on a CPU pool
        got = region_norms(t.data, t.norm_desc).numpy().astype(np.float64)
        assert finite and len(got) == len(pool.norm_keys) + 1
        np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_pools_norms_come_from_the_kernel_and_equal_the_views():
    """On CUDA slot_norms runs the kernel (compiled); each key's value equals the
    norm of its region's view, taken in float64."""
    slots = new_slots(max_loras=3, rank=8, dtype=torch.bfloat16, device="cuda")
    for slot, name in enumerate(("a", "b", "c")):
        land_disk(slots, adapter_dir(name), slot)
    pool = slots.pool
    pool.magnitude(1, "o_proj")[2].uniform_(-4, 4)
    views = {"A": pool.lora_a, "B": pool.lora_bt, "M": pool.magnitude}
    for slot in range(3):
        values, finite = slot_norms(pool.slot_tensors[slot])
        assert finite
        for (layer, module, kind), i in pool.norm_keys.items():
            x = views[kind](layer, module)[slot].cpu()
            code = {"A": KIND_A, "B": KIND_B, "M": KIND_MAX}[kind]
            want = _reference(x, KIND_MAX if module == "embed_tokens" and kind == "A" else code)
            assert values[i] == pytest.approx(want, rel=1e-5), (layer, module, kind)
    pool.lora_bt(0, "q_proj")[1, 0, 3] = float("nan")
    assert not slot_norms(pool.slot_tensors[1])[1]
