"""Replays that never pretend: a policy either re-packs the recorded work itself or is refused.

    small simulator-written trace ─► recorded ─► replay(policy) ─► Execution | Refused(policy, t, why)
        a policy that raises after N plans ─► Refused naming it, its first line, the time
        a policy that starts nothing ─► Refused (the node state's fallback never stands in)
    the same trace ─► `jigsaw sim --replay` in-process ─► exit 1 and a "refused" row, no traceback;
                                                          exit 0 when every policy ran
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from factories import colocated

from jigsaw.graph import policies
from jigsaw.graph.baselines import Serial
from jigsaw.graph.plan import NodeSpec, Plan
from jigsaw.node.state import NodeState
from jigsaw.sim.execute import Execution, execute
from jigsaw.sim.replay import Refused, grid_of, recorded, replay
from jigsaw.sim.run import simulate

CFG = colocated(workload=("qwen3-0.6b-gsm8k", "qwen3-0.6b-gsm8k"), gpus=2, steps=1, policy="jigsaw")


@dataclass
class RaisesAfterPlans:
    """Serial's plans until it has made `plans` of them; then it raises (a bug deep in a run)."""

    plans: int
    name: str = "raises-after-plans"
    separable: bool = False
    made: int = 0
    inner: Serial = field(default_factory=Serial)

    def plan(self, view) -> Plan:
        if self.made >= self.plans:
            raise RuntimeError("boom: no plan this time\nand a second line no reason needs")
        self.made += 1
        return self.inner.plan(view)


@dataclass
class StartsNothing:
    """A policy that never starts anything (the node would wait forever)."""

    name: str = "starts-nothing"
    separable: bool = False

    def plan(self, view) -> Plan:
        return Plan(time_s=view.time_s, started=(), assignments=())


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "small.jsonl"
    simulate(CFG).trace.write(path)
    return path


@pytest.fixture(scope="module")
def rec(trace_path):
    from jigsaw.trace import Trace

    return recorded(Trace.read(trace_path))


@pytest.fixture
def fallbacks(monkeypatch) -> list[str]:
    """Every time the node state's fallback decided instead of the policy, why."""
    calls: list[str] = []
    original = NodeState._fallback

    def spy(self, now_s, host, why):
        calls.append(why)
        return original(self, now_s, host, why)

    monkeypatch.setattr(NodeState, "_fallback", spy)
    return calls


def test_a_policy_that_raises_during_a_replay_is_refused_with_its_name_and_reason(rec, fallbacks):
    got = replay(rec, RaisesAfterPlans(plans=2), grid_of(rec))
    assert isinstance(got, Refused), f"a makespan ({got.makespan_s:.1f} s) where the policy failed"
    assert got.policy == "raises-after-plans"
    assert got.reason == "RuntimeError: boom: no plan this time"  # the first line only
    assert "raises-after-plans failed at t=" in str(got) and "boom" in str(got)
    assert not fallbacks
    # The node state's fallback would have gone on to a makespan; the failing plan is its third.
    node = NodeSpec(num_devices=rec.num_devices, mem_bytes=grid_of(rec).device.mem_bytes)
    rescued = execute(rec.pipelines, node, grid_of(rec), policy=RaisesAfterPlans(plans=2))
    assert rescued.makespan_s > 0 and rescued.fallbacks and fallbacks
    assert got.time_s == pytest.approx(rescued.plans[2].time_s)


def test_a_policy_that_starts_nothing_is_refused_not_run_by_the_fallback(rec, fallbacks):
    got = replay(rec, StartsNothing(), grid_of(rec))
    assert isinstance(got, Refused) and got.policy == "starts-nothing" and got.time_s == 0.0
    assert "stuck" in got.reason
    assert not fallbacks


@pytest.mark.parametrize("name", policies.NAMES)
def test_every_shipped_policy_replays_the_small_trace_itself(rec, fallbacks, name):
    got = replay(rec, policies.make(name), grid_of(rec))
    assert isinstance(got, Execution), str(got)
    assert got.makespan_s > 0 and not got.fallbacks and not fallbacks


def _cli(trace_path, spec: str, capsys) -> tuple[int, str, str]:
    from jigsaw.cli.main import main

    rc = main(["sim", "--replay", str(trace_path), "--policy", spec])
    out = capsys.readouterr()
    return rc, " ".join(out.out.split()), out.err


def test_the_cli_shows_a_refused_policy_as_a_row_and_exits_1_without_a_traceback(trace_path, capsys,
                                                                                   monkeypatch):
    real = policies.make
    monkeypatch.setattr(policies, "make", lambda name, config=None: RaisesAfterPlans(plans=1)
                        if name == "static" else real(name, config))
    rc, out, err = _cli(trace_path, "serial,static", capsys)
    assert rc == 1
    assert "│ static │ refused │" in out and "│ serial │" in out
    assert "refused: raises-after-plans failed at t=" in out and "boom: no plan this time" in out
    assert "Traceback" not in err and "Traceback" not in out


def test_the_cli_exits_0_when_every_policy_ran(trace_path, capsys):
    rc, out, err = _cli(trace_path, "serial,static,jigsaw", capsys)
    assert rc == 0, out
    assert "refused" not in out and "Traceback" not in err
