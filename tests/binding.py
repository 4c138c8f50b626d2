"""Whether processes ran on the cores a CPU-partitioning daemon granted them (shared by the
recipe and the verl binding tests).

    trace: grant events (sub-stage, pids, cores), `delivered` (a budget change reached the
           client), `release`  ─► holdings(): per pid, each partition it was told to run on
    Sampler: /proc/<pid>/task/*/status (Cpus_allowed_list) of every granted pid, on the
             daemon's clock  ─► off_cores(): holdings whose settled samples were elsewhere
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace

from nodes import Node

from jigsaw.graph.ids import SubStageId

SAMPLE_S = 0.01
BIND_S = 0.25
"""From the daemon's reply (a grant, or a heartbeat reply with a budget change) to the
worker's threads on their new cores."""


@dataclass(frozen=True)
class Held:
    """One partition a pid was told to run on, from its grant until its next event."""

    pid: int
    role: str
    substage: str
    cores: str
    sm_frac: float
    start_s: float
    """When the worker was told: its grant, or the heartbeat reply carrying the change."""
    end_s: float
    change: bool
    """A budget change of a running sub-stage (not its admission) that moved its cores."""


def affinity(pid: int) -> set[str] | None:
    """Cpus_allowed_list of every thread of `pid` (None once it is gone)."""
    seen = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                seen |= {ln.split()[1] for ln in f if ln.startswith("Cpus_allowed_list:")}
    except (FileNotFoundError, ProcessLookupError):
        return None
    return seen


def cores_list(cores: list[int]) -> str:
    """As the kernel writes it: ranges a-b joined by commas."""
    out, run = [], [cores[0]]
    for c in cores[1:]:
        if c == run[-1] + 1:
            run.append(c)
        else:
            out.append(run)
            run = [c]
    out.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in out)


def holdings(events: list[dict]) -> list[Held]:
    """Per pid: each partition it was told to run on, from when it was told (admission: the
    grant; a budget change: the heartbeat reply that carried it) until the pid's next grant or
    its sub-stage's end.  A change superseded before delivery was never told: left out."""
    out: list[Held] = []
    told: dict[int, Held] = {}  # in force now
    pending: dict[int, Held] = {}  # granted, not yet delivered
    bound: dict[int, str] = {}  # the cores the pid was last told
    for e in events:
        if e["event"] == "grant" and e["data"].get("partition", {}).get("kind") == "cpu":
            kind = SubStageId.parse(e["substage"]).kind.value
            for pid in e["data"]["pids"]:
                running = (told.get(pid) or pending.get(pid))
                _close(out, told.pop(pid, None), e["t_s"])
                h = Held(pid=pid, role="rollout" if kind.startswith("rollout") else "trainer", substage=e["substage"],
                         cores=cores_list(e["data"]["partition"]["cores"]), sm_frac=e["sm_frac"], start_s=e["t_s"],
                         end_s=0.0, change=False)
                if running is not None and running.substage == e["substage"]:
                    pending[pid] = h  # a budget change: in force once delivered
                else:
                    pending.pop(pid, None)
                    told[pid], bound[pid] = h, h.cores  # an admission: bound before the work starts
        elif e["event"] == "delivered":
            for pid, h in list(pending.items()):
                if h.substage == e["substage"] and h.sm_frac == e["sm_frac"]:
                    told[pid] = replace(pending.pop(pid), start_s=e["t_s"], change=h.cores != bound[pid])
                    bound[pid] = h.cores
        elif e["event"] == "release":
            for pid in {p for p, h in (*told.items(), *pending.items()) if h.substage == e["substage"]}:
                _close(out, told.pop(pid, None), e["t_s"])
                pending.pop(pid, None)
    return out


def _close(out: list[Held], h: Held | None, end_s: float) -> None:
    if h is not None:
        out.append(replace(h, end_s=end_s))


class Sampler(threading.Thread):
    """Affinity of every pid the trace's grants name, every SAMPLE_S, on the daemon's clock."""

    def __init__(self, node: Node):
        super().__init__(daemon=True)
        self.node, self.stop, self.samples = node, threading.Event(), []

    def run(self) -> None:
        pids, t0, next_read = set(), None, 0.0
        while not self.stop.is_set():
            if time.monotonic() >= next_read:  # new pids appear with new grants
                ev = self.node.events()
                t0 = next((e["data"]["clock_t0_s"] for e in ev if e["event"] == "node"), t0)
                pids |= {p for e in ev if e["event"] == "grant" for p in e["data"].get("pids", ())}
                next_read = time.monotonic() + 0.2
            for pid in pids:
                t = time.monotonic()
                if t0 is not None and (seen := affinity(pid)) is not None:
                    self.samples.append((t - t0, pid, seen))
            time.sleep(SAMPLE_S)


LATE_S = 1.0
"""A budget change whose pin has not shown in this long after BIND_S is not late: not followed."""


def settled(h: Held, samples: list) -> list:
    """The holding's samples from BIND_S after it was told until its end."""
    return [seen for t, p, seen in samples if p == h.pid and h.start_s + BIND_S <= t < h.end_s]


def late(h: Held, samples: list) -> bool:
    """A budget change the worker had not reached yet when the next one came: none of its
    settled samples is on its cores, and it lasted under LATE_S past BIND_S.  The client pins
    from its heartbeat thread, which a saturated machine (the suite's other worker beside this
    test's processes) can keep off a core for longer than BIND_S; such a holding says nothing
    either way.  A client that never follows a change makes no move at all (`moved`, which
    the callers require), and one that leaves a reached partition is off its cores."""
    return (h.change and h.end_s - h.start_s < BIND_S + LATE_S
            and not any(seen == {h.cores} for seen in settled(h, samples)))


def moved(h: Held, samples: list) -> bool:
    """The holding's process was seen off its cores just before it was told, and on them
    after: a move the worker really made (a change back to where it had stayed is none)."""
    before = [seen for t, p, seen in samples if p == h.pid and h.start_s - BIND_S <= t < h.start_s]
    return bool(before) and before[-1] != {h.cores} and any(s == {h.cores} for s in settled(h, samples))


def off_cores(held: list[Held], samples: list) -> list[tuple[Held, list]]:
    """The holdings whose settled samples were mostly not on its cores (late changes aside),
    with their settled samples."""
    out = []
    for h in held:
        seen = settled(h, samples)
        # A pin moves a process's threads one by one, and on a saturated 2-core machine the
        # thread doing it can be preempted half-way: a sample may catch some threads moved and
        # some not.  A holding is off its cores when most of its settled samples are.
        if seen and 2 * sum(s != {h.cores} for s in seen) > len(seen) and not late(h, samples):
            out.append((h, seen))
    return out
