"""`jigsaw run [--name N] [--profile FILE] -- CMD ...`: run a pipeline under the node daemon.

    daemon answering? ── no ─► start `jigsaw daemon` detached (log in the runtime dir)
        │                        still none after start_timeout_s ─► run CMD unscheduled
        ▼
    register the pipeline with a fresh owner token (this process heartbeats for it; a name
    another job holds is refused: exit 2) ─► CMD as a child with JIGSAW_ENDPOINT /
    JIGSAW_PIPELINE / JIGSAW_OWNER ─► signals forwarded ─► unregister on exit
        ─► CMD's exit code (128 + N when it died of signal N)

A runtime directory that cannot be used (not private, not creatable) is said once and CMD
runs unscheduled: the pipeline never fails because the daemon cannot run.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jigsaw.runtime.paths import ENV_ENDPOINT, ENV_OWNER, ENV_PIPELINE


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Run CMD (after `--`) as a pipeline scheduled by the node's jigsaw daemon; start the
    daemon if none is running.  If the daemon cannot be reached CMD still runs, alone."""

    name: str | None = None
    """Pipeline name (default: the command's basename and this process's pid)."""
    profile: Path | None = None
    """Slowdown grid for a daemon started on demand."""
    devices: int = 1
    """Devices of a daemon started on demand."""
    start_daemon: bool = True
    """Start a daemon when none answers (--no-start-daemon: run CMD unscheduled instead)."""
    start_timeout_s: float = 10.0
    """How long to wait for a daemon started on demand."""
    cmd: tuple[str, ...] = ()
    """The pipeline's command (give it after `--`)."""


def run(args: Args) -> int:
    from jigsaw.runtime.client import Client

    if not args.cmd:
        raise ValueError("jigsaw run needs a command after `--`, e.g. jigsaw run -- python train.py")
    from jigsaw.runtime.protocol import check_name, safe_name

    name = check_name(args.name) if args.name else safe_name(f"{Path(args.cmd[0]).name}-{os.getpid()}")
    ep, why = _daemon(args)
    if ep is None:
        print(f"jigsaw run: {why}; running {name} unscheduled", file=sys.stderr)
    token = secrets.token_hex(16)
    owner = Client(name, ep, owner=token)
    if owner.refusal is not None and owner.refusal.code == "name-taken":
        owner.close()
        raise ValueError(owner.refusal.message)
    env = dict(os.environ, **{ENV_PIPELINE: name, ENV_OWNER: token}, **({ENV_ENDPOINT: ep} if ep else {}))
    try:
        proc = subprocess.Popen(list(args.cmd), env=env)
    except OSError as exc:
        owner.close(pipeline_done=True)
        raise ValueError(f"cannot run {args.cmd[0]!r}: {exc}") from None
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda s, f: proc.send_signal(s))
    rc = proc.wait()
    owner.close(pipeline_done=True)
    return 128 - rc if rc < 0 else rc


def _daemon(args: Args) -> tuple[str | None, str]:
    """The endpoint of a daemon that answers (started if need be), or None and why not."""
    from jigsaw.runtime.client import ping
    from jigsaw.runtime.paths import endpoint, runtime_dir

    try:
        directory = runtime_dir()
        ep = endpoint(directory)
    except (OSError, ValueError) as exc:
        return None, str(exc)
    if ping(ep, 0.5) or (args.start_daemon and _start_daemon(args, directory, ep)):
        return ep, ""
    return None, f"no daemon at {ep} (see {directory / 'daemon.log'})"


def _start_daemon(args: Args, directory: Path, ep: str) -> bool:
    from jigsaw.runtime.client import wait_for_daemon

    cmd = [sys.executable, "-m", "jigsaw.cli.main", "daemon", "--devices", str(args.devices)]
    if args.profile is not None:
        cmd += ["--profile", str(args.profile)]
    with open(directory / "daemon.log", "ab") as log:
        subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    return wait_for_daemon(ep, args.start_timeout_s)
