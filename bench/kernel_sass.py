"""A Triton kernel's machine code without a GPU: compile it for sm_90 with the installed Triton
(its wheel carries ptxas and nvdisasm) and count its innermost loop's instructions by opcode.

    PYTHONPATH=. python bench/kernel_sass.py int4-awq [--block-m 16 --block-n 64 --split 2]
    PYTHONPATH=. python bench/kernel_sass.py int4-nf4 --out /tmp/nf4   # also .ttgir/.ptx/.sass
    PYTHONPATH=. python bench/kernel_sass.py fp8-dynamic --block-m 32 --split 1 --stages 3

How session 26 found the 4-bit GEMM issue-bound (801 instructions a 256-column chunk, ~6 a
weight, against a byte floor the H200 streams in far fewer cycles) before spending device
time. The device runs its own Triton: for its exact code install that version apart
(pip install --no-deps --target DIR triton==X) and put DIR first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_INT4_SIG = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", z_ptr="*u8", c_ptr="*fp32",
                 b_ptr="*bf16", y_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32", M="i32",
                 N="i32", K="i32", KW="i32", G="i32", x_st="i32", y_st="i32")


@dataclass(frozen=True)
class Preset:
    module: str
    kernel: str
    signature: dict
    constexprs: dict


PRESETS = {
    "int4-awq": Preset("metrale.ops.int4_linear", "_int4_gemm_kernel", _INT4_SIG, dict(
        GROUP=128, HAS_ZERO=True, HAS_CODES=False, HAS_BIAS=False, FLUSH=4, EVEN=True,
        PAIR_BIAS=128, IEEE=False)),
    "int4-nf4": Preset("metrale.ops.int4_linear", "_int4_gemm_kernel",
                       {**_INT4_SIG, "s_ptr": "*fp32", "z_ptr": "*fp32"}, dict(
        GROUP=64, HAS_ZERO=False, HAS_CODES=True, HAS_BIAS=False, FLUSH=2, EVEN=True,
        PAIR_BIAS=128, IEEE=False)),
    "fp8-dynamic": Preset("metrale.ops.fp8_linear", "_fp8_gemm_kernel", dict(
        x_ptr="*fp8e4nv", w_ptr="*fp8e4nv", s_ptr="*fp32", xs_ptr="*fp32", b_ptr="*bf16",
        y_ptr="*bf16", ws_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32", K="i32", x_st="i32",
        y_st="i32", s_st="i32", xs_st="i32", SO="i32", SI="i32"), dict(
        FP8_X=True, X_BLOCK=512, PER_ROW=True, HAS_BIAS=False, EVEN_K=True, SWAP=True,
        IEEE=False, BLOCK_K=512)),
}


def compile_sm90(preset: Preset, block_m: int, block_n: int, split: int, warps: int,
                 stages: int):
    """The compiled kernel (Triton's CompiledKernel) for sm_90, with the divisibility the
    launcher gives 16-aligned pointers and sizes (without it the code is not what runs)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(preset.module), preset.kernel)
    jitted = fn if isinstance(fn, triton.runtime.JITFunction) else triton.jit(fn)
    consts = {**preset.constexprs, "SPLIT_K": split, "BLOCK_M": block_m, "BLOCK_N": block_n}
    names = jitted.arg_names
    signature = {a: "constexpr" if a in consts else preset.signature[a] for a in names}
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a, t in preset.signature.items()
               if a != "M"}  # the token count is whatever the step has
    src = ASTSource(jitted, signature, {(names.index(k),): v for k, v in consts.items()},
                    attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def disassemble(cubin: bytes, workdir: Path) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    path = workdir / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([str(tool), "-c", str(path)], capture_output=True, text=True,
                          check=True).stdout


def loop_histogram(sass: str) -> collections.Counter:
    """Opcodes of the widest backward branch's body (the main loop), predicates dropped."""
    labels, pending, code = {}, None, []
    for line in sass.splitlines():
        if m := re.match(r"^(\.L_x_\d+):", line):
            pending = m.group(1)
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);", line):
            address = int(m.group(1), 16)
            code.append((address, m.group(2)))
            if pending:
                labels[pending], pending = address, None
    spans = [(labels[m.group(1)], address) for address, text in code
             if (m := re.search(r"BRA\s+`\((\.L_x_\d+)\)", text))
             and labels.get(m.group(1), address + 1) < address]
    if not spans:
        return collections.Counter()
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    ops = (re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
           for address, text in code if lo <= address <= hi)
    return collections.Counter(ops)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("--block-m", type=int, default=16)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--split", type=int, default=2)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="also write k.ttgir, k.ptx, k.sass")
    args = p.parse_args()
    import tempfile

    import triton

    kernel = compile_sm90(PRESETS[args.preset], args.block_m, args.block_n, args.split,
                          args.warps, args.stages)
    with tempfile.TemporaryDirectory() as tmp:
        sass = disassemble(kernel.asm["cubin"], Path(tmp))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            (args.out / f"k.{ext}").write_text(kernel.asm[ext])
        (args.out / "k.sass").write_text(sass)
    hist = loop_histogram(sass)
    uniform = sum(n for op, n in hist.items() if op.startswith("U"))
    print(f"{args.preset} (triton {triton.__version__}, sm_90, {args.block_m}x{args.block_n}, "
          f"split {args.split}, {args.warps} warps, {args.stages} stages): shared "
          f"{kernel.metadata.shared} B; loop {sum(hist.values())} instructions "
          f"({uniform} uniform)")
    print(" ".join(f"{op}:{n}" for op, n in hist.most_common()))


if __name__ == "__main__":
    main()
