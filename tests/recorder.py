"""The real `Daemon` with its socket replaced by a list of what it sent (tests).

Node state, policy, grants, leases and timers are the daemon's own; requests are delivered
as if they had just arrived, on scripted clocks, so each test can say exactly which reply
each request got and when the daemon decided.
"""

import os
from pathlib import Path

from jigsaw import protocol as pr
from jigsaw.runtime.daemon import Daemon, DaemonConfig, Inbound


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Recorder(Daemon):
    """The daemon, its replies kept instead of sent."""

    def __init__(self, tmp: Path, **config):
        self.sent: list[tuple[int, object]] = []
        self.time = Clock()
        super().__init__(DaemonConfig(**config), directory=tmp, clock=self.time, wall=self.time)

    def _send(self, conn, reply) -> None:
        self.sent.append((conn, reply))

    def ask(self, msg, conn: int = 1, tick: bool = True):
        """Deliver `msg` as if it arrived now; the replies it (and the tick after it) caused."""
        return self.deliver([msg], conn, tick)

    def deliver(self, msgs, conn: int = 1, tick: bool = True):
        """Deliver `msgs` as one read (the daemon decides once after them); the replies."""
        before = len(self.sent)
        self._serve([Inbound(conn, m, self.time()) for m in msgs])
        if tick:
            self._tick()
        return [r for _, r in self.sent[before:]]

    def receive(self, data: bytes, conn: int = 1, tick: bool = True):
        """Deliver a raw frame as the listener would (the daemon's own checks decode it); the replies."""
        before = len(self.sent)
        msg = self._check(conn, data)
        if msg is not None:
            self._serve([Inbound(conn, msg, self.time())])
        if tick:
            self._tick()
        return [r for _, r in self.sent[before:]]

    def register(self, name: str, owner: str = "", devices=(), **facts) -> str:
        (reply,) = self.ask(pr.Register(pipeline=name, pid=os.getpid(), owner=owner, devices=devices, **facts))
        assert isinstance(reply, pr.Registered), reply
        return reply.session

    def beat(self, session: str) -> None:
        self.ask(pr.Heartbeat(session=session), tick=False)

    def run_for(self, seconds: float, beating=()) -> None:
        """The loop turning every 50 ms, `beating` sessions heartbeating every 250 ms."""
        for i in range(round(seconds / 0.05)):
            self.time.t += 0.05
            if i % 5 == 0:
                for s in beating:
                    self.beat(s)
            self._tick()


def admit(session: str, kind: str, step: int = 0, rank: int = 0, req: int = 1, **kw) -> pr.Admit:
    """An Admit as a worker of rank `rank` sends it."""
    return pr.Admit(session=session, kind=kind, dp_rank=rank, step=step, req=req, **kw)
