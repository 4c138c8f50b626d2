"""The code tool's sandbox: no network (loopback included), bounded time, memory, output and files;
whatever the code does, the call returns a result and leaves no process behind."""

import socket
import threading

import pytest
from waiting import alive

from jigsaw.engines import sandbox
from jigsaw.engines.sandbox import SandboxConfig, SandboxError, run_python

FAST = SandboxConfig(timeout_s=1.5)
"""For the call that must time out."""
ROOMY = SandboxConfig(timeout_s=30.0)
"""For the others: an interpreter can take seconds to start on a loaded machine."""


def test_plain_code_runs_and_its_output_is_the_feedback():
    r = run_python("print(sum(range(10)))", ROOMY)
    assert (r.status, r.exit_code, r.output, r.feedback()) == ("ok", 0, "45\n", "45")


def test_the_network_is_unreachable_even_a_listener_on_this_machines_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(3.0)
    accepted: list = []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    port = server.getsockname()[1]
    r = run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1); print('reached')",
                   ROOMY)
    server.close()
    assert r.status == "error" and "reached" not in r.output, r.output
    assert "Errno" in r.output  # refused or unreachable inside its own namespace
    assert accepted in ([], [None]), "the tool's code reached a port of this machine"


def _accept(server):
    try:
        return server.accept()
    except OSError:
        return None


def test_runaway_code_is_killed_at_the_time_limit_with_everything_it_started():
    code = ("import subprocess, sys; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True)\n"
            "while True: pass")
    r = run_python(code, FAST)
    assert r.status == "timeout" and 1.5 <= r.wall_s < 15.0, (r.status, r.wall_s)  # not the child's 60 s
    child = int(r.output.split()[0])
    assert not alive(child), "a process the tool started outlived the call"
    assert r.feedback().endswith("[killed: time limit]")


def test_memory_past_the_limit_fails_the_call_not_this_process():
    r = run_python("x = bytearray(4 << 30)", ROOMY)
    assert r.status == "memory" and "MemoryError" in r.output


def test_a_flood_of_output_is_cut_at_the_cap_and_the_call_killed_at_once():
    cfg = SandboxConfig(timeout_s=30.0, max_output_bytes=4096)
    r = run_python("import sys\nwhile True: sys.stdout.write('x' * 1000)", cfg)
    assert r.status == "output-cut" and len(r.output) <= 4096 and r.wall_s < 20.0  # cut, not timed out


def test_a_crash_and_an_exit_code_are_told_apart():
    assert run_python("import os; os.abort()", ROOMY).status == "crashed"
    r = run_python("raise SystemExit(3)", ROOMY)
    assert (r.status, r.exit_code, r.feedback()) == ("error", 3, "[exit code 3]")


def test_files_are_bounded_and_the_environment_is_bare():
    big = run_python("open('f', 'wb').write(b'0' * (4 << 20))", SandboxConfig(timeout_s=30, max_file_bytes=1 << 20))
    assert big.status == "error" and "File too large" in big.output
    env = run_python("import os; print(sorted(os.environ))", ROOMY)
    assert set(eval(env.output)) <= {"PATH", "HOME", "PYTHONDONTWRITEBYTECODE", "LC_CTYPE"}


def test_a_machine_without_network_namespaces_refuses_to_run_tools(monkeypatch):
    monkeypatch.setattr(sandbox, "_LAUNCHER", f"import os; os._exit({sandbox.SANDBOX_UNAVAILABLE})")
    monkeypatch.setattr(sandbox, "_CHECKED", {})
    with pytest.raises(SandboxError, match="network namespace"):
        run_python("print(1)", ROOMY)
