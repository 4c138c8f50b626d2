"""Messages a stranger (or a broken client) might send the daemon, as hypothesis strategies,
and one exchange with a live daemon judged (shared by the fuzz test and bench/daemon_fuzz.py).

Classes covered, each named in `CLASSES`:
    bytes       not msgpack at all
    values      any msgpack value (nested lists and maps included)
    typed       a request tag with fields of any type
    hostile     each request type, every field drawn from valid values and from the values
                that used to kill the daemon or poison its state: invalid UTF-8, nesting past
                the recursion limit, names holding the id separator, NaN / infinities, 2^62
                bytes, 2^64-1 steps, negative ranks, unknown kinds, sub-stage ids of others
    session     the same, but sent with a session the daemon handed out (so what passes the
                edge reaches the node state); a Grant it earns is released with a Done
    framing     raw bytes on a connection of their own: length prefixes that lie (past the
                limit, past the end, zero), messages cut short, several in one write
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections import Counter

import msgspec
from hypothesis import strategies as st

from jigsaw import protocol as pr
from jigsaw.runtime.paths import socket_path
from jigsaw.runtime.wire import Channel, ChannelError, frame

TAGS = ["register", "heartbeat", "unregister", "admit", "done", "opened", "step_end", "status", "ok", "grant", "bogus"]
KINDS = ["rollout_prefill", "rollout_decode", "rollout_tail", "reference", "training", "reward", "tool", "juggling", ""]
V = pr.PROTOCOL_VERSION


class Raw(bytes):
    """Already-encoded msgpack (a value msgspec would refuse to write, e.g. invalid UTF-8)."""


def str8(raw: bytes) -> Raw:
    """A msgpack str whose bytes are `raw` (msgspec's encoder only writes valid UTF-8)."""
    return Raw(b"\xd9" + bytes([len(raw)]) + raw)


def encode(fields: dict) -> bytes:
    """A msgpack map; Raw values are spliced in as they are."""
    out = bytes([0x80 | len(fields)]) if len(fields) < 16 else b"\xde" + len(fields).to_bytes(2, "big")
    for k, v in fields.items():
        out += msgspec.msgpack.encode(k) + (bytes(v) if isinstance(v, Raw) else msgspec.msgpack.encode(v))
    return out


values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
                      | st.binary(max_size=20), lambda c: st.lists(c, max_size=4)
                      | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10)
typed = st.fixed_dictionaries({"type": st.sampled_from(TAGS)},
                              optional={"v": st.integers(-2, 5), "req": values, "session": values, "kind": values,
                                        "dp_rank": values, "step": values, "pipeline": values, "pid": values,
                                        "substage": values, "extra": values})

ints = st.sampled_from([0, 1, 2, 3, -1, 1 << 16, (1 << 16) + 1, 10**9, 10**9 + 1, 1 << 37, 1 << 50, 1 << 62,
                        2**64 - 1]) | st.integers(-2**63, 2**64 - 1)
floats = st.sampled_from([0.0, 1.0, 512.0, 1e9, 1e30, -1.0, float("nan"), float("inf"), float("-inf"), -0.0])
names = st.sampled_from(["fz", "fz-2", "a/b", "", "-x", "x" * 65, "ü", "fz/0/r0/training/0"]) | st.text(max_size=8)
bad_utf8 = st.sampled_from([b"\xff\xfe", b"\xc3", b"a\xed\xa0\x80"]).map(str8)
deep = st.integers(900, 60_000).map(lambda n: Raw(b"\x91" * n + b"\xc0"))
hostile_value = ints | floats | names | bad_utf8 | deep | st.booleans() | values

ok_kind = st.sampled_from(KINDS[:-2])
ok_amount = st.floats(0.0, 1e6)
ok_count = st.integers(0, 10**6)
VALID = {  # what a well-behaved client sends (on a 1-device node)
    "register": {"pipeline": st.sampled_from(["fz-b", "fz.c", "fz_d"]), "pid": st.integers(1, 1 << 22),
                 "devices": st.lists(st.just(0), max_size=1), "owner": st.sampled_from(["", "o1"])},
    "heartbeat": {},
    "unregister": {"pipeline_done": st.booleans()},
    "admit": {"kind": ok_kind, "dp_rank": st.just(0), "step": st.integers(0, 3), "mem_bytes": st.integers(0, 1 << 34),
              "urgent": st.booleans(), "pids": st.lists(st.integers(1, 1 << 22), max_size=3)},
    "done": {"substage": st.builds("fz/{}/r0/{}/0".format, st.integers(0, 3), ok_kind), "batch_size": ok_amount,
             "seq_len": ok_amount, "num_steps": ok_count, "num_tokens": ok_count, "flops": ok_amount,
             "final": st.booleans()},
    "opened": {"kind": ok_kind, "dp_rank": st.just(0), "step": st.integers(0, 3),
               "reason": st.sampled_from(["unreachable", "refused", "lost"]), "duration_s": ok_amount},
    "step_end": {"step": st.integers(0, 3), "tokens": ok_count, "samples": ok_count, "flops": ok_amount},
    "status": {},
}
HOSTILE = {  # per field, what used to kill the daemon or poison its state
    "pipeline": names | bad_utf8, "pid": ints, "devices": st.lists(ints, max_size=3), "owner": names | bad_utf8,
    "kind": st.sampled_from(KINDS) | bad_utf8, "dp_rank": ints, "step": ints, "mem_bytes": ints,
    "pids": st.lists(ints, max_size=3), "substage": names | bad_utf8, "batch_size": floats, "seq_len": floats,
    "num_steps": ints, "num_tokens": ints, "flops": floats, "reason": names, "duration_s": floats,
    "tokens": ints, "samples": ints, "session": names | bad_utf8 | deep,
}


ABSURD = {  # within every bound of the edge, and still nothing a real client sends
    "mem_bytes": st.integers(1 << 37, 1 << 50), "step": st.integers(5, 10**9), "dp_rank": st.integers(1, 1 << 16),
    "batch_size": st.floats(1e6, 1e9), "seq_len": st.floats(1e6, 1e9), "flops": st.floats(1e20, 1e30),
    "num_steps": st.integers(10**9, 10**15), "num_tokens": st.integers(10**9, 10**15),
    "duration_s": st.floats(1e6, 1e9),
    "substage": st.sampled_from(["fz-b/0/r0/training/0", "fz/0/r9/training/0", "fz/0/r0/training/7", "x"]),
    "kind": st.sampled_from(["juggling", "", "ROLLOUT_DECODE"]),
    "devices": st.lists(st.integers(1, 1 << 16), max_size=3),
    "pids": st.lists(st.integers(1, 1 << 22), min_size=100, max_size=4096),
}
REQUIRED = {"pipeline", "pid", "kind", "dp_rank", "step", "substage", "reason", "session"}
TYPES = ["admit", "admit", "admit", "done", "done", *sorted(VALID)]


@st.composite
def hostile(draw, session: str | None = None) -> dict:
    """One request of any type.  Without a session: any version, every field valid or
    hostile.  With the daemon's session: a request that reaches the node state, with at
    most one field hostile (so each class of value is met past the other fields' checks)."""
    tag = draw(st.sampled_from(TYPES))
    fields = dict(VALID[tag], **({} if tag in ("register", "status") else {"session": st.just(session or "s")}))
    v = st.just(V) if session is not None else st.sampled_from([V, V, V + 1, 0])
    msg = {"type": tag, "v": draw(v), "req": draw(st.integers(1, 1 << 20))}
    absurd = [f for f in fields if f in ABSURD] * 3  # the values that pass the edge, most often
    bad = (draw(st.sampled_from([None, *fields, *absurd])) if fields else None) if session is not None else "all"
    for name, valid in fields.items():
        if session is None or name in REQUIRED or draw(st.integers(0, 3)):  # optional ones sometimes left out
            worse = bad == name or (bad == "all" and draw(st.booleans()))
            msg[name] = draw(_worse(name, session is not None)) if worse else draw(valid)
    if session is None and draw(st.integers(0, 9)) == 0:
        msg["extra"] = draw(hostile_value)
    return msg


def _worse(name: str, inside: bool) -> st.SearchStrategy:
    """A bad value for field `name`: mostly one that passes the edge, when `inside`."""
    edge = st.one_of(HOSTILE.get(name, hostile_value), hostile_value)
    return st.one_of(ABSURD[name], ABSURD[name], edge) if inside and name in ABSURD else edge


CLASSES = ("bytes", "values", "typed", "hostile", "session", "framing")


def _lying(body: bytes, n: int) -> bytes:
    return struct.pack("!I", n) + body


framing = st.one_of(
    st.binary(max_size=64),  # a header cut short, or bytes that are no header
    st.builds(_lying, st.binary(max_size=256), st.integers(pr.MAX_MESSAGE_BYTES + 1, 2**32 - 1)),  # past the limit
    st.builds(_lying, st.binary(max_size=256), st.integers(0, pr.MAX_MESSAGE_BYTES)),  # past the end, or zero
    st.lists(typed.map(msgspec.msgpack.encode).map(frame), min_size=2, max_size=4).map(b"".join),  # several
)


def payloads(session: str | None) -> st.SearchStrategy:
    """(class, bytes): one message's payload, or (framing) raw bytes for a connection."""
    one = {"bytes": st.binary(max_size=512), "values": values.map(msgspec.msgpack.encode),
           "typed": typed.map(msgspec.msgpack.encode), "hostile": hostile().map(encode),
           "session": hostile(session).map(encode), "framing": framing}
    pick = {k: s.map(lambda b, k=k: (k, b)) for k, s in one.items()}
    # what reaches the node state is where the subtle damage was: drawn most often
    return st.sampled_from(["session"] * 4 + ["hostile", "typed", "values", "bytes", "framing"]).flatmap(pick.get)


MAX_OTHERS = 6


class Prober:
    """A connection to a live daemon: send one message, judge the reply."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.replies: Counter = Counter()
        """What the judged messages got: reply type, and an Error's code."""
        self.channel = Channel(socket_path(endpoint))
        self.beaten = time.monotonic()
        self.session = self.ask(pr.encode(pr.Register(pipeline="fz", pid=os.getpid(), owner="fuzz", req=1))).session
        self.others: list[str] = []
        """Sessions of fuzzed pipelines that joined: they live on, heartbeating (at most
        MAX_OTHERS, the oldest leaves for a new one), so the node decides among several."""

    def ask(self, payload: bytes):
        """The reply, or None if none came within the deadline (a hang).  A connection the
        daemon closed (after a message past the size limit) is opened again once."""
        try:
            self.channel.send(payload)
        except ChannelError:
            try:
                self.channel.send(payload)
            except ChannelError:
                return None
        if not self.channel.poll(int(self.timeout_s * 1000)):
            return None
        return pr.decode_reply(self.channel.recv())

    def raw(self, data: bytes) -> str:
        """`data` on a connection of its own, which then closes: whatever the daemon answers
        must be whole replies, and it must serve on."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(0.05)
        got = b""
        try:
            s.connect(str(socket_path(self.endpoint)))
            s.sendall(data)
            while chunk := s.recv(1 << 16):
                got += chunk
        except TimeoutError:
            pass  # a message cut short: the daemon waits for the rest, as it should
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed the door (a length past the limit)
        finally:
            s.close()
        while got:
            n = struct.unpack_from("!I", got)[0] if len(got) >= 4 else -1
            if n < 0 or len(got) < 4 + n:
                return f"wrong reply: {got[:40]!r} is not whole replies"
            try:
                pr.decode_reply(got[4:4 + n])
            except pr.ProtocolError as exc:
                return f"wrong reply: {exc}"
            got = got[4 + n:]
        return ""

    def exchange(self, cls: str, payload: bytes) -> str:
        """'' when the daemon answered as it should, else what went wrong; a Grant earned is
        released at once (so the node stays free for the next message)."""
        self._beat()
        if cls == "framing":
            return self.raw(payload)
        reply = self.ask(payload)
        if reply is None:
            return "hang: no reply"
        self.replies[type(reply).__name__ + (f" {reply.code}" if isinstance(reply, pr.Error) else "")] += 1
        expected = _expected_req(payload)
        if isinstance(reply, pr.Error) and reply.req == 0 and reply.code in ("bad-message", "version", "too-large"):
            return ""  # refused at the edge, before its req was known
        if expected is not None and reply.req != expected:
            return f"wrong reply: req {reply.req} to a request with req {expected}"
        if isinstance(reply, pr.Grant):
            done = self.ask(pr.encode(pr.Done(session=self.session, substage=reply.substage, req=2)))
            if not isinstance(done, pr.Ok):
                return f"wrong reply: releasing a grant got {done!r}"
        if isinstance(reply, pr.Registered) and reply.session:  # a fuzzed pipeline joined: it lives on
            self.others.append(reply.session)
            if len(self.others) > MAX_OTHERS:
                self.ask(pr.encode(pr.Unregister(session=self.others.pop(0), req=3)))
        if isinstance(reply, pr.Ok) and _unregisters(payload, self.session):  # it was our own session
            self.session = self.ask(pr.encode(pr.Register(pipeline="fz", pid=os.getpid(), owner="fuzz",
                                                          req=1))).session
        if isinstance(reply, pr.Error) and reply.code == "internal":
            return f"internal error: {reply.message}"
        return ""

    def _beat(self) -> None:
        """Keep the session's lease, as a client's heartbeat thread does (a session lost all
        the same, e.g. to a fuzzed Unregister, is replaced)."""
        if time.monotonic() - self.beaten < 0.25:
            return
        self.beaten = time.monotonic()
        self.others = [s for s in self.others if isinstance(self.ask(pr.encode(pr.Heartbeat(session=s, req=6))),
                                                              pr.Beat)]
        if not isinstance(self.ask(pr.encode(pr.Heartbeat(session=self.session, req=5))), pr.Beat):
            self.session = self.ask(pr.encode(pr.Register(pipeline="fz", pid=os.getpid(), owner="fuzz",
                                                          req=1))).session

    def healthy(self) -> str:
        """'' when the daemon answers a Status and its scheduler never failed, else what is wrong."""
        st = self.ask(pr.encode(pr.Status(req=4)))
        if not isinstance(st, pr.StatusReply):
            return f"hang: status got {st!r}"
        return f"scheduler failed {st.scheduler_failures} times (see its log)" if st.scheduler_failures else ""

    def close(self) -> None:
        self.channel.close()


def _unregisters(payload: bytes, session: str) -> bool:
    try:
        msg = pr.decode_request(payload)
    except pr.ProtocolError:
        return False
    return isinstance(msg, pr.Unregister) and msg.session == session


def _expected_req(payload: bytes) -> int | None:
    try:
        return pr.decode_request(payload).req
    except pr.ProtocolError:
        return None
