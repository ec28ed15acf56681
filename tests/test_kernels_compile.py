"""The Triton kernels compile for an H100/H200 (sm_90) here, without a GPU: the interpreter
the other CPU tests use accepts code the compiler refuses (a string variable passed as
input_precision did, in session 19), which otherwise surfaces only on the device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from tests.helpers import compile_kernels  # noqa: E402

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not _PTXAS.exists(), reason="triton without its bundled ptxas")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.helpers.compile_kernels"], env=env,
                         capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("compiled ") == len(list(compile_kernels.cases()))
