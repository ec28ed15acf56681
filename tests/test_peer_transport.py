"""Which transport carries a NIXL landing is read from UCX's own report, not assumed:
the parser against tables UCX printed (tests/data/ucx: an H200 with CUDA IPC GET off,
the same with it on, this CPU machine's DRAM reads), the settings a user gave win over
metrale's, and a real NIXL landing on the CPU records what UCX chose."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from metrale.peer import ucx
from metrale.peer.nixl_shim import nixl_available

DATA = Path(__file__).parent / "data" / "ucx"


def lines_of(name: str) -> tuple[list[str], str]:
    text = (DATA / name).read_text()
    return text.splitlines(), re.search(r"metrale-\d+-[0-9a-f]+", text).group(0)


def test_get_off_on_one_gpu_reads_as_emulated_tcp():
    lines, agent = lines_of("h200_default_get_off.log")
    transport = ucx.last_read_transport(lines, agent)
    assert (transport.name, transport.config) == ("tcp", "tcp/lo")
    assert transport.description == "software emulation" and transport.into_gpu and transport.slow


def test_get_on_reads_as_cuda_ipc_zero_copy():
    lines, agent = lines_of("h200_get_zcopy_on.log")
    transport = ucx.last_read_transport(lines, agent)
    assert (transport.name, transport.description) == ("cuda_ipc", "zero-copy")
    assert not transport.slow


def test_a_table_of_another_worker_is_not_ours():
    lines, agent = lines_of("cpu_dram.log")
    assert ucx.last_read_transport(lines, agent).config == "cma/memory"
    assert ucx.last_read_transport(lines, "metrale-1-000000000000") is None


def test_host_bounce_into_gpu_is_slow_and_advice_names_the_setting(monkeypatch):
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
    bounced = ucx.Transport("tcp", "tcp/lo", "multi-frag copy-in", into_gpu=True)
    assert bounced.slow and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (it is set to 'n')" in bounced.advice()
    assert not ucx.Transport("rc_mlx5", "rc_mlx5/mlx5_0:1", "zero-copy", into_gpu=True).slow
    assert not ucx.Transport("tcp", "tcp/eth0", "zero-copy", into_gpu=False).slow


@pytest.fixture
def fresh_ucx(monkeypatch):
    """configure_ucx as in a new process, with the environment restored afterwards."""
    for key in (*ucx.DEFAULTS, "UCX_PROTO_INFO", "UCX_LOG_FILE", "METRALE_UCX_LOG_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(ucx, "_log", None)
    yield
    monkeypatch.setattr(ucx, "_log", None)


def test_defaults_applied_and_report_routed_to_a_file_of_ours(fresh_ucx):
    log = ucx.configure_ucx(gpu=True)
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    assert os.environ["UCX_PROTO_INFO"] == "*remote memory read by*"
    assert log.path.name == f"ucx.{os.getpid()}.log"
    assert os.environ["UCX_LOG_FILE"] == f"{log.path.parent}/ucx.%p.log"
    assert ucx.configure_ucx() is log


def test_without_a_gpu_no_cuda_setting_is_made(fresh_ucx):
    ucx.configure_ucx(gpu=False)  # UCX would warn that it is unused
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ


def test_settings_the_user_gave_win(fresh_ucx, monkeypatch):
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
    monkeypatch.setenv("UCX_LOG_FILE", "/tmp/mine.log")
    log = ucx.configure_ucx()
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "n"
    assert os.environ["UCX_LOG_FILE"] == "/tmp/mine.log" and "UCX_PROTO_INFO" not in os.environ
    assert log.path is None and log.read_transport("metrale-1-x") is None


def test_ucx_warnings_in_its_file_reach_our_log(tmp_path, caplog):
    path = tmp_path / "ucx.1.log"
    path.write_text("[1.0] [vm:1:0] parser.c:2 UCX  WARN  unused environment variable: UCX_X\n")
    with caplog.at_level(logging.WARNING, logger="metrale.peer"):
        ucx.UcxLog(path).read_transport("metrale-1-x")
    assert "unused environment variable" in caplog.text


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
def test_a_real_nixl_landing_records_what_ucx_chose(caplog):
    from metrale.peer.nixl_transport import endpoint_for, transports_in_use
    from metrale.server.metrics import ServerMetrics
    from tests.helpers.peers import new_slots, start_store, stop
    from tests.helpers.pool import land_peer

    if ucx.configure_ucx().path is None:
        pytest.skip("the UCX report is routed by this environment's own UCX settings")
    proc, url = start_store("--transport", "nixl")
    try:
        slots = new_slots()
        stats: dict = {}
        with caplog.at_level(logging.INFO, logger="metrale.peer"):
            land_peer(slots, url, "a", 0, transport="nixl", timeout_s=20, stats=stats)
        # DRAM to DRAM on one host: UCX reads by cross-memory attach or shared memory
        assert stats["ucx_transport"] in ("cma", "knem", "xpmem", "sysv", "posix", "self")
        [transport] = endpoint_for(slots.pool, slots.pool.buffer).transports()
        assert transport.name == stats["ucx_transport"]
        assert f"go over {transport.config}" in caplog.text
        assert transports_in_use()[transport.config] >= 1
        exposition = ServerMetrics().exposition().decode()
        assert f'metrale_peer_transport{{transport="{transport.config}"}}' in exposition
    finally:
        stop(proc)
