"""A jigsaw daemon in its own runtime directory, and real pipelines run against it (tests)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jigsaw import protocol as pr
from jigsaw.runtime.paths import socket_path
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
        time.sleep(min(timeout_s, 0.05))  # not listening (yet)
        return None
    finally:
        ch.close()


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
        deadline = time.monotonic() + 20
        while self.status() is None:
            if self.daemon.poll() is not None:
                raise AssertionError(f"the daemon exited: {self.log.read_text(errors='replace')}")
            assert time.monotonic() < deadline, "the daemon did not answer a status request in 20 s"

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

    def pipelines(self, timeout_s: float = 10.0) -> dict[str, pr.PipelineInfo]:
        """What the daemon reports; a status that times out is retried (it says nothing about
        the pipelines), and a daemon that never answers fails the test."""
        deadline = time.monotonic() + timeout_s
        while (st := self.status()) is None:
            assert time.monotonic() < deadline, "the daemon did not answer a status request"
        return {p.name: p for p in st.pipelines}

    def running(self, name: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> pr.PipelineInfo:
        """Pipeline `name` once the daemon has admitted one of its sub-stages (its process
        `proc` must not exit first)."""
        deadline = time.monotonic() + timeout_s
        while not (p := self.pipelines().get(name)) or not p.running:
            assert proc.poll() is None, f"{name} exited before it was admitted"
            assert time.monotonic() < deadline, f"{name} was never admitted"
            time.sleep(0.05)
        return p

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.trace.read_text().splitlines()] if self.trace.exists() else []

    def stop(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(10)
