"""`jigsaw daemon`: run the node daemon in the foreground (`jigsaw run` starts one on demand).

    DaemonConfig (flags) ─► Daemon(config).serve()   until SIGINT / SIGTERM
"""

from __future__ import annotations

import faulthandler
import logging
import signal
from dataclasses import dataclass
from typing import Annotated

import tyro

from jigsaw.runtime.daemon import DaemonConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Run the jigsaw node daemon: it schedules the sub-stages of every pipeline started with
    `jigsaw run` on this node.  It listens on a Unix socket in a per-user 0700 directory
    ($JIGSAW_RUNTIME_DIR, else $XDG_RUNTIME_DIR/jigsaw, else /tmp/jigsaw-UID)."""

    daemon: Annotated[DaemonConfig, tyro.conf.arg(name="")] = DaemonConfig()
    verbose: bool = False
    """Log every admission."""


def run(args: Args) -> int:
    from jigsaw.runtime.daemon import Daemon

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` writes every thread's stack to the log
    d = Daemon(args.daemon)

    def stop(signum, frame):
        d.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        d.serve()
    except RuntimeError as exc:  # another daemon holds the directory
        raise ValueError(str(exc)) from None
    return 0
