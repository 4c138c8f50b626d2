"""Protocol: schema validation, and a daemon that survives strangers (hypothesis fuzz, other uid)."""

import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
from fuzzing import CLASSES, Prober, Raw, encode, payloads, str8
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nodes import ask
from test_runtime import Node

from jigsaw import protocol as pr
from jigsaw.runtime.paths import check_private, runtime_dir


def test_requests_round_trip_and_bad_ones_say_why():
    m = pr.Admit(session="s", kind="training", dp_rank=1, step=2, req=9)
    assert pr.decode_request(pr.encode(m)) == m
    cases = {
        b"\xc1": "bad-message",  # not msgpack
        msgspec.msgpack.encode({"type": "admit", "session": 1}): "bad-message",
        msgspec.msgpack.encode({"type": "nope"}): "bad-message",
        msgspec.msgpack.encode({"type": "status", "v": 99}): "version",
        msgspec.msgpack.encode({"type": "status", "x": 1}): "bad-message",  # unknown field
        msgspec.msgpack.encode({"type": "ok"}): "bad-message",  # a reply is not a request
        b"\x00" * (pr.MAX_MESSAGE_BYTES + 1): "too-large",
    }
    for data, code in cases.items():
        with pytest.raises(pr.ProtocolError) as exc:
            pr.decode_request(data)
        assert exc.value.code == code, (data[:20], exc.value)


def test_runtime_dir_must_be_private(tmp_path, monkeypatch):
    d = tmp_path / "rt"
    monkeypatch.setenv("JIGSAW_RUNTIME_DIR", str(d))
    assert stat.S_IMODE(os.stat(runtime_dir()).st_mode) == 0o700
    d.chmod(0o755)
    with pytest.raises(ValueError, match="must be 0700"):
        check_private(d)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    n = Node(tmp_path_factory.mktemp("fuzz"))
    n.start()
    yield n
    n.stop()


def _still_serving(node: Node) -> None:
    assert node.daemon.poll() is None
    assert isinstance(ask(node.ep, pr.encode(pr.Status(req=1))), pr.StatusReply)


@pytest.fixture(scope="module")
def prober(daemon):
    p = Prober(daemon.ep)
    yield p
    p.close()


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_every_message_class_gets_a_reply_and_the_daemon_stays_healthy(prober, data):
    cls, payload = data.draw(payloads(prober.session), label="message")
    assert cls in CLASSES
    problem = prober.exchange(cls, payload)
    assert not problem, (cls, payload[:80], problem)
    assert not (sick := prober.healthy()), (cls, payload[:80], sick)


def _answer_to(path: Path, data: bytes) -> bytes:
    """Everything the daemon wrote back to `data` on a connection of its own until it closed
    it.  A message refused by its length is answered and closed without its body being read,
    so sending the rest may fail (a broken pipe, under load): the answer is there all the same."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    try:
        s.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass
    got = b""
    try:
        while chunk := s.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass
    finally:
        s.close()
    return got


def test_oversized_messages_are_refused_from_their_length_and_the_daemon_keeps_serving(daemon):
    sock = daemon.dir / "daemon.sock"
    whole = _answer_to(sock, struct.pack("!I", pr.MAX_MESSAGE_BYTES + 1) + b"\x00" * (pr.MAX_MESSAGE_BYTES + 1))
    assert pr.decode_reply(whole[4:]).code == "too-large"  # answered, then closed
    announced = _answer_to(sock, struct.pack("!I", 2**32 - 1))  # announces 4 GiB, sends none of it
    assert pr.decode_reply(announced[4:]).code == "too-large"
    _still_serving(daemon)
    before = daemon.status().errors
    future = msgspec.msgpack.encode({"type": "status", "v": pr.PROTOCOL_VERSION + 1})
    assert isinstance(ask(daemon.ep, future), pr.Error)
    assert daemon.status().errors == before + 1


NOBODY = """
import sys, os
from jigsaw import protocol as pr
from jigsaw.runtime.wire import Channel
os.setgid(65534); os.setuid(65534)
s = Channel(sys.argv[1][len("ipc://"):])
try:
    s.send(pr.encode(pr.Status(req=1)))
except OSError as exc:
    print("no-reply"); sys.exit()
print(type(r := pr.decode_reply(s.recv())).__name__, getattr(r, "code", "")) if s.poll(1500) else print("no-reply")
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")
def test_a_peer_of_another_uid_is_refused(daemon):
    def run(ep):
        return subprocess.run([sys.executable, "-c", NOBODY, ep], capture_output=True, text=True, timeout=30)

    assert run(daemon.ep).stdout.split() == ["no-reply"]  # the 0700 directory keeps it out
    # Past the file-system guard (a world-writable link to the socket), SO_PEERCRED still refuses it.
    pub = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        pub.chmod(0o755)
        link = pub / "s.sock"
        os.link(daemon.dir / "daemon.sock", link)
        link.chmod(0o666)
        before = daemon.status().refused
        out = run(f"ipc://{link}")
        assert out.stdout.split() == ["Error", "refused"], out.stderr
        assert daemon.status().refused == before + 1
    finally:
        (daemon.dir / "daemon.sock").chmod(0o600)
        for f in pub.iterdir():
            f.unlink()
        pub.rmdir()
    _still_serving(daemon)


def _enc(value) -> bytes:
    return msgspec.msgpack.encode(value)


V = pr.PROTOCOL_VERSION
HOSTILE = {  # one message per class that used to kill the daemon or poison its state
    "invalid utf-8 in a string": encode({"type": "register", "v": V, "pipeline": str8(b"\xff\xfe"), "pid": 1}),
    "nested past the recursion limit": encode({"type": "status", "v": V, "extra": Raw(b"\x91" * 60_000 + b"\xc0")}),
    "a name holding the id separator": _enc({"type": "register", "v": pr.PROTOCOL_VERSION, "pipeline": "a/b",
                                             "pid": 1}),
    "a step past any counter": _enc({"type": "admit", "v": pr.PROTOCOL_VERSION, "session": "s", "kind": "training",
                                     "dp_rank": 0, "step": 2**64 - 1}),
    "memory no device has": _enc({"type": "admit", "v": pr.PROTOCOL_VERSION, "session": "s", "kind": "training",
                                  "dp_rank": 0, "step": 0, "mem_bytes": 2**62}),
    "a NaN batch": _enc({"type": "done", "v": pr.PROTOCOL_VERSION, "session": "s", "substage": "x",
                         "batch_size": float("nan")}),
    "an infinite sequence": _enc({"type": "done", "v": pr.PROTOCOL_VERSION, "session": "s", "substage": "x",
                                  "seq_len": float("inf")}),
    "an absurd batch": _enc({"type": "done", "v": pr.PROTOCOL_VERSION, "session": "s", "substage": "x",
                             "batch_size": 1e30}),
    "a negative rank": _enc({"type": "opened", "v": pr.PROTOCOL_VERSION, "session": "s", "kind": "training",
                             "dp_rank": -1, "step": 0, "reason": "lost"}),
}


@pytest.mark.parametrize("data", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_values_are_refused_at_the_edge(data):
    with pytest.raises(pr.ProtocolError) as err:  # and nothing but a ProtocolError
        pr.decode_request(data)
    assert err.value.code == "bad-message"


def test_the_daemon_answers_every_hostile_class_and_keeps_serving(daemon):
    for name, data in HOSTILE.items():
        reply = ask(daemon.ep, data)
        assert isinstance(reply, pr.Error) and reply.code == "bad-message", name
        _still_serving(daemon)


def test_pipeline_names_are_checked_where_they_are_made():
    assert pr.check_name("grpo-7b_run.2+a") == "grpo-7b_run.2+a"
    for bad in ("a/b", "", "-lead", "x" * 65, "sp ace", "ü"):
        with pytest.raises(ValueError, match="not valid"):
            pr.check_name(bad)
    assert pr.check_name(pr.safe_name("/usr/bin/my script-123")) == "usr-bin-my-script-123"
