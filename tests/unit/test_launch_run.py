"""A pipeline's command as a cluster task runs it (cluster/launch.py `_run`): in a session of its
own, so that a run stopped (cancelled by the launcher, which Ray delivers as KeyboardInterrupt,
or timed out) leaves nothing it started running: a pipeline placed again must not have its old
run's workers still training beside the new one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from waiting import HANG_S, wait_until

from jigsaw.cluster.launch import _run

pytestmark = pytest.mark.timeout(60)


def _family(tmp_path) -> list[str]:
    """A command that starts a grandchild and waits, writing both pids to a file."""
    return ["sh", "-c", f"sleep 300 & echo $! > {tmp_path}/pids; echo $$ >> {tmp_path}/pids; wait"]


def _pids(tmp_path) -> list[int]:
    wait_until(lambda: (tmp_path / "pids").is_file() and len((tmp_path / "pids").read_text().split()) == 2,
               HANG_S, "the command's pids")
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_stopped_run_leaves_none_of_its_processes_and_a_finished_one_its_exit_code(tmp_path):
    runner = subprocess.Popen([sys.executable, "-c", "import sys; from jigsaw.cluster.launch import _run; "
                               f"_run({_family(tmp_path)!r}, {{}}, 600)"])
    try:
        pids = _pids(tmp_path)
        runner.send_signal(signal.SIGINT)  # what ray.cancel does to the task running _run
        runner.wait(timeout=HANG_S)
        wait_until(lambda: all(map(_gone, pids)), HANG_S, "the stopped run's processes to go")
    finally:
        runner.kill()
    assert _run(["sh", "-c", "echo out; exit 3"], {"X": "1"}, 30) == (3, "out\n")
    assert _run(["sh", "-c", "echo $X"], {"X": "given"}, 30) == (0, "given\n")


def test_a_run_past_its_time_is_killed_with_everything_it_started(tmp_path):
    t0 = time.monotonic()
    rc, out = _run(_family(tmp_path), {}, 1.0)
    assert rc == 124 and "killed after 1 s" in out and time.monotonic() - t0 < HANG_S
    wait_until(lambda: all(map(_gone, _pids(tmp_path))), HANG_S, "the timed-out run's processes to go")
    assert _run(["/nonexistent/cmd"], {}, 5)[0] == 127
