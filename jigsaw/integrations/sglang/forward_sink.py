"""Receiving end of the per-forward counts that the SGLang plugin sends from each scheduler.

    SGLang scheduler (tp_rank 0)                    process hosting the rollout server
    plugin.ForwardReporter ── encode_record() ──►  <directory>/forward.sock (AF_UNIX, SOCK_DGRAM)
       40-byte datagram, dropped when no one          │  ForwardSink thread: recv, decode_record()
       reads or the socket buffer is full             ▼
                                                    on_forward(replica, prefill_tokens, decode_reqs)

A datagram is one whole record, so the reader needs no framing and a lost record costs one forward's
counts, never the stream. The reporter numbers its records; a jump in the number is counted in
`gaps`, which is how the receiving side learns that the sender dropped some.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAGIC = b"JGF1"
# magic, replica, seq, prefill_tokens, decode_reqs, t_mono_s
RECORD = struct.Struct("<4siQqqd")
SOCK_NAME = "forward.sock"
# sockaddr_un.sun_path is 108 bytes on Linux, and the kernel wants room for the trailing NUL.
MAX_SOCK_PATH_BYTES = 107


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardRecord:
    replica: int
    seq: int
    prefill_tokens: int
    decode_reqs: int
    t_mono_s: float


def encode_record(*, replica: int, seq: int, prefill_tokens: int, decode_reqs: int, t_mono_s: float) -> bytes:
    return RECORD.pack(MAGIC, replica, seq, prefill_tokens, decode_reqs, t_mono_s)


def decode_record(data: bytes) -> ForwardRecord:
    """One datagram's record; ValueError for anything that is not one a reporter could have sent."""
    if len(data) != RECORD.size:
        raise ValueError(f"record is {len(data)} bytes, want {RECORD.size}")
    magic, replica, seq, prefill_tokens, decode_reqs, t_mono_s = RECORD.unpack(data)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    if prefill_tokens < 0 or decode_reqs < 0 or not math.isfinite(t_mono_s):
        raise ValueError(f"impossible counts ({prefill_tokens}, {decode_reqs}, {t_mono_s})")
    return ForwardRecord(replica=replica, seq=seq, prefill_tokens=prefill_tokens, decode_reqs=decode_reqs,
                         t_mono_s=t_mono_s)


OnForward = Callable[[int, int, int], None]


class ForwardSink:
    """Binds `<directory>/forward.sock` and calls `on_forward` from a daemon thread, one call per record.

    `on_forward` runs on the sink's thread: keep it short and thread-safe (append to a queue). An exception
    in it is logged and counted in `callback_errors`; a datagram that is not a record is counted in
    `malformed`. Neither stops the thread.
    """

    def __init__(self, directory: str | os.PathLike[str], on_forward: OnForward, *, poll_s: float = 0.05,
                 rcvbuf_bytes: int = 1 << 20) -> None:
        self.path = os.path.join(os.fspath(directory), SOCK_NAME)
        if len(os.fsencode(self.path)) > MAX_SOCK_PATH_BYTES:
            raise ValueError(f"socket path {self.path!r} is longer than AF_UNIX allows ({MAX_SOCK_PATH_BYTES} bytes); "
                             "use a shorter directory")
        self._on_forward = on_forward
        self.received = self.malformed = self.callback_errors = self.gaps = 0
        self._last_seq: dict[int, int] = {}
        self._stop = threading.Event()
        _unlink_stale_socket(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            # A burst of short forwards must fit while the thread is descheduled; the kernel caps the value.
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
            self._sock.bind(self.path)
            # recv wakes at least every poll_s, so close() needs no wake-up datagram.
            self._sock.settimeout(poll_s)
        except BaseException:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._run, name="jigsaw-forward-sink", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(RECORD.size + 1)  # +1: an oversized datagram shows as too long
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                logger.exception("forward sink: recv failed; stopping")
                return
            self._handle(data)

    def _handle(self, data: bytes) -> None:
        try:
            rec = decode_record(data)
        except ValueError:
            self.malformed += 1
            return
        self.received += 1
        last = self._last_seq.get(rec.replica)
        if last is not None and rec.seq > last + 1:
            self.gaps += rec.seq - last - 1
        self._last_seq[rec.replica] = rec.seq  # a smaller seq is a restarted scheduler: start over
        try:
            self._on_forward(rec.replica, rec.prefill_tokens, rec.decode_reqs)
        except Exception:
            self.callback_errors += 1
            logger.exception("forward sink: on_forward raised; record dropped")

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, deadline_s: float = 1.0) -> bool:
        """Stop the thread, close and remove the socket; True if the thread ended within `deadline_s`."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(deadline_s)
        stopped = not self._thread.is_alive()
        self._sock.close()
        _unlink_stale_socket(self.path)
        return stopped

    def __enter__(self) -> ForwardSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink_stale_socket(path: str) -> None:
    # Only a socket is ours to remove: a regular file of that name is someone else's mistake, so bind fails loudly.
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
