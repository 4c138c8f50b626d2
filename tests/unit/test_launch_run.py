"""A pipeline's command as a cluster task runs it (cluster/launch.py `_run`): in a session of its
own, so that a run stopped (cancelled by the launcher, which Ray delivers as KeyboardInterrupt,
or timed out) leaves nothing it started running: a pipeline placed again must not have its old
run's workers still training beside the new one.  A cancelled command first gets SIGTERM and a
grace to end on its own (the recipe ends its step in flight and saves it).  The runner inherits
SIGINT ignored, as Ray workers under a background shell job do: a `_run` that did not take
SIGINT back would never be stopped (CI's clean-clone run failed so, and these tests with it)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from waiting import HANG_S, alive, wait_until

from jigsaw.cluster.launch import _run

pytestmark = pytest.mark.timeout(60)


def _family(tmp_path) -> list[str]:
    """A command that starts a grandchild and waits, writing both pids to a file."""
    return ["sh", "-c", f"sleep 300 & echo $! > {tmp_path}/pids; echo $$ >> {tmp_path}/pids; wait"]


def _pids(tmp_path) -> list[int]:
    wait_until(lambda: (tmp_path / "pids").is_file() and len((tmp_path / "pids").read_text().split()) == 2,
               HANG_S, "the command's pids")
    return [int(p) for p in (tmp_path / "pids").read_text().split()]


def _cancelled(tmp_path, cmd: list[str], grace_s: float = 0.0) -> list[int]:
    """Run `cmd` as the cluster task does, in a process that inherited SIGINT ignored (as a Ray
    worker started under a shell's background job does), and cancel it with a SIGINT, as
    ray.cancel does, once it started; the pids it wrote."""
    pids = tmp_path / "pids"
    script = ("import os, signal, threading, time\n"
              "from jigsaw.cluster.launch import _run\n"
              "def cancel():\n"
              f"    while not (os.path.exists({str(pids)!r}) and len(open({str(pids)!r}).read().split()) == 2):\n"
              "        time.sleep(0.02)\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "threading.Thread(target=cancel, daemon=True).start()\n"
              f"_run({cmd!r}, {{}}, 600, grace_s={grace_s})\n")
    runner = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        err = runner.communicate(timeout=HANG_S)[1]
    finally:
        runner.kill()
    assert "KeyboardInterrupt" in err, err[-2000:]  # cancelled, not ended on its own
    return _pids(tmp_path)


def test_a_stopped_run_leaves_none_of_its_processes_and_a_finished_one_its_exit_code(tmp_path):
    pids = _cancelled(tmp_path, _family(tmp_path))
    wait_until(lambda: not any(map(alive, pids)), HANG_S, "the stopped run's processes to go")
    assert _run(["sh", "-c", "echo out; exit 3"], {"X": "1"}, 30) == (3, "out\n")
    assert _run(["sh", "-c", "echo $X"], {"X": "given"}, 30) == (0, "given\n")


def test_a_run_past_its_time_is_killed_with_everything_it_started(tmp_path):
    t0 = time.monotonic()
    rc, out = _run(_family(tmp_path), {}, 1.0)
    assert rc == 124 and "killed after 1 s" in out and time.monotonic() - t0 < HANG_S
    wait_until(lambda: not any(map(alive, _pids(tmp_path))), HANG_S, "the timed-out run's processes to go")
    assert _run(["/nonexistent/cmd"], {}, 5)[0] == 127



def test_a_cancelled_command_gets_sigterm_and_its_grace_and_one_that_ignores_it_is_killed(tmp_path):
    ends = tmp_path / "ended"
    polite = ["sh", "-c", f"trap 'sleep 1; echo saved > {ends}; exit 0' TERM; "
                          f"sleep 300 & echo $! > {tmp_path}/pids; echo $$ >> {tmp_path}/pids; wait"]
    pids = _cancelled(tmp_path, polite, grace_s=30.0)
    assert ends.read_text() == "saved\n"  # it ended its work within the grace, before the SIGKILL
    wait_until(lambda: not any(map(alive, pids)), HANG_S, "the rest of its group to go")
    (tmp_path / "pids").unlink()
    deaf = ["sh", "-c", f"trap '' TERM; sleep 300 & echo $! > {tmp_path}/pids; echo $$ >> {tmp_path}/pids; wait"]
    t0 = time.monotonic()
    pids = _cancelled(tmp_path, deaf, grace_s=1.0)
    wait_until(lambda: not any(map(alive, pids)), HANG_S, "a command deaf to SIGTERM to be killed after its grace")
    assert time.monotonic() - t0 < HANG_S
