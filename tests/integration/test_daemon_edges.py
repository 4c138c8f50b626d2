"""The daemon around its edges, with real processes: the runtime directory, the socket path,
the trace, frames no client sends, and two jobs that want the same pipeline name."""

import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nodes import ROOT, Node
from test_runtime import work_done
from waiting import HANG_S, wait_until

from jigsaw import protocol as pr
from jigsaw.runtime.paths import MAX_SOCKET_PATH_BYTES
from jigsaw.runtime.wire import Channel, frame

pytestmark = pytest.mark.timeout(120)


def jigsaw(*args: str, env: dict, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jigsaw.cli.main", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def env_with(runtime: Path) -> dict:
    env = dict(os.environ, JIGSAW_RUNTIME_DIR=str(runtime))
    env.pop("JIGSAW_ENDPOINT", None)
    return env


def refused_cleanly(out: subprocess.CompletedProcess, *words: str) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    for w in words:
        assert w in out.stderr, out.stderr


def test_a_runtime_path_that_is_a_file_is_a_clear_error(tmp_path):
    f = tmp_path / "rt"
    f.write_text("not a directory")
    refused_cleanly(jigsaw("daemon", env=env_with(f)), str(f), "not a directory")


def test_a_socket_path_too_long_for_unix_sockets_is_a_clear_error(tmp_path):
    deep = tmp_path / ("d" * (MAX_SOCKET_PATH_BYTES - len(str(tmp_path))))
    refused_cleanly(jigsaw("daemon", env=env_with(deep)), "at most 107", "JIGSAW_RUNTIME_DIR")


def test_run_with_a_runtime_dir_others_can_enter_still_runs_the_command(tmp_path):
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o755)
    rt.chmod(0o755)
    out = jigsaw("run", "--", sys.executable, "-c", "print('the job ran')", env=env_with(rt))
    assert out.returncode == 0 and "the job ran" in out.stdout, out.stderr
    assert "must be 0700" in out.stderr and "unscheduled" in out.stderr
    assert not (rt / "daemon.sock").exists()  # no daemon was started in a directory others can enter


def test_a_trace_that_cannot_be_opened_is_reported_and_the_daemon_serves(tmp_path):
    n = Node(tmp_path)
    n.trace = tmp_path / "no-such-dir" / "trace.jsonl"
    n.start()
    try:
        st = n.status()
        assert st.trace.startswith("stopped:") and "no-such-dir" in st.trace
        a = n.run("A", tmp_path / "a.out", "--steps", "1", "--work-ms", "20")
        assert a.wait(60) == 0
        work_done(tmp_path / "a.out", 1)
    finally:
        n.stop()


def _rss_mib(pid: int) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def test_a_huge_message_is_refused_from_its_length_before_any_of_it_is_buffered(tmp_path):
    n = Node(tmp_path)
    n.start()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        before = _rss_mib(n.daemon.pid)
        s.connect(str(n.dir / "daemon.sock"))
        chunk = b"\0" * (1 << 20)
        sent = 0
        try:
            s.sendall(struct.pack("!I", 600 << 20))  # 600 MiB announced ...
            for _ in range(600):  # ... and sent until the daemon shuts the door
                s.sendall(chunk)
                sent += 1
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 600
        assert _rss_mib(n.daemon.pid) - before < 16, (before, _rss_mib(n.daemon.pid))
        assert isinstance(n.status(timeout_s=2.0), pr.StatusReply)
        many = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        many.settimeout(10)
        many.connect(str(n.dir / "daemon.sock"))
        many.sendall(b"".join(frame(pr.encode(pr.Status(req=i))) for i in range(40)))  # 40 in one write
        ch = Channel(n.dir / "daemon.sock")
        ch.sock = many
        assert [pr.decode_reply(ch.recv()).req for _ in range(40)] == list(range(40))
        ch.close()
    finally:
        s.close()
        n.stop()


def test_a_second_job_with_the_same_name_is_refused_and_the_first_keeps_its_grants(tmp_path):
    n = Node(tmp_path)
    n.start()
    pause = tmp_path / "go"
    try:
        first = n.run("same", tmp_path / "a.out", "--steps", "1", "--work-ms", "20", "--pause-file", str(pause))
        held = n.running("same", first).running
        out = jigsaw("run", "--name", "same", "--", sys.executable, "-c", "print('second')", env=n.env)
        refused_cleanly(out, "belongs to another job", "--name")
        assert "second" not in out.stdout
        assert n.pipelines()["same"].running == held  # nothing was reclaimed
        pause.touch()
        assert first.wait(60) == 0
        lines = (tmp_path / "a.out").read_text().splitlines()
        work_done(tmp_path / "a.out", 1)
        assert all(line.split()[-1] == "0" for line in lines)  # every sub-stage under a grant, none exclusive
    finally:
        n.stop()


def test_a_stopped_daemon_that_resumes_keeps_every_client_and_grant(tmp_path):
    """SIGSTOP for three leases while a worker holds a grant: after SIGCONT nobody's lease
    expires (the clients kept sending; the daemon was the one not listening)."""
    n = Node(tmp_path)
    n.start()
    pause = tmp_path / "go"
    try:
        a = n.run("A", tmp_path / "a.out", "--steps", "1", "--work-ms", "20", "--pause-file", str(pause))
        p = n.running("A", a)
        n.daemon.send_signal(signal.SIGSTOP)
        time.sleep(3 * pr.LEASE_S)  # the scenario: stopped for three leases, the clients beating on
        n.daemon.send_signal(signal.SIGCONT)
        back_s = wait_until(lambda: getattr(n.status(), "uptime_s", None), HANG_S, "the daemon answering again")
        # A lease past its return on its own clock (it checks leases after answering): a client it
        # dropped at its return, or since, is gone from the reply after that
        wait_until(lambda: getattr(n.status(), "uptime_s", 0.0) > back_s + pr.LEASE_S, HANG_S,
                   "a lease past the daemon's return, on its clock")
        assert n.pipelines()["A"].running == p.running
        pause.touch()
        assert a.wait(60) == 0
        work_done(tmp_path / "a.out", 1)
        drops = [e for e in n.events() if e["event"] == "drop" and e["data"]["reason"] == "lease expired"]
        assert not drops, drops
    finally:
        n.daemon.send_signal(signal.SIGCONT)
        n.stop()
