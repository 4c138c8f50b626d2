"""The grant board: how a worker process learns the grant its pipeline's client holds for it.

    client (pipeline driver)                         worker process (rollout DP rank, trainer rank)
      bind at admission / budget change                 before each forward / micro-batch:
        post(board, pid, Posting(partition,  ───────►     Follower(board).current() ─► Posting
             mem_bytes, micro_batch))   <board>/<pid>       (re-read only when the file changed)
      close: withdraw(board, pids)                          Follower.stream() ─► its own Binder binds
                                                            a Green side here ─► on_stream(stream)

A CPU partition can be imposed from outside (affinity is settable per thread by anyone of the
same uid); a green context, a KV pool or a micro-batch size cannot: only the process that
launches the work can apply them.  So the client writes each worker's grant to a file named
by its pid in the board, a 0700 directory of the per-user runtime directory, atomically
(write + rename), and the worker reads it when it changed (one stat per forward).  A posting
is plain data (msgspec), never code.  No posting (no daemon, or the client is gone): the
whole device, as fail-open grants are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from jigsaw.mux.partition.partitioners import Partition

log = logging.getLogger("jigsaw.board")


class Posting(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One worker's current grant."""

    partition: Partition | None = None
    """What to run on; None: the whole device (exclusive, fell open)."""
    mem_bytes: int = 0
    """Device memory granted; 0: not stated (the engine keeps what it has)."""
    micro_batch: int | None = None
    """The replica's share of its gang's batch (schedule._balanced); None: its own split."""


_DECODER = msgspec.json.Decoder(Posting)


def post(board: Path, pid: int, posting: Posting) -> None:
    """Write `posting` for process `pid` (atomically: a reader sees the old or the new one)."""
    board.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = board / f".{pid}.{os.getpid()}.{threading.get_ident()}"
    tmp.write_bytes(msgspec.json.encode(posting))
    os.replace(tmp, board / str(pid))


def withdraw(board: Path, pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            (board / str(pid)).unlink()


class Follower:
    """A worker's view of its posting, and the stream it runs on (one per process)."""

    def __init__(self, board: Path | str | None, pid: int | None = None, device: int = 0):
        self.path = None if board is None else Path(board) / str(pid or os.getpid())
        self.device = device
        self._seen: tuple[int, int] | None = None
        self._posting: Posting | None = None
        self._binder = None
        self._stream: Any = None
        self._lock = threading.Lock()

    def current(self) -> Posting | None:
        """The posting now (None: none, the whole device); re-read only when its file changed.
        A malformed posting is refused loudly: the worker keeps the last good one."""
        if self.path is None:
            return None
        with self._lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                self._seen, self._posting, self._stream = None, None, None
                return None
            key = (st.st_ino, st.st_mtime_ns)
            if key != self._seen:
                self._seen = key
                try:
                    posting = _DECODER.decode(self.path.read_bytes())
                except (msgspec.DecodeError, OSError) as exc:
                    log.error("grant posting %s refused, keeping the last one: %s", self.path, exc)
                    return self._posting
                self._posting, self._stream = posting, self._bind(posting.partition)
            return self._posting

    def stream(self) -> Any:
        """The stream of the posted partition (a Green side's), or None (the current stream)."""
        self.current()
        return self._stream

    def _bind(self, partition: Partition | None) -> Any:
        from jigsaw.mux.partition.partitioners import Green

        if not isinstance(partition, Green):
            return None  # CPU cores are set from outside; advisory and exclusive change nothing here
        if self._binder is None:
            from jigsaw.mux.partition.bind import Binder

            self._binder = Binder(self.device)
        return self._binder.bind(partition).stream

    def close(self) -> None:
        if self._binder is not None:
            self._binder.close()


__all__ = ["Follower", "Posting", "post", "withdraw"]
