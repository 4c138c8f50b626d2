"""A tool call's sandbox: model-written Python run in a child process that cannot reach a network.

    run_python(code, SandboxConfig) ─► child: python -I, in a fresh temp directory, its own
        session, a bare environment, and before it runs the code (_LAUNCHER):
            unshare(CLONE_NEWNET [| CLONE_NEWUSER])   a network namespace with no interface up:
                                                      every connect fails, loopback included
            setrlimit: address space, CPU seconds, file size, open files
        two reader threads keep at most max_output_bytes of stdout + stderr
      ─► ToolResult(status, output, exit_code, wall_s)
            ok · error (non-zero exit) · timeout (killed at the wall deadline) · memory
            (MemoryError, or killed for it) · output-cut (killed past the output cap) ·
            crashed (a signal)

The code is what a model wrote in its turn, so it runs where it can harm nothing this process
owns: no network, bounded time, memory and output, and its whole process group killed on
overrun.  If this machine forbids network namespaces the sandbox refuses to start (SandboxError)
rather than run tools with a network.  This is the GRPO recipe's code tool (issue 37); the
daemon never executes anything it receives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


class SandboxError(RuntimeError):
    """The sandbox cannot be set up on this machine (no network namespace)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxConfig:
    """Limits of one tool call."""

    timeout_s: float = 5.0
    """Wall-clock limit; the call's process group is killed at it."""
    mem_bytes: int = 512 << 20
    """Address-space limit of the child (RLIMIT_AS): past it, allocations fail (MemoryError)."""
    max_output_bytes: int = 16 << 10
    """stdout + stderr kept; the call is killed once it writes more."""
    max_file_bytes: int = 1 << 20
    """Largest file the child may write (RLIMIT_FSIZE), in its temp directory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolResult:
    """What a tool call gave back: fed to the model as its next turn."""

    status: str
    """ok, error, timeout, memory, output-cut or crashed."""
    output: str
    """stdout then stderr, at most max_output_bytes (decoded leniently)."""
    exit_code: int | None
    """The child's exit code; negative: the signal that ended it; None: never started."""
    wall_s: float
    """Real time of the call, start to reap."""

    def feedback(self, max_chars: int | None = None) -> str:
        """The text the model sees: the output (at most `max_chars`: its head and its tail, where a
        traceback ends with the error), and a line saying how the call ended, never cut."""
        note = {"ok": "", "error": f"[exit code {self.exit_code}]", "timeout": "[killed: time limit]",
                "memory": "[killed: memory limit]", "output-cut": "[killed: output limit]",
                "crashed": f"[crashed: signal {-(self.exit_code or 0)}]"}[self.status]
        out = self.output.strip()
        if max_chars is not None and len(out) > max_chars:
            half = max(1, max_chars // 2)
            out = f"{out[:half]} … {out[-half:]}"
        return (out + ("\n" + note if note else "")).strip()


_LAUNCHER = f"""
import ctypes, os, resource, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare({CLONE_NEWNET}) != 0 and libc.unshare({CLONE_NEWUSER | CLONE_NEWNET}) != 0:
    sys.stderr.write("sandbox: cannot unshare the network namespace\\n")
    os._exit(125)
mem, cpu, fsize = map(int, sys.argv[1:4])
for kind, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                    (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(kind, (value, value))
if sys.argv[4:]:
    code, sys.argv = sys.argv[4], ["-c"]
    del ctypes, libc, mem, cpu, fsize, kind, value
    exec(compile(code, "<tool>", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
"""
"""Runs in the child, a fresh single-threaded interpreter (no preexec_fn, which is unsafe in a
process with threads): a network namespace of its own (as root alone, else inside a user
namespace), the limits, then the tool's code, compiled and run by the same interpreter (a
second one would double the start-up, most of a small call's time).  Constant: only the code
is the model's."""
SANDBOX_UNAVAILABLE = 125


def _argv(code: str | None, cfg: SandboxConfig) -> list[str]:
    limits = [str(cfg.mem_bytes), str(int(cfg.timeout_s) + 1), str(cfg.max_file_bytes)]
    return [sys.executable, "-I", "-c", _LAUNCHER, *limits, *([code] if code is not None else [])]


_CHECKED: dict[str, bool] = {}


def check_available() -> None:
    """Raise SandboxError unless a child can get a network namespace here (checked once)."""
    if "ok" not in _CHECKED:
        probe = subprocess.run(_argv(None, SandboxConfig()), capture_output=True, timeout=30)
        _CHECKED["ok"] = probe.returncode == 0
    if not _CHECKED["ok"]:
        raise SandboxError("tool calls need a network namespace and this machine refuses one "
                           "(unshare(CLONE_NEWNET) and unprivileged user namespaces both failed); "
                           "run as a user allowed to create them (sysctl kernel.unprivileged_userns_clone=1)")


def run_python(code: str, cfg: SandboxConfig = SandboxConfig()) -> ToolResult:
    """Run `code` with `python -I` in the sandbox; never raises for what the code does."""
    check_available()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="jigsaw-tool-") as cwd:
        proc = subprocess.Popen(_argv(code, cfg), cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,  # a timeout kills its group
                                env={"PATH": "/usr/bin:/bin", "HOME": cwd, "PYTHONDONTWRITEBYTECODE": "1"})
        cap = _Capture(proc, cfg.max_output_bytes)
        try:
            proc.wait(timeout=cfg.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)
        out = cap.join()
    wall = time.monotonic() - start
    return ToolResult(status=_status(proc.returncode, out, timed_out, cap.overflow), output=out,
                      exit_code=proc.returncode, wall_s=wall)


def _status(code: int, out: str, timed_out: bool, overflow: bool) -> str:
    if overflow:
        return "output-cut"
    if timed_out or code == -signal.SIGXCPU:
        return "timeout"
    if "MemoryError" in out or code == -signal.SIGSEGV and "Cannot allocate" in out:
        return "memory"
    if code < 0:
        return "crashed"
    return "ok" if code == 0 else "error"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone, group and all
    proc.wait()


class _Capture:
    """stdout and stderr read on two threads, at most `cap` bytes kept in all; past it the
    process group is killed (a flood must not fill this process's memory or pipes)."""

    def __init__(self, proc: subprocess.Popen, cap: int):
        self.proc, self.cap, self.overflow = proc, cap, False
        self._parts: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._read, args=(name, pipe), daemon=True)
                         for name, pipe in (("out", proc.stdout), ("err", proc.stderr))]
        for th in self._threads:
            th.start()

    def _read(self, name: str, pipe) -> None:
        while chunk := pipe.read1(4096):
            with self._lock:
                room = self.cap - sum(len(p) for p in self._parts.values())
                self._parts[name] += chunk[:max(0, room)]
                if len(chunk) > room:
                    self.overflow = True
            if self.overflow:
                _kill_group(self.proc)
                return

    def join(self) -> str:
        for th in self._threads:
            th.join(timeout=5.0)
        text = bytes(self._parts["out"] + self._parts["err"])
        return text.decode("utf-8", errors="replace")


__all__ = ["SandboxConfig", "SandboxError", "ToolResult", "check_available", "run_python"]
