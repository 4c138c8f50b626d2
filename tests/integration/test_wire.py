"""The daemon's transport on its own: whole messages, bounded buffers, replies by connection."""

import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path

import pytest

from jigsaw.runtime.wire import Channel, ChannelError, Listener, frame

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
