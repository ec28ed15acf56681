"""bench/kernel_sass.py: the loop histogram on hand-written SASS, and the 4-bit GEMM compiled
for sm_90 on this CPU-only machine (Triton's wheel carries ptxas and nvdisasm)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import kernel_sass
from metrale.ops import triton_utils

ROOT = Path(__file__).resolve().parents[1]

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LOP3.LUT R2, R3, 0xf000f, RZ, 0xc0, !PT ;
        /*0020*/              @!P0 LDG.E R4, desc[UR4][R6.64] ;
        /*0030*/                   HGMMA.64x16x16.F32.BF16 R8, R2, gdesc[UR4], R8 ;
.L_x_1:
        /*0040*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
        /*0060*/               @P0 BRA `(.L_x_0) ;
        /*0070*/                   EXIT ;
"""


def test_the_widest_backward_branch_is_the_loop():
    hist = kernel_sass.loop_histogram(SASS)
    assert hist == {"LOP3": 1, "LDG": 1, "HGMMA": 1, "IADD3": 1, "BRA": 2}
    assert kernel_sass.loop_histogram("        /*0000*/ EXIT ;") == {}


@pytest.mark.skipif(triton_utils.triton is None, reason="triton is not installed")
def test_the_4bit_gemm_feeds_its_pairs_to_the_mma_from_registers():
    """The zero-point loop: wgmma with the pair op, and no trip through shared memory for the
    unpacked operand (16 STS and 17 barriers a chunk when Triton cannot keep it in the MMA's
    register layout, as with the NF4 tables)."""
    hist = _loop_histogram("int4-awq")
    assert hist["HGMMA"] == 16 and hist["LOP3"] >= 64
    assert "STS" not in hist


@pytest.mark.skipif(triton_utils.triton is None, reason="triton is not installed")
def test_the_dynamic_fp8_gemm_multiplies_fp8_codes_on_the_tensor_cores():
    """The dynamic mode's loop issues FP8 wgmma (QGMMA) on the codes as loaded: no bf16 MMA,
    no conversion of the weight (the weight-only mode's cost, session 22)."""
    hist = _loop_histogram("fp8-dynamic", "--block-m", "32", "--split", "1", "--stages", "3")
    assert hist["QGMMA"] == 16 and "HGMMA" not in hist and "F2FP" not in hist


def _loop_histogram(*args: str) -> dict[str, int]:
    """kernel_sass.py's opcode counts, run in a process of its own: the suite runs Triton's
    interpreter, which compiles nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_sass.py"), *args],
                         capture_output=True, text=True, env=env, timeout=600, check=True).stdout
    return dict((op, int(n)) for op, n in (item.split(":") for item in
                                           out.strip().splitlines()[-1].split()))
