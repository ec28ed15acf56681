"""Whether the Triton kernels can run here: compiled on CUDA, else in Triton's CPU
interpreter, which tests/conftest.py switches on before anything imports triton."""

from __future__ import annotations

import torch

from metrale.ops import triton_utils


def _kernels_runnable() -> bool:
    if triton_utils.triton is None:
        return False
    if torch.cuda.is_available():
        return True
    try:  # the interpreter is active only if triton's own library was jitted under it
        import triton.language.standard as std
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(std.max, InterpretedFunction)


KERNELS = _kernels_runnable()
