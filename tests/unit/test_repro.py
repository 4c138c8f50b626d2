"""The reproducers in tests/repro/ (traces that broke jigsaw as a new user ran it) replay, and
the policy that failed on them plans them."""

from __future__ import annotations

from pathlib import Path

import pytest

from jigsaw.sim.replay import replay_decisions
from jigsaw.trace import Trace

REPRO = Path(__file__).parent.parent / "repro"
TRACES = sorted(REPRO.glob("*.trace.jsonl"))
ids = {"ids": lambda p: p.name.removesuffix(".trace.jsonl")}


def test_the_reproducers_are_here():
    assert {p.name for p in TRACES} >= {"verl-outside-rollout-pair.trace.jsonl",
                                        "two-pipelines-reward-before-training.trace.jsonl"}


@pytest.mark.parametrize("path", TRACES, **ids)
def test_a_trace_from_before_protocol_v7_replays_every_plan_the_daemon_made(path):
    """A trace written before a Done carried its sub-stage in its data still replays: up to
    the daemon's first fallback, each recorded input is fed to a fresh node state and every
    plan starts what the recorded one started (from there the recorded plans are the
    fallback's).  The shares and memory splits granted are today's scheduler's: since the
    recording, a pair's memory split counts the one left running alone once the other ends
    (actions._pair_ends), which re-prices some of them."""
    events = Trace.read(path).events
    first_fallback = next(k for k, e in enumerate(events) if e.event == "plan" and e.data.get("fallback"))
    trace = Trace(events[:first_fallback])
    got = replay_decisions(trace, compare=("started", "fallback"))
    assert got.mismatches == ()
    assert replay_decisions(trace).differ <= 1  # one grant re-priced (the reward trace), no more
    assert got.plans == sum(e.event == "plan" for e in trace.events) > 10


@pytest.mark.parametrize("path", TRACES, **ids)
def test_the_jigsaw_policy_plans_every_decision_of_the_reproducer(path):
    """Both traces made `jigsaw` raise in `_running_end` (a worker's later piece ready beside its
    earlier one put three pieces on one device) and the node fell back."""
    trace = Trace.read(path)
    assert any(e.event == "plan" and e.data.get("fallback") for e in trace.events)  # as recorded
    got = replay_decisions(trace)
    assert got.plans == sum(e.event == "plan" for e in trace.events)
    assert got.fallbacks == ()
