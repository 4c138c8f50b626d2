"""Faults a production node sees, each with 4 real pipelines running: does the node come back?

    python bench/daemon_faults.py [--faults stop-1 stop-5 stop-30 restart client-kill flood deaf]

    jigsaw daemon --devices 2 ◄── 4 × `jigsaw run -- toy_pipeline.py` (tests/workers: five 50 ms
        │                          sub-stages a step; each piece's start, admission wait and
        │                          whether it ran without the daemon, in a file of its own)
        ▼  once every pipeline has been granted a piece, the fault:
    stop-N       SIGSTOP the daemon N s, then SIGCONT (a GC pause, a swapped-out process)
    restart      SIGKILL the daemon, start a new one in the same runtime directory
    client-kill  SIGKILL one pipeline's worker (its grants must come back within a lease)
    flood        1,100 idle connections and 300 half-sent messages from other processes
    deaf         200 connections flooding Status and never reading a reply

Per fault, from the node's recovery (SIGCONT, the new daemon answering, the kill, the flood
starting): `asks again s`, the longest any pipeline took to ask the daemon for a piece again
(0 for one whose request the daemon held through it and granted: it was being scheduled);
`granted s`, to be granted one (it may wait its turn: up to --max-wait-s, 2 s); `open after`:
pieces that still ran without the daemon once a lease had passed; `exactly once`: every
(step, sub-stage) of every pipeline's work file once; `max wait s`: the longest any admission
waited (a client never blocks past its patience, two leases, or the node's max-wait);
`RSS MiB`: the daemon's before → after.  Goal: asks again within one lease (1 s) plus a piece,
0 open after, exactly once everywhere.  Exit status 1 when any is not met.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from nodes import Node  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from jigsaw import protocol as pr  # noqa: E402

PIPELINES = ("A", "B", "C", "D")
KINDS = ("rollout_prefill", "rollout_decode", "rollout_tail", "reference", "training")
WORK_MS = 50.0
LEASE_S = pr.LEASE_S
FAULTS = ("stop-1", "stop-5", "stop-30", "restart", "client-kill", "flood", "deaf")


def rss_mib(pid: int) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.02)
    raise TimeoutError(f"{what}: not within {timeout_s:g} s")


def waiting_at(node: Node, t_mono: float) -> set[str]:
    """Pipelines with a request the daemon still held at monotonic time `t_mono` and granted
    later (it was scheduling them all along: a turn, not an outage)."""
    asked: dict[str, str] = {}
    granted_after: set[str] = set()
    t0 = None
    for e in node.events():
        if e["event"] == "node":
            t0 = e["data"]["clock_t0_s"]
            if t0 > t_mono:
                asked.clear()  # a new daemon holds nothing of the old one's
        elif t0 is None:
            continue
        elif e["event"] == "request" and t0 + e["t_s"] < t_mono:
            asked[e["pipeline"]] = e["substage"]
        elif e["event"] in ("grant", "drop") and t0 + e["t_s"] < t_mono:
            if e["substage"] == asked.get(e["pipeline"]) or e["event"] == "drop":
                asked.pop(e["pipeline"], None)
        elif e["event"] == "grant" and asked.get(e["pipeline"]) == e["substage"]:
            granted_after.add(e["pipeline"])
    return granted_after


def first_since(node: Node, t_mono: float, event: str) -> dict[str, float]:
    """Per pipeline, its first `event` (request, grant) at or after monotonic time `t_mono`."""
    first: dict[str, float] = {}
    t0 = None
    for e in node.events():
        if e["event"] == "node":
            t0 = e["data"]["clock_t0_s"]  # a restarted daemon appends with its own clock origin
        elif e["event"] == event and t0 is not None and t0 + e["t_s"] >= t_mono:
            first.setdefault(e["pipeline"], t0 + e["t_s"])
    return first


class Run:
    """Four toy pipelines under `jigsaw run` against one daemon."""

    def __init__(self, tmp: Path, steps: int):
        self.node = Node(tmp)
        self.node.start("--devices", "2")
        self.tmp = tmp
        self.procs = {n: self.node.run(n, tmp / f"{n}.out", "--steps", str(steps), "--work-ms", str(WORK_MS),
                                       "--waits-out", str(tmp / f"{n}.waits")) for n in PIPELINES}

    def all_granted(self) -> bool:
        return set(first_since(self.node, 0.0, "grant")) >= set(PIPELINES)

    def worker_pid(self, name: str) -> int:
        """The toy process under pipeline `name`'s `jigsaw run`."""
        out = subprocess.run(["pgrep", "-P", str(self.procs[name].pid)], capture_output=True, text=True)
        return int(out.stdout.split()[0])

    def finish(self, timeout_s: float, skip: str | None = None) -> dict:
        for n, p in self.procs.items():
            if n != skip:
                p.wait(timeout_s)
        return self.judge(skip)

    def judge(self, skip: str | None) -> dict:
        waits = [tuple(map(float, ln.split())) for n in PIPELINES if n != skip
                 for ln in (self.tmp / f"{n}.waits").read_text().splitlines()]
        once = all(self._once(n) for n in PIPELINES if n != skip)
        return {"once": once, "max_wait_s": max(w for _, w, _ in waits), "waits": waits}

    def _once(self, name: str) -> bool:
        lines = (self.tmp / f"{name}.out").read_text().splitlines()
        done = Counter(tuple(ln.split()[:2]) for ln in lines)
        steps = {int(s) for s, _ in done}
        return all(v == 1 for v in done.values()) and len(done) == len(KINDS) * (max(steps) + 1)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        self.node.stop()


def _stop(run: Run, seconds: float) -> float:
    run.node.daemon.send_signal(signal.SIGSTOP)
    time.sleep(seconds)  # the fault itself: the daemon stands still this long
    run.node.daemon.send_signal(signal.SIGCONT)
    return time.monotonic()


def _restart(run: Run) -> float:
    run.node.daemon.kill()
    run.node.daemon.wait(10)
    run.node.start("--devices", "2")
    return time.monotonic()


def _flood(tmp: Path, ep_path: str, idle: int, partial: int) -> subprocess.Popen:
    """Another process holding `idle` silent connections and `partial` half-sent messages."""
    code = (f"import socket, struct, time\nsocks = []\n"
            f"for i in range({idle + partial}):\n"
            f"    s = socket.socket(socket.AF_UNIX); socks.append(s)\n"
            f"    try:\n"
            f"        s.connect({ep_path!r})\n"
            f"        if i >= {idle}: s.sendall(struct.pack('!I', 100) + b'half')\n"
            f"    except OSError: pass  # closed on us: the listener's limits at work\n"
            f"time.sleep(600)\n")
    return subprocess.Popen([sys.executable, "-c", code])


def _deaf(ep_path: str, peers: int) -> subprocess.Popen:
    code = (f"import socket, struct, msgspec, time\n"
            f"from jigsaw import protocol as pr\n"
            f"msg = pr.encode(pr.Status(req=1)); frame = struct.pack('!I', len(msg)) + msg\n"
            f"socks = [socket.socket(socket.AF_UNIX) for _ in range({peers})]\n"
            f"for s in socks: s.connect({ep_path!r}); s.setblocking(False)\n"
            f"end = time.monotonic() + 600\n"
            f"while time.monotonic() < end:\n"
            f"    for s in socks:\n"
            f"        try: s.send(frame * 64)\n"
            f"        except OSError: pass\n"
            f"    time.sleep(0.01)\n")
    return subprocess.Popen([sys.executable, "-c", code])


def one(fault: str, console: Console) -> dict:
    stall_s = float(fault.split("-")[1]) if fault.startswith("stop-") else 0.0
    steps = int((stall_s + 10) / (len(KINDS) * WORK_MS / 1e3)) + 10  # enough to outlast the fault
    with tempfile.TemporaryDirectory(prefix="jigsaw-faults-") as d:
        run = Run(Path(d), steps)
        helper = None
        try:
            wait_for(run.all_granted, 120, "every pipeline granted once")
            rss0 = rss_mib(run.node.daemon.pid)
            skip = None
            if fault.startswith("stop-"):
                back_at = _stop(run, stall_s)
            elif fault == "restart":
                back_at = _restart(run)
            elif fault == "client-kill":
                skip, back_at = "D", time.monotonic()
                os.kill(run.worker_pid("D"), signal.SIGKILL)
            else:
                sock = str(run.node.dir / "daemon.sock")
                helper = _flood(Path(d), sock, 1100, 300) if fault == "flood" else _deaf(sock, 200)
                back_at = time.monotonic()
            console.print(f"  {fault}: fault done, waiting for the pipelines")
            res = run.finish(600, skip=skip)
            rss1 = rss_mib(run.node.daemon.pid)
            asked, granted = first_since(run.node, back_at, "request"), first_since(run.node, back_at, "grant")
            asked.update({n: back_at for n in waiting_at(run.node, back_at)})
        finally:
            if helper is not None:
                helper.kill()
            run.stop()
    live = [n for n in PIPELINES if n != skip]
    back_s = max(asked.get(n, float("inf")) - back_at for n in live)
    granted_s = max(granted.get(n, float("inf")) - back_at for n in live)
    open_after = sum(1 for start, _, exclusive in res["waits"] if exclusive and start > back_at + LEASE_S)
    return {"fault": fault, "back_s": back_s, "granted_s": granted_s, "open_after": open_after,
            "once": res["once"], "max_wait_s": res["max_wait_s"], "rss": (rss0, rss1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    args = ap.parse_args()
    console = Console()
    rows = []
    for fault in args.faults:
        console.print(f"[bold]{fault}[/]: 4 pipelines on a 2-device daemon")
        rows.append(one(fault, console))
    t = Table(title="jigsaw daemon under faults (4 toy pipelines, 2 devices, lease 1 s)")
    for col in ("fault", "asks again s", "granted s", "open after", "exactly once", "max wait s", "RSS MiB"):
        t.add_column(col, justify="left" if col == "fault" else "right")
    ok = True
    for r in rows:
        good = r["back_s"] <= LEASE_S + 0.5 and r["open_after"] == 0 and r["once"]
        ok &= good
        t.add_row(r["fault"], f"{r['back_s']:.2f}", f"{r['granted_s']:.2f}", str(r["open_after"]),
                  "yes" if r["once"] else "NO",
                  f"{r['max_wait_s']:.2f}", f"{r['rss'][0]:.0f} → {r['rss'][1]:.0f}",
                  style=None if good else "red")
    console.print(t)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
