"""Length-prefixed messages over a Unix stream socket: the daemon's listener, a client's channel.

    client Channel ── [4-byte big-endian length][msgpack request] ──► Listener (daemon)
                   ◄─ [4-byte big-endian length][msgpack reply]  ───
    Listener: accept ─► SO_PEERCRED uid (a stranger's first message, never decoded, gets a
              `refused` reply, then the door) ─► per connection, bytes buffered only up to
              one message: a header that announces more than MAX_MESSAGE_BYTES gets a
              `too-large` reply and the connection is closed before any of its body is read

Why not ZeroMQ: a ZeroMQ socket assembles a whole multipart message before it hands over the
first frame, so a peer can make the daemon hold any number of frames before a check runs.
Here the daemon never holds more than one message per connection, and a message is one
frame by construction.  Connections are the routing identity of replies (an int).
"""

from __future__ import annotations

import errno
import itertools
import os
import selectors
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HEADER = struct.Struct("!I")
MAX_CONNECTIONS = 1024
"""Connections the listener holds (each holds at most one message).  At the limit a new
one takes the place of the connection idle longest, or is closed at once when none is idle."""
MAX_PER_PROCESS = 64
"""Connections one peer process may hold once half the places are taken (a client uses two;
a process with many clients is fine while there is room): one process cannot take the
places of every other pipeline, `jigsaw run` and `jigsaw daemon status`."""
IDLE_S = 30.0
"""A connection that sent nothing this long may give its place to a new one (only then: a
worker's main socket is idle through a long sub-stage, and that is fine)."""
PARTIAL_S = 5.0
"""A message begun and not finished within this long closes its connection (a client
writes a message whole, in one call)."""
SEND_TIMEOUT_S = 5.0
"""A client's send blocks at most this long (the daemon not reading counts as unreachable)."""
MAX_OUTBOX_BYTES = 1 << 20
"""Replies queued for a peer that does not read; past this the peer is dropped."""
READ_PAUSE_BYTES = 16 << 10
"""Replies queued for a peer past this: its requests are not read until it reads (a peer
that floods requests and never reads holds one reply's worth of the daemon's memory)."""


class ChannelError(OSError):
    """The daemon cannot be reached (not there, went away, or refused the connection)."""


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: pid, uid, gid)."""
    return peer(sock)[1]


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


class _Conn:
    __slots__ = ("sock", "inbox", "outbox", "closing", "stranger", "last_words", "pid", "heard_s", "begun_s")

    def __init__(self, sock: socket.socket, stranger: bool, pid: int, now_s: float):
        self.sock, self.inbox, self.outbox, self.closing = sock, bytearray(), bytearray(), False
        self.stranger = stranger
        """Another uid: its first message is answered with the refusal, then the door."""
        self.pid = pid
        self.heard_s = now_s
        """When it connected or last finished a message (idle since)."""
        self.begun_s: float | None = None
        """When the message in `inbox` began (None: none begun)."""
        self.last_words: bytes | None = None
        """Nothing more is read; this goes out, and the door closes, once the messages the
        peer sent before it (in the same write, say) are served and their replies queued."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """What one peer may hold of the listener (the module's constants; tests shrink them)."""

    max_connections: int = MAX_CONNECTIONS
    per_process: int = MAX_PER_PROCESS
    idle_s: float = IDLE_S
    partial_s: float = PARTIAL_S


class Listener:
    """The daemon's end: bind, accept, read whole messages, send replies by connection id.

    `poll` waits for activity; `read` returns `(conn, payload, arrived_s)` for every complete
    message (up to `most`), stamped by `clock` when its last byte was read (a message may
    wait here behind others: a lease goes by when it came), answering on its own what never
    becomes a message: a stranger's connection (`refuse()` builds its reply) and an oversized
    header (`too_large(n)`)."""

    def __init__(self, path: Path, max_bytes: int, refuse: Callable[[], bytes], too_large: Callable[[int], bytes],
                 clock: Callable[[], float] = time.monotonic, limits: Limits = Limits()):
        self.path, self.max_bytes, self.refuse, self.too_large = path, max_bytes, refuse, too_large
        self.clock, self.limits = clock, limits
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if path.is_socket():
                path.unlink()  # a dead daemon's (the lock says no live daemon holds this directory)
            self.sock.bind(str(path))
            os.chmod(path, 0o600)
            self.sock.listen(128)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.conns: dict[int, _Conn] = {}
        self.refused = 0
        self._ready: list[tuple[int, bytes, float]] = []
        self._hanging: set[int] = set()
        """Connections with last words to say (see _Conn.last_words)."""
        self._per_pid: dict[int, int] = {}
        self._swept_s = 0.0
        self._ids = itertools.count(1)

    def poll(self, timeout_ms: int) -> bool:
        """Whether a message is ready, waiting up to `timeout_ms` for one."""
        deadline = time.monotonic() + timeout_ms / 1e3
        while not self._ready:
            self._hang_up()
            self._sweep()
            for key, events in self.sel.select(timeout=max(0.0, deadline - time.monotonic())):
                if key.data is None:
                    self._accept()
                else:
                    self._io(key.data, events)
            if time.monotonic() >= deadline:
                break
        return bool(self._ready)

    def read(self, most: int) -> list[tuple[int, bytes, float]]:
        self.poll(0)
        out, self._ready = self._ready[:most], self._ready[most:]
        return out

    def _hang_up(self) -> None:
        """Say the last words of connections none of whose messages still wait to be read."""
        if not self._hanging:
            return
        waiting = {conn for conn, _, _ in self._ready}
        for conn in self._hanging - waiting:
            self._hanging.discard(conn)
            c = self.conns.get(conn)
            if c is not None:
                words, c.last_words = c.last_words, None
                self._say_and_close(conn, c, words)

    def send(self, conn: int, payload: bytes) -> bool:
        c = self.conns.get(conn)
        if c is None:
            return False  # it went away; it will ask again
        c.outbox += frame(payload)
        self._flush(conn, c)
        return True

    def peer_pid(self, conn: int) -> int | None:
        """The pid of the process at the other end of `conn` (None: it went away)."""
        c = self.conns.get(conn)
        return None if c is None else c.pid

    def close(self) -> None:
        for conn in list(self.conns):
            self._drop(conn)
        self.sel.close()
        self.sock.close()
        try:
            self.path.unlink()
        except OSError:
            pass

    # ------------------------------------------------------------ inside

    def _accept(self) -> None:
        for _ in range(64):
            try:
                s, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the peer waits in the backlog
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    return
                raise
            s.setblocking(False)
            pid, uid = peer(s)
            if not self._room_for(pid):
                s.close()
                continue
            conn = next(self._ids)  # never reused: a late reply cannot reach a newer peer on the same fd
            self.conns[conn] = _Conn(s, stranger=uid != os.getuid(), pid=pid, now_s=time.monotonic())
            self._per_pid[pid] = self._per_pid.get(pid, 0) + 1
            self.sel.register(s, selectors.EVENT_READ, conn)

    def _room_for(self, pid: int) -> bool:
        """Whether a new connection of process `pid` gets a place (the one idle longest, if
        every place is taken)."""
        lim = self.limits
        if self._per_pid.get(pid, 0) >= lim.per_process and len(self.conns) >= lim.max_connections // 2:
            return False
        if len(self.conns) < lim.max_connections:
            return True
        now = time.monotonic()
        idle = min(self.conns.items(), key=lambda kv: kv[1].heard_s if kv[1].begun_s is None else now)
        if now - idle[1].heard_s < lim.idle_s or idle[1].begun_s is not None:
            return False
        self._drop(idle[0])
        return True

    def _sweep(self) -> None:
        """Close connections whose message stalled half-way (at most once a second)."""
        now = time.monotonic()
        if now - self._swept_s < min(1.0, self.limits.partial_s / 4):
            return
        self._swept_s = now
        for conn, c in list(self.conns.items()):
            if c.begun_s is not None and now - c.begun_s > self.limits.partial_s:
                self._drop(conn)

    def _io(self, conn: int, events: int) -> None:
        c = self.conns.get(conn)
        if c is None:
            return
        if events & selectors.EVENT_WRITE:
            self._flush(conn, c)
        if events & selectors.EVENT_READ and conn in self.conns and not c.closing and len(c.outbox) <= READ_PAUSE_BYTES:
            self._receive(conn, c)

    def _receive(self, conn: int, c: _Conn, most: int = 8) -> None:
        """Read what fits in the current message (never past it) and cut out whole ones; at
        most `most` per turn, so one busy peer cannot starve the others."""
        for _ in range(most * 2):
            if len(c.inbox) >= HEADER.size:
                n = HEADER.unpack_from(c.inbox)[0]
                if n > self.max_bytes:  # what it sent before is still served and answered
                    c.closing, c.last_words = True, self.too_large(n)
                    self._hanging.add(conn)
                    return None
                if len(c.inbox) == HEADER.size + n and c.stranger:  # never decoded, never served
                    self.refused += 1
                    return self._say_and_close(conn, c, self.refuse())
                if len(c.inbox) == HEADER.size + n:
                    self._ready.append((conn, bytes(c.inbox[HEADER.size:]), self.clock()))
                    c.inbox.clear()
                    c.heard_s, c.begun_s = time.monotonic(), None
                    if len(c.outbox) > READ_PAUSE_BYTES:
                        return None  # it does not read its replies: no more of its requests until it does
                    continue
                need = HEADER.size + n - len(c.inbox)
            else:
                need = HEADER.size - len(c.inbox)
            try:
                chunk = c.sock.recv(need)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return self._drop(conn)
            if not chunk:
                return self._drop(conn)
            if c.begun_s is None:
                c.begun_s = time.monotonic()
            c.inbox += chunk

    def _flush(self, conn: int, c: _Conn) -> None:
        try:
            while c.outbox:
                n = c.sock.send(c.outbox)
                del c.outbox[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return self._drop(conn)
        if len(c.outbox) > MAX_OUTBOX_BYTES:
            return self._drop(conn)
        if c.closing and not c.outbox and c.last_words is None:
            return self._drop(conn)
        reading = 0 if len(c.outbox) > READ_PAUSE_BYTES else selectors.EVENT_READ  # see READ_PAUSE_BYTES
        self.sel.modify(c.sock, reading | (selectors.EVENT_WRITE if c.outbox else 0), conn)

    def _say_and_close(self, conn: int, c: _Conn, payload: bytes) -> None:
        c.closing = True
        c.outbox += frame(payload)
        self._flush(conn, c)

    def _drop(self, conn: int) -> None:
        c = self.conns.pop(conn, None)
        if c is not None:
            self.sel.unregister(c.sock)
            c.sock.close()
            self._per_pid[c.pid] -= 1
            if not self._per_pid[c.pid]:
                del self._per_pid[c.pid]


class Channel:
    """A client's end: connects when it first sends (and again after the daemon went away);
    `send` raises ChannelError when the daemon cannot be reached, `poll` says whether a whole
    reply is there, `recv` returns it.  One thread per channel."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.sock: socket.socket | None = None
        self.inbox = bytearray()

    def send(self, payload: bytes, *more: bytes) -> None:
        """One message, or several in one write: they reach the daemon in one read, so it
        decides once they are all there (the members of a gang)."""
        if self.sock is None:
            self._connect()
        try:
            self.sock.settimeout(SEND_TIMEOUT_S)
            self.sock.sendall(b"".join(frame(p) for p in (payload, *more)))
        except OSError as exc:
            self.close()
            raise ChannelError(exc.errno, f"jigsaw daemon at {self.path}: {exc.strerror or exc}") from None

    @property
    def lost(self) -> bool:
        """The connection closed with no whole reply left to read: what was sent on it and not
        answered yet never will be (a daemon that died, or a new one, has not read it)."""
        return self.sock is None and not self._whole()

    def poll(self, timeout_ms: int) -> bool:
        """Whether a whole reply is here, waiting up to `timeout_ms` for one."""
        deadline = time.monotonic() + timeout_ms / 1e3
        while not self._whole():
            left = deadline - time.monotonic()
            if self.sock is None:  # gone: nothing will come; wait out the caller's timeout
                time.sleep(max(0.0, left))
                return False
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                return False
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                return False
            self.inbox += chunk
        return True

    def recv(self) -> bytes:
        """The next reply (after `poll` said it is here; otherwise waits up to a minute)."""
        if not self._whole() and not self.poll(60_000):
            raise ChannelError(errno.ETIMEDOUT, "no reply from the jigsaw daemon")
        n = HEADER.unpack_from(self.inbox)[0]
        payload = bytes(self.inbox[HEADER.size:HEADER.size + n])
        del self.inbox[:HEADER.size + n]
        return payload

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.inbox.clear()

    def _connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.path)
        except OSError as exc:
            s.close()
            raise ChannelError(exc.errno, f"jigsaw daemon at {self.path}: {exc.strerror}") from None
        self.sock = s

    def _whole(self) -> bool:
        return len(self.inbox) >= HEADER.size and len(self.inbox) >= HEADER.size + HEADER.unpack_from(self.inbox)[0]
