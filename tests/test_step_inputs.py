"""An eager step's index inputs, uploaded as views of one buffer: each field keeps its
values and shape, and starts 16-byte aligned (Triton compiles a kernel variant for each
mix of pointer alignments it meets: unaligned views of changing offsets stalled serving)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.engine.step_inputs import upload
from metrale.ops.triton_utils import jit_kernel
from tests.helpers.kernels import KERNELS

torch.set_num_threads(1)

sizes = st.lists(st.integers(0, 9), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(sizes=sizes, rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_every_field_keeps_its_values_and_starts_aligned(sizes, rows, seed):
    rng = np.random.default_rng(seed)
    fields = {f"f{i}": rng.integers(-5, 10**6, size=n).tolist() for i, n in enumerate(sizes)}
    fields["table"] = rng.integers(-1, 100, size=(rows, sizes[0] + 1)).tolist()  # rows of ints
    out = upload(torch.device("cpu"), **fields)
    assert list(out) == list(fields)
    for name, value in fields.items():
        t = out[name]
        assert t.dtype == torch.int64
        assert t.tolist() == value, name
        assert t.data_ptr() % 16 == 0, (name, t.storage_offset())


@pytest.mark.skipif(not KERNELS, reason="needs triton or its interpreter")
def test_a_kernel_is_jitted_with_one_alignment_spec():
    """The kernels fed per-step slices skip alignment specialization on those pointers;
    a second call site asking otherwise would silently get the first's kernel: refused."""
    def kernel(x_ptr, y_ptr):  # never launched
        pass

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    first = jit_kernel(kernel, device, unaligned=("y_ptr",))
    assert jit_kernel(kernel, device, unaligned=("y_ptr",)) is first
    with pytest.raises(ValueError, match="unaligned"):
        jit_kernel(kernel, device)
