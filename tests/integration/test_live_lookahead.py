"""The live daemon looks past the step barrier, and its trace replays to the same decisions.

A real daemon (in a thread, its scheduling clock scripted by the test so the decision cannot
depend on machine load) and two real clients over its socket:

    A  step 0: prefill .5  decode .5  tail 2.0  reference .5  training .5   (long tail)
    B  step 0: every sub-stage 1.0
    step 1: A runs up to its reference, B its prefill; then B's decode starts and A asks
            for its training while it runs.

A's training ends its step; what follows it is the next step's rollout with its two-second
tail.  Seen with that prediction, the training is on A's critical path and gets three
quarters of the device beside B's decode; a daemon that stops at the barrier gives it a
quarter.  (The simulator's own view shows the same split: `replay_decisions` re-decides the
trace with the simulator's node state.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
from nodes import ROOT, ThreadNode
from waiting import HANG_S, wait_until

from jigsaw.graph.plan import SchedulerConfig
from jigsaw.sim.replay import replay_decisions
from jigsaw.trace import Trace

KINDS = ("rollout_prefill", "rollout_decode", "rollout_tail", "reference", "training")
A_S = (0.5, 0.5, 2.0, 0.5, 0.5)
B_S = (1.0,) * 5


class ScriptedNode(ThreadNode):
    """A daemon serving in a thread; `now_s` is what its scheduler reads as the time."""

    def __init__(self, tmp, sched: SchedulerConfig):
        self.now_s = 0.0
        super().__init__(tmp, clock=lambda: self.now_s, sched=sched)

    def settled(self, name: str) -> None:
        """Wait until the daemon has processed `name`'s last Done (it is sent without a reply)."""
        wait_until(lambda: not self.daemon.state.pipelines[name].running, HANG_S, f"{name}'s end at the daemon")

    def run(self, name: str, step: int, durations_s, kinds=KINDS) -> None:
        """Sub-stages one after the other, alone, each taking its scripted time."""
        c = self.clients[name]
        for kind, dur_s in zip(kinds, durations_s, strict=False):
            with c.substage(kind, step=step, urgent=kind in ("rollout_decode", "rollout_tail")) as g:
                assert g.sm_frac == 1.0 and not g.exclusive
                self.now_s += dur_s
            self.settled(name)


SCENARIO = SchedulerConfig(window=3, bound_weight=0.0, end_game_tasks=0)
"""The paper's look-ahead (W = 3, critical-path leaf, no end game), whose decision in this
scenario turns on the next step; the default (W = 2, bound blended in) picks 25% whether it
sees past the barrier or not, and played out to the end it holds A's training until B's
decode ends (which this scripted clock never reaches)."""


def _training_share(tmp, next_step: bool) -> tuple[float, ScriptedNode]:
    node = ScriptedNode(tmp, replace(SCENARIO, next_step=next_step))
    try:
        a, b = node.client("A"), node.client("B")
        node.run("A", 0, A_S)
        node.run("B", 0, B_S)
        node.run("A", 1, A_S, KINDS[:4])
        node.run("B", 1, B_S, KINDS[:1])
        with b.substage("rollout_decode", step=1, urgent=True):
            node.now_s += 0.01
            with a.substage("training", step=1) as g:
                share = g.sm_frac
                assert not g.exclusive
                node.now_s += 0.1
            node.settled("A")
        node.settled("B")
    finally:
        node.close()
    return share, node


@pytest.mark.timeout(120)
def test_the_live_plan_looks_past_the_step_barrier_and_replays_to_the_same_decisions(tmp_path):
    share, node = _training_share(tmp_path / "ahead", next_step=True)
    share_blind, _ = _training_share(tmp_path / "blind", next_step=False)
    assert (share, share_blind) == (0.75, 0.25)
    trace = Trace.read(node.trace)
    grants = [e for e in trace.events if e.event == "grant" and e.substage == "A/1/r0/training/0"]
    assert [g.sm_frac for g in grants] == [0.75]  # what the worker was told is what was traced
    replayed = replay_decisions(trace)
    assert replayed.plans >= 12 and replayed.mismatches == ()
    blind = replay_decisions(trace, sched=replace(SCENARIO, next_step=False))
    assert blind.differ and any("A/1/r0/training/0@0.25" in m for m in blind.mismatches)  # replays tell them apart
    # What a user runs: the daemon's decisions re-made offline; the re-packing with another grid
    cli = subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "sim", "--replay", str(node.trace), "--profile",
                          "cpu/tiny-qwen3", "--policy", "jigsaw"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert cli.returncode == 0, cli.stderr
    assert f"jigsaw's {replayed.plans} live plans re-made" in cli.stdout and "all identical" in cli.stdout
