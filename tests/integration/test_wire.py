"""The daemon's transport on its own: whole messages, bounded buffers, replies by connection."""

import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from waiting import wait_until

from jigsaw.runtime.wire import READ_PAUSE_BYTES, Channel, ChannelError, Limits, Listener, frame

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def listener(tmp_path):
    lst = Listener(tmp_path / "s.sock", 1024, refuse=lambda: b"refused", too_large=lambda n: b"too-large %d" % n)
    yield lst
    lst.close()


def serve(lst: Listener, want: int, timeout_ms: int = 2000) -> list[tuple[int, bytes]]:
    got = []
    while len(got) < want and lst.poll(timeout_ms):
        got += lst.read(64)
    return got


def test_messages_come_whole_however_the_bytes_arrive(listener, tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(tmp_path / "s.sock"))
    data = frame(b"first") + frame(b"") + frame(b"x" * 1000)
    got = []
    for i in range(0, len(data), 7):  # in pieces that cut headers and bodies
        s.sendall(data[i:i + 7])
        listener.poll(10)
        got += listener.read(64)
    got += serve(listener, 3 - len(got))
    assert [m for _, m, _ in got] == [b"first", b"", b"x" * 1000]
    s.close()


def test_a_length_past_the_limit_is_answered_and_closed_before_its_body(listener, tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(tmp_path / "s.sock"))
    s.sendall(struct.pack("!I", 1025) + b"y" * 512)
    assert not listener.poll(200)  # nothing became a message
    assert all(len(c.inbox) <= 4 + 1024 for c in listener.conns.values())
    assert s.recv(100) == frame(b"too-large 1025")
    try:
        assert s.recv(1) == b""  # closed ...
    except ConnectionResetError:
        pass  # ... with the rest of the body unread
    assert not listener.conns


def test_replies_go_by_connection_and_a_closed_ones_never_reach_a_newer_peer(listener, tmp_path):
    a, b = Channel(tmp_path / "s.sock"), Channel(tmp_path / "s.sock")
    a.send(b"from a")
    b.send(b"from b")
    got = dict((m, c) for c, m, _ in serve(listener, 2))
    assert listener.send(got[b"from b"], b"to b") and listener.send(got[b"from a"], b"to a")
    assert a.recv() == b"to a" and b.recv() == b"to b"
    a.close()
    listener.poll(100)  # the daemon sees it go
    c = Channel(tmp_path / "s.sock")  # may get a's file descriptor
    c.send(b"from c")
    serve(listener, 1)
    assert not listener.send(got[b"from a"], b"late reply to a")  # a is gone: nobody gets it
    assert not c.poll(200)


def test_a_channel_without_a_daemon_says_so(tmp_path):
    with pytest.raises(ChannelError):
        Channel(tmp_path / "none.sock").send(b"hello")


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_a_stranger_is_answered_with_the_refusal_and_never_served():
    public = Path(tempfile.mkdtemp(dir="/tmp"))
    public.chmod(0o755)
    listener = Listener(public / "s.sock", 1024, refuse=lambda: b"refused", too_large=lambda n: b"")
    os.chmod(public / "s.sock", 0o666)
    pid = os.fork()
    if pid == 0:  # the stranger
        try:
            os.setgid(65534)
            os.setuid(65534)
            ch = Channel(public / "s.sock")
            ch.send(b"let me in")
            os._exit(0 if ch.recv() == b"refused" else 1)
        except BaseException:
            os._exit(2)
    try:
        while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            assert not listener.poll(50)  # its message never becomes one the daemon serves
        assert os.waitstatus_to_exitcode(done[1]) == 0 and listener.refused == 1
    finally:
        listener.close()
        shutil.rmtree(public)


def test_messages_before_an_oversized_header_in_the_same_write_get_their_replies(listener, tmp_path):
    """They were served, but the door closed before their replies went out."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(tmp_path / "s.sock"))
    s.sendall(frame(b"one") + frame(b"two") + struct.pack("!I", 1025) + b"y" * 64)
    got = serve(listener, 2)
    assert [m for _, m, _ in got] == [b"one", b"two"]
    for conn, m, _ in got:
        assert listener.send(conn, b"re " + m)
    listener.poll(50)  # the loop turns: now the last words, and the door
    replies = b""
    while True:
        try:
            chunk = s.recv(1 << 16)
        except ConnectionResetError:
            break
        if not chunk:
            break
        replies += chunk
    assert replies == frame(b"re one") + frame(b"re two") + frame(b"too-large 1025")
    assert not listener.conns


def test_a_message_is_stamped_when_it_came_not_when_the_daemon_took_it(tmp_path):
    """Sessions heartbeating over one connection lost their lease: a beat that waited in the
    listener's queue behind others was dated when the daemon got round to it."""
    now = [1.0]
    lst = Listener(tmp_path / "s.sock", 1024, refuse=lambda: b"", too_large=lambda n: b"", clock=lambda: now[0])
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(tmp_path / "s.sock"))
        s.sendall(b"".join(frame(b"beat %d" % i) for i in range(3)))
        while len(lst._ready) < 3:
            assert lst.poll(2000)
        now[0] = 9.0  # a long decision later, the daemon reads them one by one
        got = lst.read(1) + lst.read(1) + lst.read(1)
        assert [(m, t) for _, m, t in got] == [(b"beat 0", 1.0), (b"beat 1", 1.0), (b"beat 2", 1.0)]
        s.close()
    finally:
        lst.close()


# ------------------------------------------------------------------ issue 31, items 5 and 6: fairness

SMALL = Limits(max_connections=16, per_process=4, idle_s=0.5, partial_s=0.3)


def _small(tmp_path) -> Listener:
    return Listener(tmp_path / "s.sock", 1024, refuse=lambda: b"", too_large=lambda n: b"", limits=SMALL)


def _connect(tmp_path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(tmp_path / "s.sock"))
    return s


def _another_process_is_served(lst: Listener, tmp_path) -> bool:
    """A message from a fresh process (a `jigsaw daemon status`, a new pipeline) is read."""
    code = ("import socket, struct, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
            "s.sendall(struct.pack('!I', 5) + b'hello'); s.settimeout(5); sys.exit(s.recv(64) == b'')")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "s.sock")])
    deadline = time.monotonic() + 10
    hello = None
    while hello is None and time.monotonic() < deadline:
        hello = next((conn for conn, m, _ in lst.read(64) if m == b"hello"), None) if lst.poll(50) else None
    if hello is not None:
        lst.send(hello, b"ok")
    while proc.poll() is None and time.monotonic() < deadline:
        lst.poll(20)
    return hello is not None and proc.wait(10) == 0


def test_one_process_cannot_take_every_place(tmp_path):
    """1,023 idle connections of one local process locked every new client out."""
    lst = _small(tmp_path)
    mine = []
    try:
        for _ in range(SMALL.max_connections):
            mine.append(_connect(tmp_path))
            lst.poll(5)
        assert len(lst.conns) == SMALL.max_connections // 2  # past half, a process keeps its share
        assert _another_process_is_served(lst, tmp_path)
    finally:
        for s in mine:
            s.close()
        lst.close()


def test_a_message_begun_and_never_finished_closes_its_connection(tmp_path):
    """Slow senders held places for ever (2,040 of them: 220 of 223 status probes unanswered)."""
    lst = _small(tmp_path)
    try:
        slow = _connect(tmp_path)
        slow.sendall(struct.pack("!I", 100) + b"half")
        wait_until(lambda: lst.poll(20) or not lst.conns, 10, "the slow sender closed")
        assert slow.recv(1) == b""
        assert _another_process_is_served(lst, tmp_path)
    finally:
        lst.close()


def test_when_every_place_is_taken_the_idlest_connection_gives_its_place(tmp_path):
    lst = Listener(tmp_path / "s.sock", 1024, refuse=lambda: b"", too_large=lambda n: b"",
                   limits=Limits(max_connections=4, per_process=100, idle_s=0.2, partial_s=5))
    try:
        idle = [_connect(tmp_path) for _ in range(4)]
        wait_until(lambda: lst.poll(5) or len(lst.conns) == 4, 10, "four connections")
        time.sleep(0.3)  # the condition under test is idleness itself: the connections must be 0.2 s old
        assert _another_process_is_served(lst, tmp_path)
        for s in idle:
            s.close()
    finally:
        lst.close()


def test_a_peer_that_floods_requests_and_never_reads_is_not_read_until_it_does(tmp_path):
    """200 peers flooding Status without reading raised the daemon's RSS from 90 to 233 MB."""
    lst = _small(tmp_path)
    try:
        s = _connect(tmp_path)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(0.01)
        served = 0
        for _ in range(400):  # each answered with 4 KiB it never reads
            try:
                s.sendall(frame(b"status") * 16)
            except (TimeoutError, BlockingIOError):
                pass
            for conn, _, _ in lst.read(64) if lst.poll(5) else []:
                lst.send(conn, b"r" * 4096)
                served += 1
        (c,) = lst.conns.values()
        assert len(c.outbox) <= READ_PAUSE_BYTES + 64 * 4100  # at most one read's replies past the pause
        assert served < 400 * 16
        assert _another_process_is_served(lst, tmp_path)
        s.close()
    finally:
        lst.close()
