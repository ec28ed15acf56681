"""Compile Triton kernels for sm_90 on a machine without a GPU (triton's bundled ptxas), in a
process of its own: the interpreter the CPU tests switch on cannot be switched off in theirs.
`python -m tests.helpers.compile_kernels` exits 1 naming the first kernel that fails."""

from __future__ import annotations

import inspect
import os
import sys

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from metrale.ops import (  # noqa: E402
    attention_triton,
    fused_triton,
    landing_triton,
    lora_kernels,
    moe_triton,
    norms_triton,
)


def compile_sm90(kernel, types: dict[str, str], constexprs: dict, num_warps: int = 4,
                 num_stages: int = 4) -> None:
    """kernel's cubin; arguments not in types nor constexprs are i32, all divisible by 16
    (as launches specialize them)."""
    names = list(inspect.signature(kernel).parameters)
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constexprs}
    src = ASTSource(triton.jit(kernel), signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=num_warps, num_stages=num_stages))


GEMM_POINTERS = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", pairs_ptr="*i32",
                     block_expert_ptr="*i32", used_ptr="*i32", h_ptr="*fp32", bt_ptr="*bf16",
                     slot_ptr="*i64", rank_ptr="*i32", scale_ptr="*fp32")


def cases():
    """(kernel, argument types, constexprs, num_warps): configurations the engine launches
    in bf16 on a GPU (decode and prefill shapes; fp32 dots where a path has them)."""
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
    yield (moe_triton._route_kernel,
           dict(experts_ptr="*i64", experts32_ptr="*i32", counts_ptr="*i32", pairs_ptr="*i32",
                block_expert_ptr="*i32", used_ptr="*i32"),
           dict(BLOCK_M=16, BLOCK_E=128, BLOCK_P=64), 8)
    lora = dict(x_ptr="*bf16", y_ptr="*bf16", pool_ptr="*bf16", h_ptr="*fp32", slot_ptr="*i32",
                order_ptr="*i64", desc_ptr="*i64", rank_ptr="*i32", scale_ptr="*fp32",
                dora_ptr="*i32", gain_ptr="*fp32", bias_ptr="*bf16")
    for sorted_, block_t in ((False, 1), (True, 32)):  # decode rows, prefill slot runs
        yield (lora_kernels.shrink_kernel, lora,
               dict(ATOMIC=not sorted_, SORTED=sorted_, F32_DOT=False, ALIGN=8,
                    BLOCK_T=block_t, BLOCK_K=256 if block_t == 1 else 128, BLOCK_R=16), 4)
        yield (lora_kernels.expand_kernel, lora,
               dict(SORTED=sorted_, F32_DOT=False, ALIGN=8, HAS_BIAS=sorted_, BLOCK_T=block_t,
                    BLOCK_N=128 if block_t == 1 else 256, BLOCK_R=16), 4)
    attention = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", tab_ptr="*i32",
                     ctx_ptr="*i32", cu_ptr="*i32", tile_ptr="*i32", o_ptr="*bf16",
                     ml_ptr="*fp32", acc_ptr="*fp32", pos_ptr="*i64", scale="fp32",
                     softcap="fp32")
    for d, gemma in ((128, False), (256, True)):  # Llama; Gemma's soft-cap and window
        flags = dict(F32_DOT=False, SOFTCAP=gemma, WINDOW=gemma)
        yield (attention_triton._decode_kernel, attention,
               dict(G=4, G_PAD=16, D=d, D_PAD=d, BLOCK_SIZE=16, BLOCK_N=64, SPLIT=True,
                    **flags), 4)
        yield (attention_triton._prefill_kernel, attention,
               dict(G=4, G_PAD=4, D=d, D_PAD=d, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_N=64,
                    SPLIT_KEYS=512, SPLIT=True, **flags), 4)
        yield (attention_triton._merge_kernel, attention,
               dict(D=d, D_PAD=d, S_PAD=8, SPLIT_KEYS=512, VARLEN=True), 2)
    yield (fused_triton._rmsnorm_kernel,
           dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", s_ptr="*bf16",
                eps="fp32"), dict(ADD=True, RNE_BITS=False, BLOCK=4096), 8)
    yield (fused_triton._rotary_kernel,
           dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", qo_ptr="*bf16", ko_ptr="*bf16",
                vo_ptr="*bf16", pos_ptr="*i64", slot_ptr="*i64", cos_ptr="*fp32",
                sin_ptr="*fp32"), dict(HALF=64, BLOCK_H=16, STORE=True), 4)
    yield (landing_triton._land_kernel, dict(src_ptr="*bf16", dst_ptr="*bf16", desc_ptr="*i64"),
           dict(BLOCK=landing_triton.BLOCK), 4)
    yield (norms_triton._region_norms_kernel,
           dict(buf_ptr="*bf16", desc_ptr="*i64", out_ptr="*fp32", n_regions="i32"),
           dict(BLOCK_R=norms_triton.BLOCK_R, BLOCK_C=norms_triton.BLOCK_C), 4)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET=1: interpreted kernels do not compile")
        return 1
    for kernel, types, constexprs, warps in cases():
        try:
            compile_sm90(kernel, types, constexprs, warps)
        except Exception as e:  # the compiler's message names the line
            print(f"{kernel.__name__} {constexprs}: {e}")
            return 1
        print(f"compiled {kernel.__name__} {constexprs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
