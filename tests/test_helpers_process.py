"""The helpers that start processes for the tests say why one did not start: a server
that exits carries its own message and exit code, a process that dies is reported the
moment it dies (not at the bound), a hung one is stopped at a bound that the machine's
load stretches, and the error names what was awaited and for how long."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from tests.helpers import process
from tests.helpers.peers import wait_for_line
from tests.helpers.process import Bound, ProcessStartError, load_stretch, wait_ready
from tests.helpers.server import ServerProcess

# Far beyond anything these tests take: a helper that waited for its bound instead of the
# process's exit would hold the test this long, so the checks below bound the wait for
# the report at a small fraction of it.
NEVER_S = 3600.0
REPORT_S = 300.0


def _report(wait) -> BaseException:
    """What wait() raises, run in a thread so that a helper waiting for its bound fails
    this test at REPORT_S instead of hanging it."""
    raised: list[BaseException] = []
    done = threading.Event()

    def run():
        try:
            wait()
        except BaseException as e:  # noqa: BLE001 - handed to the test as is
            raised.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(REPORT_S), "the process's exit was not reported before the bound"
    assert raised, "the wait returned although the process never became ready"
    return raised[0]


def _python(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, **kw)


def test_server_on_a_missing_model_reports_its_own_message_and_exit_code(tmp_path):
    with pytest.raises(ProcessStartError) as info:
        ServerProcess(["--model", str(tmp_path / "none")], tmp_path / "server.log")
    err = info.value
    assert err.returncode not in (None, 0)  # it exited: not the bound
    assert f"exit code {err.returncode}" in str(err)
    assert "config.json not found" in str(err)
    assert "/health" in str(err)  # what it waited for


def test_a_process_that_exits_at_once_is_reported_at_once(tmp_path):
    proc = _python("print('the reason it cannot start'); raise SystemExit(3)")
    try:
        err = _report(lambda: wait_ready(proc, "doomed", "never", lambda: False,
                                         lambda: proc.stdout.read().decode(), NEVER_S))
    finally:
        process.stop(proc)
    assert isinstance(err, ProcessStartError) and err.returncode == 3
    assert "exit code 3" in str(err) and "the reason it cannot start" in str(err)


def test_a_line_waiter_reports_an_exit_at_once():
    proc = _python("print('loading'); print('cannot bind', flush=True); raise SystemExit(4)")
    try:
        err = _report(lambda: wait_for_line(proc, "serving", NEVER_S))
    finally:
        process.stop(proc)
    assert isinstance(err, ProcessStartError) and err.returncode == 4
    assert "exit code 4" in str(err) and "'serving'" in str(err)
    assert "loading\ncannot bind" in str(err)


@pytest.mark.parametrize("waiter", ["probe", "line"])
def test_a_hung_process_is_stopped_at_the_bound_with_what_it_waited_for(waiter):
    # blocks on its stdin, which nobody writes: alive and never ready
    proc = _python("import sys; print('starting', flush=True); sys.stdin.read()",
                   stdin=subprocess.PIPE)
    seen = []

    def output() -> str:
        seen.append(proc.stdout.readline().decode())  # the one line it prints
        return "".join(seen)

    try:
        with pytest.raises(ProcessStartError) as info:
            if waiter == "probe":
                wait_ready(proc, "hung", "a sign of life", lambda: False, output, 0.5)
            else:
                wait_for_line(proc, "a sign of life", 0.5)
        assert proc.poll() is not None  # stopped: it must not outlive the wait
    finally:
        process.stop(proc)
    err = info.value
    assert err.returncode is None
    assert "not ready: waited" in str(err) and "a sign of life" in str(err)
    assert "starting" in str(err)


def test_the_bound_stretches_with_the_load_and_never_shrinks(monkeypatch):
    load = [8.0]
    monkeypatch.setattr(process.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(process.os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    assert load_stretch() == 4.0  # 8 runnable on 2 cores
    bound = Bound(10.0)
    bound.start -= 30.0  # 30 s into the wait: past 10 s idle, within 10 s x 4
    assert not bound.expired()
    load[0] = 0.5  # the load fell: what was stretched stays stretched
    assert load_stretch() == 1.0 and not bound.expired()
    bound.start -= 20.0  # 50 s > 40 s
    assert bound.expired()
    assert "x4.0" in bound.describe()
    load[0] = 1000.0  # a hang still ends on a box that busy
    assert load_stretch() == process.MAX_STRETCH
