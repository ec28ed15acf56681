"""The Triton shim the kernel files import (without the optional `metrale[triton]` extra, a
stand-in: the modules import, calling a kernel raises) and their shared launch helpers. On
CPU, kernels run in Triton's interpreter, on only if TRITON_INTERPRET=1 was set before
triton was first imported (tests/conftest.py does).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: importing works, calling raises

    class _MissingTriton:
        @staticmethod
        def constexpr(value=None):  # signatures annotate with it; module constants wrap in it
            return value

    triton, tl = None, _MissingTriton()

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # no triton, or one that moved it: then nothing counts as interpreted
    InterpretedFunction = None

_JITTED: dict = {}


def require_triton() -> None:
    if triton is None:
        raise RuntimeError(
            "metrale's Triton kernels (metrale.ops.*_triton) need the 'triton' package "
            "(pip install 'metrale[triton]'); without it use the torch paths, e.g. metrale.ops.lora_ref"
        )


def jit_kernel(fn, device: torch.device, unaligned: tuple[str, ...] = ()):
    """fn jitted on first use, so that importing a kernel module compiles nothing. CPU
    tensors need the interpreter, and it cannot be switched on once triton is imported.
    unaligned: pointer parameters not specialized on 16-byte alignment: those a caller
    passes as views at offsets that change from step to step (Triton would compile a
    variant, a stall of ~0.3-1 s, for each new mix of alignments it meets while serving).
    Every call site of one kernel passes the same `unaligned`."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"Triton kernel {fn.__name__} got CPU tensors: set TRITON_INTERPRET=1 "
                           "before importing triton, or use the torch reference ops on CPU")
    if fn not in _JITTED:
        _JITTED[fn] = (triton.jit(fn, do_not_specialize_on_alignment=list(unaligned)), unaligned)
    kernel, jitted_unaligned = _JITTED[fn]
    if jitted_unaligned != unaligned:
        raise ValueError(f"{fn.__name__} was jitted with unaligned={jitted_unaligned}, "
                         f"not {unaligned}")
    return kernel


def device_function(fn):
    """fn as a Triton device function, jitted when defined (unlike kernels): a calling kernel's
    compiler takes it from the module's globals and accepts only a jitted function."""
    return fn if triton is None else triton.jit(fn)


def is_interpreted(kernel) -> bool:
    """Whether a jit_kernel result runs in the CPU interpreter (whose tl.dot differs)."""
    return InterpretedFunction is not None and isinstance(kernel, InterpretedFunction)


def storage_base(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view over t's whole storage: the pointer descriptor offsets are relative to."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


def shares_storage(ts, dtype: torch.dtype) -> bool:
    ptr = ts[0].untyped_storage().data_ptr()
    return all(t.dtype == dtype and t.untyped_storage().data_ptr() == ptr for t in ts)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()
