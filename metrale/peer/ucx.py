"""The UCX settings metrale gives NIXL, and the transport UCX reports it chose.

Measured on one H200 (bench/peer_nvlink.py, an 8B r16 slot of 86.6 MB between two
processes): UCX turns CUDA IPC GET off when it finds no NVLink, and NIXL's READ then
runs as a "software emulation" over TCP loopback, 212 ms, against 0.85 ms with GET on.
A value already in the environment wins. Unless the user routes UCX's log, metrale asks
UCX_PROTO_INFO for the remote-read table only, in a log file of this process (UcxLog).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("metrale.peer")

DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
# the operation NIXL's READ runs: "remote memory read by ucp_get*(multi) into cuda/GPU0 from ..."
READ_OPERATION = "remote memory read by"
# transports that move GPU memory without a bounce through host memory
GPU_DIRECT = ("cuda_ipc", "rc", "dc", "ud", "gga", "srd")
_ROW = re.compile(r"\|\s*([0-9]+(?:\.\.(?:[0-9]+|inf))?)\s*\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|")
_LEVEL = re.compile(r"\bUCX\s+(WARN|ERROR)\b")


@dataclass(frozen=True)
class Transport:
    """What UCX chose for a peer's READ of its largest sizes, as UCX names it."""

    name: str  # e.g. "cuda_ipc", "rc_mlx5", "tcp", "cma"
    config: str  # UCX's lane text, e.g. "cuda_ipc/cuda"
    description: str  # e.g. "zero-copy", "software emulation"
    into_gpu: bool

    @property
    def slow(self) -> bool:
        """Emulated, or GPU memory bounced through the host."""
        return "emulation" in self.description or (
            self.into_gpu and not self.name.startswith(GPU_DIRECT))

    def advice(self) -> str:
        setting = os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        if setting.lower() not in ("y", "yes", "on", "1"):
            fix = f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (it is set to {setting!r})"
        else:
            fix = "UCX_TLS to include cuda_ipc (same host) or an RDMA device (across hosts)"
        return f"NIXL READ runs over {self.config} ({self.description}); set {fix}"


_libc = ctypes.CDLL(None)
_LOG_DIR = "METRALE_UCX_LOG_DIR"  # set with UCX_LOG_FILE, so a child process knows it is ours
_log: UcxLog | None = None


def configure_ucx(gpu: bool = True) -> UcxLog:
    """Apply DEFAULTS (on a GPU host: elsewhere UCX warns that they are unused) and the
    report settings the user did not set, once, before UCX loads; return this process's
    UCX log, which has no file when the user routes UCX's log or its protocol report."""
    global _log
    if _log is not None:
        return _log
    for key, value in DEFAULTS.items() if gpu else ():
        os.environ.setdefault(key, value)
    folder = os.environ.get(_LOG_DIR)
    ours = folder is not None and os.environ.get("UCX_LOG_FILE") == f"{folder}/ucx.%p.log"
    if not ours and "UCX_PROTO_INFO" not in os.environ and "UCX_LOG_FILE" not in os.environ:
        folder, ours = tempfile.mkdtemp(prefix="metrale-ucx-"), True
        os.environ.update({_LOG_DIR: folder, "UCX_PROTO_INFO": f"*{READ_OPERATION}*",
                           "UCX_LOG_FILE": f"{folder}/ucx.%p.log"})  # %p: each process its own
    _log = UcxLog(Path(folder) / f"ucx.{os.getpid()}.log" if ours else None)
    return _log


class UcxLog:
    """This process's UCX log file: tables of the protocols UCX chose, its warnings."""

    def __init__(self, path: Path | None) -> None:
        self.path, self._seen = path, 0

    def read_transport(self, agent: str) -> Transport | None:
        """The transport of the last remote-read table UCX printed for worker `agent`;
        UCX's warnings and errors written since the last call go to metrale's log."""
        if self.path is None:
            return None
        _libc.fflush(None)  # UCX writes its log through a buffered C stream
        try:
            lines = self.path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return None
        for line in lines[self._seen:]:
            if _LEVEL.search(line):
                log.warning("ucx: %s", line.strip())
        self._seen = len(lines)
        return last_read_transport(lines, agent)


def last_read_transport(lines: list[str], agent: str) -> Transport | None:
    """Parse UCX_PROTO_INFO's tables: a title naming the worker (`agent`) and the
    operation, then rows "| range | description | lanes |"; the row reaching the
    largest sizes names the transport."""
    found, owner, previous, into_gpu, rows = None, "", "", False, None
    for line in [*lines, ""]:
        row = _ROW.search(line)
        if READ_OPERATION in line:  # the line above it names the worker
            owner, into_gpu, rows = previous, " into cuda" in line, []
        elif rows is not None and row:
            rows.append(row.groups())
        elif rows:  # the first line after the table's rows
            if agent in owner:
                _, description, config = rows[-1]
                found = Transport(config.split("/", 1)[0], config, description, into_gpu)
            rows = None
        previous = line
    return found
