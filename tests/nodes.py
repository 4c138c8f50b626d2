"""A jigsaw daemon in its own runtime directory, and real pipelines run against it (tests).

    Node        the daemon as a process (`jigsaw daemon`), pipelines as processes
    ThreadNode  the daemon serving its socket from a thread of the test, on clocks the test
                may script; its state can be read while it serves (a parked heartbeat, a
                pipeline's running sub-stages)
    InProcessLink  a daemon's line to the cluster controller's real body (cluster/controller.py)
                called in this process instead of over Ray (tests/integration/test_cluster_ray.py
                tests the Ray one), so several ThreadNodes form a cluster

Every wait is `waiting.wait_until` on what the daemon says (a status reply, a trace event).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from waiting import HANG_S, wait_until

from jigsaw import protocol as pr
from jigsaw.runtime.client import Client
from jigsaw.runtime.daemon import Daemon, DaemonConfig
from jigsaw.runtime.paths import endpoint, socket_path
from jigsaw.runtime.wire import Channel

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "workers" / "toy_pipeline.py"


def ask(ep: str, payload: bytes, timeout_s: float = 2.0):
    """One request on a connection of its own: the reply, or None (no daemon, or no answer)."""
    ch = Channel(socket_path(ep))
    try:
        ch.send(payload)
        return pr.decode_reply(ch.recv()) if ch.poll(int(timeout_s * 1000)) else None
    except OSError:
        time.sleep(min(timeout_s, 0.05))  # not listening (yet): a caller polling us asks again
        return None
    finally:
        ch.close()


def read_events(trace: Path) -> list[dict]:
    """The trace's events so far; a line the daemon is still writing is left for the next read."""
    if not trace.exists():
        return []
    text = trace.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def unregistered(events: list[dict], name: str) -> bool:
    """The daemon has handled pipeline `name`'s Unregister, so every message its client sent
    before it (a client's messages are read in order) is in the trace."""
    return any(e["event"] == "drop" and e["pipeline"] == name and e["data"]["reason"] == "unregistered"
               for e in events)


class Node:
    """A daemon in its own runtime directory, and helpers to run pipelines against it."""

    def __init__(self, tmp: Path):
        self.dir = tmp / "rt"
        self.dir.mkdir(mode=0o700)
        self.trace = tmp / "trace.jsonl"
        self.log = tmp / "daemon.log"
        """The daemon's output: a file, never a pipe nobody drains (a full pipe stops a
        daemon in its next log line)."""
        self.env = dict(os.environ, JIGSAW_RUNTIME_DIR=str(self.dir))
        self.env.pop("JIGSAW_ENDPOINT", None)
        self.ep = f"ipc://{self.dir / 'daemon.sock'}"
        self.daemon = None

    def start(self, *extra: str) -> None:
        with open(self.log, "ab") as log:
            self.daemon = subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "daemon", "--trace",
                                            str(self.trace), *extra],
                                           env=self.env, stdout=log, stderr=log, cwd=ROOT)
        wait_until(self._answers, HANG_S, "the daemon answering a status request")

    def _answers(self) -> bool:
        if self.daemon.poll() is not None:
            raise AssertionError(f"the daemon exited: {self.log.read_text(errors='replace')}")
        return self.status() is not None

    def status(self, timeout_s: float = 0.3):
        """The daemon's StatusReply, or None if it does not answer within `timeout_s`."""
        return ask(self.ep, pr.encode(pr.Status(req=7)), timeout_s)

    def run(self, name: str, out: Path, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "run", "--name", name, "--",
                                 sys.executable, str(TOY), "--out", str(out), *extra], env=self.env, cwd=ROOT)

    def worker(self, name: str, out: Path, *extra: str) -> subprocess.Popen:
        """A worker process attached directly (no `jigsaw run` owner keeping the pipeline)."""
        env = dict(self.env, JIGSAW_ENDPOINT=self.ep, JIGSAW_PIPELINE=name)
        return subprocess.Popen([sys.executable, str(TOY), "--out", str(out), *extra], env=env, cwd=ROOT)

    def pipelines(self, timeout_s: float = HANG_S) -> dict[str, pr.PipelineInfo]:
        """What the daemon reports; a status that times out is retried (it says nothing about
        the pipelines), and a daemon that never answers fails the test."""
        st = wait_until(self.status, timeout_s, "the daemon answering a status request")
        return {p.name: p for p in st.pipelines}

    def running(self, name: str, proc: subprocess.Popen, timeout_s: float = HANG_S) -> pr.PipelineInfo:
        """Pipeline `name` once the daemon has admitted one of its sub-stages (its process
        `proc` must not exit first)."""

        def admitted():
            assert proc.poll() is None, f"{name} exited before it was admitted"
            p = self.pipelines().get(name)
            return p if p is not None and p.running else None

        return wait_until(admitted, timeout_s, f"{name} admitted")

    def events(self) -> list[dict]:
        return read_events(self.trace)

    def left(self, name: str) -> list[dict]:
        """The trace once the daemon has handled `name`'s Unregister (see `unregistered`)."""

        def handled():
            ev = self.events()
            return ev if unregistered(ev, name) else None

        return wait_until(handled, HANG_S, f"{name}'s unregistration in the trace")

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(10)


class Clock:
    """Time for the controller's node timeout and gang wait, moved by the test (a clock, not hardware)."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class InProcessLink:
    """runtime/spanning.py's Link onto one shared `Controller` body, under one lock (daemons
    serve from threads).  Each news() is the node's heartbeat too; `lost`: the controller does
    not answer (news() is None, offers go nowhere)."""

    def __init__(self, body, node_id: str, lock: threading.Lock):
        self.body, self.node_id, self.lock, self.lost = body, node_id, lock, False
        with lock:
            body.join(self.info())

    def ready(self, gang: str, members: tuple[str, ...]) -> None:
        with self.lock:
            if not self.lost:
                self.body.ready(gang, self.node_id, members)

    def withdraw(self, gang: str) -> None:
        with self.lock:
            if not self.lost:
                self.body.withdraw(gang, self.node_id)

    def done(self, gang: str) -> None:
        with self.lock:
            if not self.lost:
                self.body.done(gang)

    def news(self):
        with self.lock:
            if self.lost:
                return None
            if not self.body.heartbeat(self.node_id):
                self.body.join(self.info())
            return self.body.take(self.node_id)

    def info(self):
        from jigsaw.cluster.controller import NodeInfo

        return NodeInfo(node_id=self.node_id, kind="h100", gpus=1)


class ThreadNode:
    """A real daemon serving its socket from a thread of this process.  `clock` is what its
    scheduler reads as the time; `wall` times arrivals, leases and parked heartbeats (a wall
    that stands still: no lease expires and a parked heartbeat is answered only when a change
    for it falls due)."""

    def __init__(self, tmp: Path, clock=time.monotonic, wall=time.monotonic, link=None, **config):
        self.dir = tmp / "rt"
        self.dir.mkdir(mode=0o700, parents=True)
        self.trace = tmp / "trace.jsonl"
        self.daemon = Daemon(DaemonConfig(trace=self.trace, **config), self.dir, clock=clock, wall=wall, link=link)
        self.thread = threading.Thread(target=self.daemon.serve, daemon=True)
        self.thread.start()
        self.clients: dict[str, Client] = {}

    def client(self, name: str, **kw) -> Client:
        """A client of pipeline `name`, registered (the daemon's thread may still be starting)."""

        def registered():
            c = Client(name, endpoint(self.dir), **kw)
            if c.connected:
                return c
            c.close()
            return None

        self.clients[name] = wait_until(registered, HANG_S, f"{name} registered with the daemon")
        return self.clients[name]

    def events(self) -> list[dict]:
        return read_events(self.trace)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.daemon.stopping = True
        self.thread.join(10)
