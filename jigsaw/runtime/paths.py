"""Where the daemon listens: a per-user 0700 runtime directory.

    $JIGSAW_RUNTIME_DIR  or  $XDG_RUNTIME_DIR/jigsaw  or  /tmp/jigsaw-<uid>
        daemon.sock   Unix stream socket of the daemon (0600; wire.py frames its messages)
        daemon.lock   flock held by the running daemon (one per directory)
                      (the daemon removes both as it exits: housekeeping.py)
        daemon.log    output of a daemon started on demand by `jigsaw run`
        traces/daemon-<YYYYmmdd-HHMMSS>-<pid>.jsonl   a daemon's trace, unless told otherwise
                      (the newest 20 are kept)
        board/<pid>   the grant a client posted for one of its worker processes (mux/partition/board.py)
        owners/<pipeline>   the owner token of a `jigsaw run` job (0600, while it runs): a worker
                      started without $JIGSAW_OWNER, and `jigsaw daemon migrate`, find it here

Clients find the endpoint in $JIGSAW_ENDPOINT (set by `jigsaw run` for its child) or
derive it from the directory.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

# the cluster's launch sets them too, so they live in a module of their own; imported from here
# by the runtime, the CLI and the integrations
from jigsaw.env import ENV_DIR, ENV_ENDPOINT, ENV_NODES, ENV_OWNER, ENV_PIPELINE  # noqa: F401

MAX_SOCKET_PATH_BYTES = 107
"""A Unix socket path fits sockaddr_un.sun_path: 108 bytes with the terminating NUL."""


def runtime_dir(create: bool = True) -> Path:
    """The directory, created 0700 if missing; refuses one another user could enter."""
    if env := os.environ.get(ENV_DIR):
        path = Path(env)
    elif xdg := os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(xdg) / "jigsaw"
    else:
        path = Path("/tmp") / f"jigsaw-{os.getuid()}"
    if create:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            raise ValueError(f"jigsaw runtime directory {path} exists and is not a directory "
                             f"(remove it, or set {ENV_DIR} to another directory)") from None
        except OSError as exc:
            raise ValueError(f"cannot create the jigsaw runtime directory {path}: {exc.strerror} "
                             f"(set {ENV_DIR} to a private directory you can write)") from None
    check_private(path)
    return path


def check_private(path: Path) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"jigsaw runtime directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise ValueError(f"jigsaw runtime directory {path} belongs to uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o077:
        raise ValueError(f"jigsaw runtime directory {path} has mode {oct(st.st_mode & 0o777)}; "
                         f"it must be 0700 (chmod 700 {path})")


def endpoint(directory: Path | None = None) -> str:
    if directory is None and (env := os.environ.get(ENV_ENDPOINT)):
        return env
    return f"ipc://{(directory or runtime_dir()) / 'daemon.sock'}"


def socket_path(ep: str) -> Path:
    if not ep.startswith("ipc://"):
        raise ValueError(f"jigsaw endpoint must be ipc://PATH, got {ep!r}")
    path = Path(ep[len("ipc://"):])
    if (n := len(os.fsencode(path))) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"socket path {path} is {n} bytes; a Unix socket path holds at most "
                         f"{MAX_SOCKET_PATH_BYTES} (set {ENV_DIR} to a shorter directory)")
    return path


def owner_file(ep: str, pipeline: str) -> Path:
    """Where `jigsaw run` keeps its job's owner token, beside the daemon's socket."""
    return socket_path(ep).parent / "owners" / pipeline


@contextlib.contextmanager
def kept_owner(ep: str | None, pipeline: str, token: str) -> Iterator[None]:
    """`token` kept for `pipeline`'s other processes (0600 in a 0700 directory) while the
    block runs (nothing without a daemon endpoint)."""
    if not ep:
        yield
        return
    path = owner_file(ep, pipeline)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def find_owner(ep: str | None, pipeline: str) -> str:
    """This process's owner token for `pipeline`: $JIGSAW_OWNER, else the one its `jigsaw run`
    keeps beside the daemon's socket, else "" (a pipeline of its own)."""
    if token := os.environ.get(ENV_OWNER):
        return token
    if not ep:
        return ""
    try:
        return owner_file(ep, pipeline).read_text().strip()
    except (OSError, ValueError):
        return ""


def traces_dir(directory: Path | None = None) -> Path:
    """Where daemons write their traces by default (created 0700 on demand)."""
    return (directory or runtime_dir()) / "traces"


def new_trace_path(directory: Path | None = None) -> Path:
    """A fresh trace file name for a daemon starting now."""
    path = traces_dir(directory)
    path.mkdir(mode=0o700, exist_ok=True)
    return path / f"daemon-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"


def latest_trace(directory: Path | None = None) -> Path | None:
    """The most recently written daemon trace in the runtime directory, or None."""
    try:
        traces = list(traces_dir(directory or runtime_dir(create=False)).glob("daemon-*.jsonl"))
    except (OSError, ValueError):
        return None
    return max(traces, key=lambda p: p.stat().st_mtime, default=None)
