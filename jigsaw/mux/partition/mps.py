"""MPS (CUDA Multi-Process Service): find the control daemon, query it, start it safely.

Green contexts split a device's SMs inside one process.  Pipelines in separate processes
(inference servers beside training ranks) only run at the same time through MPS; without it
their contexts are time-sliced.  But an MPS *active thread percentage* below 100 caps every
client at that share of the SMs and overrides the green-context split, so jigsaw starts the
daemon with the percentage left unset and flags one that is set.

    $CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps)/nvidia-cuda-mps-control.pid ─► daemon_pid
    nvidia-cuda-mps-control (on PATH) ◄── stdin: get_server_list
                                                 get_default_active_thread_percentage
                                                 get_active_thread_percentage PID
                                      ──► stdout ─► parse_server_list / parse_thread_percentage
    status()            ─► MpsStatus(state, reason, server pids, percentages, warnings)
    ensure_mps(start)   ─► status(); when stopped and start: `nvidia-cuda-mps-control -d` with
                           CUDA_MPS_ACTIVE_THREAD_PERCENTAGE removed from its environment ─► status()
    stop_mps()          ─► `quit`, then status() until no daemon answers

The parse_* functions are pure (unit-tested on captured outputs); everything that runs the
binary goes through `query`, with a timeout, so a wedged daemon cannot hang `jigsaw doctor`.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

CONTROL_BIN = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
PID_FILE = "nvidia-cuda-mps-control.pid"
THREAD_PCT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
NOT_RUNNING = "Cannot find MPS control daemon process"
"""What the control binary prints when no daemon listens on the pipe directory."""

STATES = ("running", "stopped", "no-binary", "no-gpu", "error")


class MpsError(RuntimeError):
    """The control binary failed, timed out or answered something unexpected."""


class MpsNotRunning(MpsError):
    """No control daemon listens on the pipe directory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MpsStatus:
    state: str
    """One of STATES: running, stopped (binary present, no daemon), no-binary, no-gpu, error."""
    reason: str
    """One line for humans: what was found, or why nothing could be."""
    pipe_dir: str
    control_bin: str | None = None
    daemon_pid: int | None = None
    server_pids: tuple[int, ...] = ()
    default_thread_pct: float | None = None
    """The daemon's default active thread percentage (100 = no cap)."""
    server_thread_pct: dict[int, float] = field(default_factory=dict)
    """Active thread percentage of each running MPS server."""
    env_thread_pct: float | None = None
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in this process's environment (caps our own clients)."""
    started: bool = False
    """ensure_mps started the daemon in this call."""
    warnings: tuple[str, ...] = ()

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def thread_pct_capped(self) -> bool:
        """A percentage below 100 is set somewhere: it would override green-context splits."""
        pcts = [self.default_thread_pct, self.env_thread_pct, *self.server_thread_pct.values()]
        return any(p is not None and p < 100.0 for p in pcts)


# ------------------------------------------------------------------ pure parsing


def parse_server_list(text: str) -> tuple[int, ...]:
    """PIDs of `get_server_list` (one per line; empty when no server was spawned yet)."""
    pids = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not line.isdigit():
            raise MpsError(f"get_server_list: expected one PID per line, got {line!r}")
        pids.append(int(line))
    return tuple(pids)


def parse_thread_percentage(text: str) -> float | None:
    """The number `get_[default_]active_thread_percentage` prints (e.g. "100.0"); None if empty."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return None
    try:
        pct = float(lines[-1])
    except ValueError:
        raise MpsError(f"active thread percentage: expected a number, got {lines[-1]!r}") from None
    if not 0.0 < pct <= 100.0:
        raise MpsError(f"active thread percentage out of (0, 100]: {pct}")
    return pct


def env_thread_percentage(env: Mapping[str, str]) -> float | None:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of an environment; None when unset or blank."""
    raw = env.get(THREAD_PCT_ENV, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise MpsError(f"{THREAD_PCT_ENV}={raw!r} is not a number") from None


def cap_warnings(status: MpsStatus) -> tuple[str, ...]:
    """Why a set thread percentage breaks green-context splits, one line per place it is set."""
    out = []
    if status.default_thread_pct is not None and status.default_thread_pct < 100.0:
        out.append(f"MPS default active thread percentage is {status.default_thread_pct:g}: every new MPS server caps "
                   "its clients at that SM share, overriding green-context splits (fix: `echo "
                   f"set_default_active_thread_percentage 100 | {CONTROL_BIN}`, or restart the daemon without it)")
    for pid, pct in sorted(status.server_thread_pct.items()):
        if pct < 100.0:
            out.append(f"MPS server {pid} runs with active thread percentage {pct:g}: its clients cannot use "
                       "their full green-context partitions")
    if status.env_thread_pct is not None and status.env_thread_pct < 100.0:
        out.append(f"{THREAD_PCT_ENV}={status.env_thread_pct:g} in this environment caps this process's MPS "
                   "contexts; unset it (or set 100) to keep green-context splits")
    return tuple(out)


# ------------------------------------------------------------------ the system


def pipe_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR)


def find_control(env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return shutil.which(CONTROL_BIN, path=env.get("PATH"))


def gpu_present() -> bool:
    """An NVIDIA device node exists (MPS has nothing to serve without one)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def daemon_pid(pipe: Path) -> int | None:
    """PID from the daemon's pid file in `pipe`, if that process is alive."""
    try:
        pid = int((pipe / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # stale file of a daemon that died without cleaning up
    except PermissionError:
        pass  # alive, owned by another user (the daemon usually runs as root)
    return pid


def query(command: str, *, control_bin: str, env: Mapping[str, str] | None = None, timeout_s: float = 5.0) -> str:
    """Send one command to the control daemon; its stdout.  Raises MpsNotRunning / MpsError."""
    try:
        res = subprocess.run([control_bin], input=command + "\n", capture_output=True, text=True,
                             timeout=timeout_s, env=None if env is None else dict(env), check=False)
    except subprocess.TimeoutExpired:
        raise MpsError(f"`{command}` got no answer from {control_bin} in {timeout_s:g}s") from None
    except OSError as exc:
        raise MpsError(f"cannot run {control_bin}: {exc}") from None
    both = res.stdout + res.stderr
    if NOT_RUNNING in both:
        raise MpsNotRunning(f"no MPS control daemon on {pipe_dir(env)}")
    if res.returncode != 0:
        raise MpsError(f"`{command}` exited {res.returncode}: {both.strip()[:200]}")
    return res.stdout


def status(env: Mapping[str, str] | None = None, *, timeout_s: float = 5.0) -> MpsStatus:
    """What runs now (see the module docstring); never raises for an absent binary, GPU or daemon."""
    env = dict(os.environ if env is None else env)
    pipe, control = pipe_dir(env), find_control(env)
    base = MpsStatus(state="error", reason="", pipe_dir=str(pipe), control_bin=control, daemon_pid=daemon_pid(pipe))
    try:
        base = replace(base, env_thread_pct=env_thread_percentage(env))
    except MpsError as exc:
        return replace(base, reason=str(exc))
    if control is None:
        where = f"; a daemon (pid {base.daemon_pid}) owns {pipe}" if base.daemon_pid else ""
        return _with_warnings(replace(base, state="no-binary",
                                      reason=f"{CONTROL_BIN} not on PATH (NVIDIA driver utilities "
                                             f"not installed){where}"))
    if not gpu_present():
        return replace(base, state="no-gpu", reason="no NVIDIA device (/dev/nvidia*) on this machine")
    try:
        servers = parse_server_list(query("get_server_list", control_bin=control, env=env, timeout_s=timeout_s))
        default = parse_thread_percentage(
            query("get_default_active_thread_percentage", control_bin=control, env=env, timeout_s=timeout_s))
        per_server = {pid: _server_pct(pid, control, env, timeout_s) for pid in servers}
    except MpsNotRunning:
        return _with_warnings(replace(base, state="stopped", reason=f"no MPS control daemon on {pipe}"))
    except MpsError as exc:
        return replace(base, reason=str(exc))
    running = replace(base, state="running", server_pids=servers, default_thread_pct=default,
                      server_thread_pct={p: v for p, v in per_server.items() if v is not None},
                      reason=f"control daemon on {pipe}, {len(servers)} server(s), default active thread "
                             f"percentage {'unset' if default is None else f'{default:g}'}")
    return _with_warnings(running)


def _server_pct(pid: int, control: str, env: Mapping[str, str], timeout_s: float) -> float | None:
    return parse_thread_percentage(query(f"get_active_thread_percentage {pid}", control_bin=control, env=env,
                                         timeout_s=timeout_s))


def _with_warnings(s: MpsStatus) -> MpsStatus:
    notes = list(cap_warnings(s))
    if s.state == "stopped":
        notes.append("no MPS daemon: pipelines in separate processes are time-sliced, not concurrent "
                     "(green contexts split SMs only within one process)")
    return replace(s, warnings=tuple(notes))


def ensure_mps(start: bool, *, env: Mapping[str, str] | None = None, timeout_s: float = 10.0) -> MpsStatus:
    """The daemon's status; with `start`, launch it first when it is not running.

    The daemon is launched WITHOUT a default active thread percentage (the variable is
    removed from its environment), so its servers do not cap green-context partitions.
    A daemon that is already running is left as it is; its percentage shows in `warnings`.
    """
    env = dict(os.environ if env is None else env)
    now = status(env, timeout_s=min(timeout_s, 5.0))
    if not start or now.state != "stopped":
        return now
    daemon_env = {k: v for k, v in env.items() if k != THREAD_PCT_ENV}
    Path(now.pipe_dir).mkdir(parents=True, exist_ok=True)
    try:
        res = subprocess.run([now.control_bin, "-d"], capture_output=True, text=True, timeout=timeout_s,
                             env=daemon_env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return replace(now, state="error", reason=f"starting `{now.control_bin} -d` failed: {exc}")
    if res.returncode != 0:
        said = (res.stdout + res.stderr).strip()[:200]
        return replace(now, state="error", reason=f"`{now.control_bin} -d` exited {res.returncode}: {said}")
    return _await_daemon(env, timeout_s)


def _await_daemon(env: Mapping[str, str], timeout_s: float) -> MpsStatus:
    # `-d` forks and returns before the control pipe exists; poll until it answers.
    deadline = time.monotonic() + timeout_s
    while True:
        now = status(env, timeout_s=min(timeout_s, 5.0))
        if now.state != "stopped" or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if now.state == "stopped":
        return replace(now, state="error", reason=f"started {CONTROL_BIN} -d but no daemon answered in {timeout_s:g}s")
    return replace(now, started=now.running)


def stop_mps(control_bin: str | None = None, *, env: Mapping[str, str] | None = None, timeout_s: float = 15.0) -> str:
    """`quit` to the control daemon, then wait until none answers; what happened, in words
    ("stopped" when it is gone).  Never raises: a check that started MPS stops it on its way out."""
    env = dict(os.environ if env is None else env)
    control = control_bin or find_control(env)
    if control is None:
        return f"{CONTROL_BIN} not on PATH"
    try:
        query("quit", control_bin=control, env=env, timeout_s=timeout_s)
    except MpsNotRunning:
        return "stopped"
    except MpsError as exc:
        return f"quit failed: {exc}"
    deadline = time.monotonic() + timeout_s
    while (state := status(env).state) == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    return "stopped" if state != "running" else f"still running {timeout_s:g}s after quit"
