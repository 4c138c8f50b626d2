"""`jigsaw daemon [serve|status|stop|migrate]`: the node daemon in the foreground, or ask the one running.

    serve (default)  DaemonConfig (flags) ─► Daemon(config).serve()   until SIGINT / SIGTERM, a
                     Stop request, or idle_exit_s with no pipeline; then its socket and lock go
    status           Status ─► the daemon's pid, uptime, set-up, trace, pipelines (with an SLO: steps
                     kept, the last step's slowdown, why the latest plan gives it up)  (exit 1: none)
    stop             Status (its pid) ─► Stop ─► wait until that pid has exited, or stop_timeout_s
                     (exit 0: stopped, or none was running; 1: it did not stop)
    migrate          Migrate(pipeline, source rank, target rank) ─► the rollout's requests in flight
                     move (exit 0), or the daemon's reason why nothing can (exit 1)

The runtime directory is $JIGSAW_RUNTIME_DIR, else $XDG_RUNTIME_DIR/jigsaw, else /tmp/jigsaw-UID;
status and stop never create it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro

from jigsaw.runtime.daemon import DaemonConfig

ASK_TIMEOUT_S = 2.0
"""How long status and stop wait for the daemon's reply."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Run the jigsaw node daemon in the foreground: it schedules the sub-stages of every pipeline
    started with `jigsaw run` on this node.  Or ask the daemon running in this runtime directory
    for its status, to stop, or to move a rollout's requests between DP ranks.  It listens on a
    Unix socket in a per-user 0700 directory:
    $JIGSAW_RUNTIME_DIR, else $XDG_RUNTIME_DIR/jigsaw, else /tmp/jigsaw-UID."""

    action: tyro.conf.Positional[Literal["serve", "status", "stop", "migrate"]] = "serve"
    """serve: run the daemon in the foreground with the options below.
    status: whether a daemon answers, and what it runs (exit 1 if none).
    stop: ask it to exit, and wait until it has (exit 1 if it did not).
    migrate: move a pipeline's rollout requests in flight from one DP rank to another, e.g.
    to drain a rollout replica (--pipeline, --source-rank, --target-rank; exit 1 if nothing can move)."""
    daemon: Annotated[DaemonConfig, tyro.conf.arg(name="")] = DaemonConfig()
    no_trace: Annotated[bool, tyro.conf.FlagCreatePairsOff] = False
    """Write no trace (without --trace, the daemon writes one under the runtime directory's traces/)."""
    stop_timeout_s: float = 10.0
    """stop: how long to wait for the daemon to exit."""
    verbose: bool = False
    """Log every admission."""
    pipeline: str | None = None
    """migrate: the pipeline (its `jigsaw run --name`)."""
    source_rank: int | None = None
    """migrate: the DP rank whose rollout requests leave (verl: its rollout replica)."""
    target_rank: int | None = None
    """migrate: the DP rank that resumes them."""
    owner: str | None = None
    """migrate: the pipeline's owner token; without it, $JIGSAW_OWNER, else the token its
    `jigsaw run` keeps in the runtime directory's owners/."""


def run(args: Args) -> int:
    if args.action != "serve" and (args.daemon != DaemonConfig() or args.no_trace):
        raise ValueError(f"`jigsaw daemon {args.action}` takes no daemon options (they configure `serve`)")
    if args.action == "status":
        return status()
    if args.action == "stop":
        return stop(args.stop_timeout_s)
    if args.action == "migrate":
        return migrate(args)
    if (args.pipeline, args.source_rank, args.target_rank) != (None, None, None):
        raise ValueError("--pipeline, --source-rank and --target-rank are options of `jigsaw daemon migrate`")
    return serve(args)


def serve(args: Args) -> int:
    from jigsaw.runtime.daemon import Daemon

    if args.no_trace and args.daemon.trace is not None:
        raise ValueError("--trace and --no-trace contradict each other")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` writes every thread's stack to the log
    d = Daemon(args.daemon, auto_trace=not args.no_trace)

    def stop_serving(signum, frame):
        d.stopping = True  # the loop ends within a tick; serve() removes the socket and the lock

    signal.signal(signal.SIGTERM, stop_serving)
    signal.signal(signal.SIGINT, stop_serving)
    try:
        d.serve()
    except RuntimeError as exc:  # another daemon holds the directory
        raise ValueError(str(exc)) from None
    return 0


# ------------------------------------------------------------------ status, stop

def _endpoint() -> str | None:
    """The daemon endpoint of this runtime directory, None if the directory does not exist."""
    from jigsaw.runtime.paths import endpoint, runtime_dir

    try:
        return endpoint(runtime_dir(create=False))
    except FileNotFoundError:
        return None


def _ask_status(ep: str | None):
    """The daemon's StatusReply; None, or an Error from a daemon of another version."""
    from jigsaw import protocol as pr
    from jigsaw.runtime.client import ask

    return None if ep is None else ask(ep, pr.Status(req=1), ASK_TIMEOUT_S)


def status() -> int:
    from jigsaw import protocol as pr

    ep = _endpoint()
    st = _ask_status(ep)
    if not isinstance(st, pr.StatusReply):
        print(_nobody(ep, st))
        return 1
    print("\n".join(describe(st, ep)))
    return 0


def stop(timeout_s: float) -> int:
    from jigsaw import protocol as pr
    from jigsaw.runtime.client import ask

    ep = _endpoint()
    st = _ask_status(ep)
    if not isinstance(st, pr.StatusReply):
        print(_nobody(ep, st))
        return 0 if st is None else 1
    t0 = time.monotonic()
    if not isinstance(reply := ask(ep, pr.Stop(req=2), ASK_TIMEOUT_S), pr.Ok):
        print(f"jigsaw daemon {st.pid} did not accept the stop request ({getattr(reply, 'message', 'no reply')})")
        return 1
    while time.monotonic() - t0 < timeout_s:
        if _stopped(st.pid, ep):
            print(f"stopped jigsaw daemon {st.pid} ({time.monotonic() - t0:.1f} s)")
            return 0
        time.sleep(0.05)
    print(f"jigsaw daemon {st.pid} did not exit within {timeout_s:g} s (`kill -USR1 {st.pid}` writes its "
          f"threads' stacks to its log; `kill {st.pid}` stops it)")
    return 1


def migrate(args: Args) -> int:
    from jigsaw import protocol as pr
    from jigsaw.runtime.client import ask

    if None in (args.pipeline, args.source_rank, args.target_rank):
        raise ValueError("jigsaw daemon migrate needs --pipeline, --source-rank and --target-rank")
    from jigsaw.runtime.paths import find_owner

    ep = _endpoint()
    name = pr.check_name(args.pipeline)
    owner = args.owner if args.owner is not None else find_owner(ep, name)
    msg = pr.Migrate(pipeline=name, source_rank=args.source_rank, target_rank=args.target_rank, owner=owner, req=3)
    reply = None if ep is None else ask(ep, msg, ASK_TIMEOUT_S)
    if isinstance(reply, pr.Migrated):
        print(f"{reply.source}: its requests in flight go to DP rank {args.target_rank}"
              + (f" ({reply.target})" if reply.target else ""))
        return 0
    print(_nobody(ep, reply) if reply is None or reply.code == "version" else f"not migrated: {reply.message}")
    return 1


def _nobody(ep: str | None, reply) -> str:
    if reply is None:
        return f"no daemon running (nothing answers at {ep})" if ep else "no daemon running (no runtime directory)"
    return f"a jigsaw daemon of another version answers at {ep}: {reply.message}"


def _stopped(pid: int, ep: str) -> bool:
    """The daemon `pid` has exited, and no daemon of that pid answers at `ep`."""
    from jigsaw.runtime.client import status as ask_status

    if not _exited(pid):
        return False
    st = ask_status(ep, 0.2)
    return st is None or st.pid != pid


def _exited(pid: int) -> bool:
    """Whether `pid` is gone (or a zombie its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return not Path(f"/proc/{pid}").exists()


def describe(st, ep: str) -> list[str]:
    """`jigsaw daemon status`'s lines for a StatusReply."""
    idle = "never" if st.idle_exit_s is None else f"after {st.idle_exit_s:g} s with no pipeline"
    lines = [f"jigsaw daemon {st.pid} at {ep}, up {_duration(st.uptime_s)}",
             f"  devices    {st.devices} (partitioner {st.partitioner})",
             f"  profile    {st.profile or '(default)'}: {st.grid}",
             f"  policy     {st.policy}",
             f"  trace      {st.trace}",
             f"  idle exit  {idle}",
             f"  pipelines  {len(st.pipelines)}"]
    for p in st.pipelines:
        lines.append(f"    {p.name}: {p.clients} client(s), step {p.step}, sub-stages asked {p.requested}, granted "
                     f"{p.granted}, running {len(p.running)}, waiting {len(p.pending)}")
        lines += _slo_lines(p)
    lines.append(f"  errors {st.errors}, refused connections {st.refused}, scheduler failures {st.scheduler_failures}")
    return lines


def _slo_lines(p) -> list[str]:
    """A pipeline's SLO in `jigsaw daemon status` (none without one)."""
    if not p.slo_slowdown:
        return []
    last = f", last step {p.last_slowdown:.2f}× exclusive" if p.last_slowdown else ""
    lines = [f"      SLO {p.slo_slowdown:g}×: {p.slo_kept}/{p.slo_steps} steps kept{last}"]
    return lines + ([f"      given up: {p.slo_given_up}"] if p.slo_given_up else [])


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {s:02d} s" if m else f"{seconds:.1f} s"
