"""The reproducers in tests/repro/ (traces that broke jigsaw as a new user ran it) replay."""

from __future__ import annotations

from pathlib import Path

import pytest

from jigsaw.sim.replay import replay_decisions
from jigsaw.trace import Trace

REPRO = Path(__file__).parent.parent / "repro"
TRACES = sorted(REPRO.glob("*.trace.jsonl"))


def test_the_reproducers_are_here():
    assert {p.name for p in TRACES} >= {"verl-outside-rollout-pair.trace.jsonl",
                                        "two-pipelines-reward-before-training.trace.jsonl"}


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.removesuffix(".trace.jsonl"))
def test_a_trace_from_before_protocol_v7_replays_every_plan_the_daemon_made(path):
    """A trace written before a Done carried its sub-stage in its data still replays: each
    recorded input is fed to a fresh node state and every plan comes out as recorded."""
    trace = Trace.read(path)
    plans = sum(e.event == "plan" for e in trace.events)
    got = replay_decisions(trace)
    assert got.mismatches == ()
    assert got.plans == plans > 0
