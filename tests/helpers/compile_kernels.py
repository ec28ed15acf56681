"""Compile Triton kernels for sm_90 on a machine without a GPU (triton's bundled ptxas), in a
process of its own: the interpreter the CPU tests switch on cannot be switched off in theirs.
`python -m tests.helpers.compile_kernels` exits 1 naming the first kernel that fails."""

from __future__ import annotations

import inspect
import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1: interpreted kernels do not compile")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from metrale.ops import fused_triton, moe_triton  # noqa: E402


def compile_sm90(kernel, pointers: dict[str, str], constexprs: dict, num_warps: int = 4,
                 num_stages: int = 4) -> None:
    """kernel's cubin, other arguments i32 divisible by 16 (as launches specialize them)."""
    names = list(inspect.signature(kernel).parameters)
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constexprs}
    src = ASTSource(triton.jit(kernel), signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=num_warps, num_stages=num_stages))


GEMM_POINTERS = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", pairs_ptr="*i32",
                     block_expert_ptr="*i32", used_ptr="*i32", h_ptr="*fp32", bt_ptr="*bf16",
                     slot_ptr="*i64", rank_ptr="*i32", scale_ptr="*fp32")


def cases():
    """(kernel, pointer types, constexprs, num_warps): the configurations the engine launches
    (MoE decode blocks of 16 rows and prefill blocks of 64, bf16 and fp32 dots)."""
    for lora, block_m, rows_div, f32 in ((False, 16, 8, False), (True, 16, 8, False),
                                         (True, 64, 1, False), (True, 16, 1, True)):
        block_n, block_k = (64, 32) if f32 else (128, 128)
        yield (moe_triton._grouped_gemm_kernel, GEMM_POINTERS,
               dict(ROWS_DIV=rows_div, TOP_K=8, F32_DOT=f32, LORA=lora, R=16, SPLIT=2,
                    BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k), 4)
    yield (moe_triton._expert_shrink_kernel,
           dict(x_ptr="*bf16", a_ptr="*bf16", h_ptr="*fp32", slot_ptr="*i64", expert_ptr="*i64",
                rank_ptr="*i32"), dict(TOP_K=8, ROWS_DIV=8, R=16, BLOCK_K=256), 8)
    for gelu in (False, True):
        yield (fused_triton._act_mul_kernel, dict(g_ptr="*bf16", y_ptr="*bf16"),
               dict(GELU=gelu, RNE_BITS=False, BLOCK=1024), 4)


def main() -> int:
    for kernel, pointers, constexprs, warps in cases():
        try:
            compile_sm90(kernel, pointers, constexprs, warps)
        except Exception as e:  # the compiler's message names the line
            print(f"{kernel.__name__} {constexprs}: {e}")
            return 1
        print(f"compiled {kernel.__name__} {constexprs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
