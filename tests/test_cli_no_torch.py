"""`metrale --help` and the CLI's HTTP commands (`adapters ...`, `peer list`) import no
torch and no engine module: they answer in a fraction of a second, also to say that the
server is not there. Checked in a fresh interpreter with `-X importtime`, which lists
every module imported, however indirectly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# torch itself, and metrale's modules that exist to run it
FORBIDDEN = ("torch", "transformers", "metrale.engine", "metrale.pool", "metrale.model.llama",
             "metrale.ops", "metrale.peer.exporter")


def _dead_url() -> str:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _imports(*argv: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "metrale", *argv],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    modules = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")]
    return proc, modules


def _forbidden(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


def test_importtime_parsing_sees_torch():
    """The check below can fail: the same parsing does find torch where it is imported."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import metrale.dtypes"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    modules = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")]
    assert "torch" in _forbidden(modules)


@pytest.mark.parametrize("argv", [
    ("--help",),
    ("serve", "--help"),
    ("adapters", "--help"),
    ("adapters", "list", "--url", "DEAD"),
    ("adapters", "load", "x", "y", "--url", "DEAD"),
    ("adapters", "unload", "org/x", "--url", "DEAD"),
    ("peer", "list", "--url", "DEAD"),
])
def test_http_commands_and_help_import_no_torch(argv):
    argv = tuple(_dead_url() if a == "DEAD" else a for a in argv)
    proc, modules = _imports(*argv)
    assert "metrale.cli" in modules, proc.stderr[-2000:]
    assert not _forbidden(modules), f"{' '.join(argv)} imported {_forbidden(modules)[:10]}"
    if "--help" in argv:
        assert proc.returncode == 0 and "usage: metrale" in proc.stdout
    else:  # refused at once, in one line naming the address, no traceback
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines()
                  if not line.startswith("import time:")]
        assert len(errors) == 1 and errors[0].startswith("metrale: error:"), errors
        assert argv[-1].split("//")[1] in errors[0]
