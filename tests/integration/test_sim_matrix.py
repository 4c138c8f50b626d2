"""Every shipped workload, paired with itself and with another of its device kind, under every
policy; each jigsaw trace replayed under every policy (issue 33).

    shipped workloads ─► pairs (w, w) and (w, next of w's device kind)
        ─► simulate() under every policy: a result with no violation, or Infeasible with a reason
        ─► the jigsaw run's trace ─► replay() under every policy: the policy's own schedule
           (no decision by the node's fallback), or Refused, and only where the simulator too
           refused that policy on that pair, for the same reason

What a user sees: no traceback anywhere, and every row either the policy's own number or an
explicit refusal that says why (`jigsaw sim`, `jigsaw sim --replay`)."""

from __future__ import annotations

import pytest

from jigsaw.graph.policies import ASYNC_ONLY, NAMES, make
from jigsaw.sim import workload as wl
from jigsaw.sim.execute import Refused
from jigsaw.sim.node import Infeasible
from jigsaw.sim.replay import grid_of, recorded, replay
from jigsaw.sim.run import SimConfig, simulate

pytestmark = pytest.mark.timeout(300)
SYNC_POLICIES = tuple(p for p in NAMES if p not in ASYNC_ONLY)
"""The shipped workloads are synchronous: streamrl and areal would be split again
(tests/unit/test_sim_async.py runs them on asynchronous mixes)."""


def _simulated(pair: tuple[str, str]) -> tuple[dict[str, str], object]:
    """Each policy's outcome ("" for a run, else why it was infeasible) and jigsaw's trace."""
    why, trace = {}, None
    for policy in SYNC_POLICIES:
        try:
            # jigsaw on every device, as the baselines it is replayed under run (its own choice of
            # placement would replay on another deployment: tests/unit/test_placement.py)
            res = simulate(SimConfig(workload=pair, policy=policy, steps=1, trace=policy == "jigsaw",
                                     placement="colocated"))
        except Infeasible as exc:
            assert str(exc).strip(), (pair, policy)
            why[policy] = str(exc)
            continue
        assert not res.violations, (pair, policy, res.violations[:3])
        assert all(p.steps == 1 for p in res.pipelines), (pair, policy)
        why[policy], trace = "", res.trace if policy == "jigsaw" else trace
    return why, trace


@pytest.mark.parametrize("pair", wl.shipped_pairs(), ids=lambda p: f"{p[0]}+{p[1]}")
def test_every_policy_runs_or_refuses_with_a_reason_and_replays_the_jigsaw_trace_alike(pair):
    why, trace = _simulated(pair)
    assert not why["jigsaw"] and trace is not None, why["jigsaw"]
    rec = recorded(trace)
    grid = grid_of(rec)
    for policy in SYNC_POLICIES:
        got = replay(rec, make(policy), grid)
        if isinstance(got, Refused):
            # a replay refuses only what the simulator refused, and says the same
            assert why[policy] and got.reason in why[policy], (pair, policy, got, why[policy])
            continue
        assert got.makespan_s > 0 and not got.fallbacks, (pair, policy, got.fallbacks[:2])
