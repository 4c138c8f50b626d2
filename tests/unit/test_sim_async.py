"""Asynchronous pipelines in the simulator (sim/asynchronous.py, graph/buffer.py).

    one-step-off   batch n + 1 generates while step n trains; no trained sample is more than
                   one weight version old
    fully-async    a round's tail is interrupted and resumed with its partial output; every
                   weight update interrupts the running requests (KV recomputed, nothing lost)
    any mix        of sync and async pipelines under every policy (a property test): every
                   sample trained exactly once, none past its job's staleness bound, the
                   weight version of every rollout batch in the trace
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from factories import write_workloads
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from jigsaw.graph.buffer import MODES
from jigsaw.graph.policies import NAMES, make
from jigsaw.sim import asynchronous, run
from jigsaw.sim import workload as wl
from jigsaw.sim.node import Infeasible, NodeSim
from jigsaw.sim.run import SimConfig, build, simulate

pytestmark = pytest.mark.timeout(240)


def _fields(**over) -> dict:
    """A small Qwen3-0.6B GRPO pipeline (seconds of simulated work per step)."""
    base = {"model": "qwen3-0.6b", "device": "h100", "gpus": 4, "rollout_tp": 1, "prompts": 8, "group": 4,
            "prompt_tokens": 100.0, "prompt_sigma": 0.3, "mini_batch_prompts": 8, "micro_batch_seqs": 8,
            "logprob_micro_batch_seqs": 16, "gradient_checkpointing": False, "reward_s_per_sample": 0.0005,
            "lengths": {"median_tokens": 300.0, "prompt_sigma": 0.5, "response_sigma": 0.6, "max_tokens": 4096},
            "turns": {"probs": [1.0], "context_tokens": 0, "context_sigma": 0.0},
            "tool": {"latency_s": 0.0, "latency_sigma": 0.0, "blocking": False}}
    return {**base, **over}


def _steps(res, train: bool) -> list:
    """The step events of the (one) asynchronous job's rollout or training side."""
    return [e for e in res.trace.events if e.event == "step" and e.pipeline.endswith(".train") == train]


def _span(e) -> tuple[float, float]:
    return e.t_s - e.data["latency_s"], e.t_s


def test_one_step_off_generates_the_next_batch_while_the_last_one_trains(tmp_path):
    (path,) = write_workloads([_fields()], tmp_path)
    cfg = SimConfig(workload=(path,), policy="serial", steps=5)
    roll, train = _steps(r := simulate(replace(cfg, mode=("one-step-off",))), False), _steps(r, True)
    assert len(roll) == len(train) == 5
    overlaps = [n for n in range(4) if _span(roll[n + 1])[0] < _span(train[n])[1] - 1e-9]
    assert overlaps, "no rollout ran beside the training of the batch before it"
    assert all(e.data["step"] - e.data["weights_version"] <= 1 for e in roll)
    assert all(e.data["staleness"] <= 1 for e in train) and max(e.data["staleness"] for e in train) == 1
    said = {e.pipeline: e.data for e in r.trace.events if e.event == "job"}  # as the daemon traces a live job
    job = roll[0].pipeline
    assert said == {side: {"job": job, "mode": "one-step-off", "staleness": 1} for side in (job, f"{job}.train")}
    sync = simulate(replace(cfg, mode=("sync",)))
    assert sync.tokens == r.tokens  # the same samples trained, whatever the mode
    assert r.makespan_s < sync.makespan_s


def test_fully_async_resumes_interrupted_requests_with_what_they_generated(tmp_path, monkeypatch):
    (path,) = write_workloads([_fields(mode="fully-async", staleness=2, carry_frac=0.5)], tmp_path)
    resumed: list[tuple[int, int, int]] = []

    class Watched(asynchronous.RolloutSide):
        def begin_step(self, t, weights=None):
            resumed.extend((q.rid, q.output_tokens, q.context) for reqs in self.carry.values() for q in reqs)
            super().begin_step(t, weights)

    trained: dict[int, object] = {}
    take = asynchronous.Coupling.take

    def watched_take(self, step):
        reqs = take(self, step)
        trained.update((q.rid, q) for q in reqs)
        return reqs

    monkeypatch.setattr(run, "RolloutSide", Watched)
    monkeypatch.setattr(asynchronous.Coupling, "take", watched_take)
    runs, node, grid, pol = build(SimConfig(workload=(path,), policy="serial", steps=4))
    sim = NodeSim(runs, node, grid, pol)
    sim.run()
    roll, train = runs
    assert resumed, "no round carried its tail into the next"
    assert all(out > 0 for _, out, _ in resumed), "a carried request restarted from its prompt"
    for rid, out, ctx in resumed:  # each carried request is trained, with what it had then in it
        assert trained[rid].context >= ctx and trained[rid].response_tokens >= out
    reloads = [e for e in sim.trace.events if e.event == "weights"]
    assert len(reloads) >= 1 and sum(e.data["resumed"] for e in reloads) > 0, "no weight update reached a rollout"
    _check_ledger(roll.coupling, steps=4, samples=roll.spec.samples, bound=2)


def test_the_look_ahead_sees_the_buffer_between_a_simulated_jobs_sides(tmp_path):
    (path,) = write_workloads([_fields(mode="one-step-off")], tmp_path)
    runs, node, grid, pol = build(SimConfig(workload=(path,), policy="jigsaw", steps=3))
    views = []
    plan = pol.plan

    def seen(view):
        views.append(view)
        return plan(view)

    pol.plan = seen
    NodeSim(runs, node, grid, pol).run()
    job = runs[0].name
    waits = [(ps.graph.pipeline, a, b) for v in views for ps in v.pipelines + v.waiting for a, b in ps.waits_for]
    assert any(p == f"{job}.train" and a.startswith(f"{job}/") for p, a, _ in waits), "training never waited on a batch"
    assert any(p == job and a.startswith(f"{job}.train/") for p, a, _ in waits), "a round never waited on weights"
    assert any(ps.graph.pipeline == f"{job}.train" for v in views for ps in v.waiting), \
        "the training side was never counted on while it waited for its batch"


def _check_ledger(coupling, *, steps: int, samples: int, bound: int) -> None:
    uids = [t.uid for t in coupling.buffer.ledger]
    assert sorted(uids) == list(range(steps * samples)), "a sample was lost or trained twice"
    assert max(t.staleness for t in coupling.buffer.ledger) <= bound
    assert coupling.buffer.version == steps


@st.composite
def mixes(draw) -> tuple[list[dict], str, int, int]:
    pipes = []
    for _ in range(draw(st.integers(2, 3))):
        mode = draw(st.sampled_from(MODES))
        extra = {"mode": mode} if mode != "sync" else {}
        if mode != "sync":
            extra["staleness"] = draw(st.integers(1, 3))
        if mode == "fully-async":
            extra["carry_frac"] = draw(st.sampled_from([0.0, 0.25, 0.6]))
        pipes.append(_fields(prompts=draw(st.sampled_from([4, 8])), group=draw(st.sampled_from([2, 4])), **extra))
    return pipes, draw(st.sampled_from(NAMES)), draw(st.integers(2, 4)), draw(st.sampled_from([2, 4]))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(mix=mixes())
def test_any_mix_under_any_policy_trains_every_sample_once_within_its_bound(tmp_path_factory, mix):
    pipes, policy, steps, gpus = mix
    paths = write_workloads(pipes, tmp_path_factory.mktemp("mix"))
    cfg = SimConfig(workload=paths, policy=policy, steps=steps, gpus=gpus)
    try:
        runs, node, grid, pol = build(cfg)
        why = run.refusal(pol, run.needs(runs, node))
        if why is not None:
            raise Infeasible(why)
    except Infeasible as exc:  # only a baseline of the other asynchronous mode, or one too big to place
        assert str(exc).strip()
        event("refused")
        return
    event("ran " + "+".join(sorted({r.spec.mode for r in runs})))
    sim = NodeSim(runs, node, grid, make(policy))
    sim.run()
    assert not sim.violations, sim.violations[:3]
    for r in runs:
        assert len(r.metrics) == steps, r.name
        if isinstance(r, asynchronous.TrainSide):
            spec = r.spec
            _check_ledger(r.coupling, steps=steps, samples=spec.samples, bound=spec.staleness_bound)
            assert all(m.samples == spec.samples for m in r.metrics)
        elif not isinstance(r, asynchronous.RolloutSide):
            assert all(m.samples == r.spec.samples for m in r.metrics)
    versions = [e for e in sim.trace.events if e.event == "step" and "weights_version" in e.data
                and not e.pipeline.endswith(".train")]
    bound = {r.name: r.spec.staleness_bound for r in runs}
    assert all(e.data["step"] - e.data["weights_version"] <= bound[e.pipeline] for e in versions)
    assert len(versions) == steps * sum(isinstance(r, asynchronous.RolloutSide) for r in runs)


def test_the_workload_format_says_what_is_wrong_with_an_asynchronous_pipeline():
    base = wl.get("qwen3-0.6b-gsm8k")
    for over, message in ((dict(mode="async"), "mode must be one of"),
                          (dict(mode="one-step-off", staleness=0), "needs staleness >= 1"),
                          (dict(staleness=2), "needs an asynchronous mode"),
                          (dict(mode="one-step-off", carry_frac=0.2), "carry_frac needs mode"),
                          (dict(mode="fully-async", rollout_frac=1.0), "rollout_frac must be in"),
                          (dict(mode="fully-async", carry_frac=1.0), "carry_frac must be in")):
        with pytest.raises(ValueError, match=message):
            replace(base, **over, provenance={**base.provenance, **{k: "test" for k in over}})


def test_streamrl_and_areal_refuse_the_other_mode_and_place_each_job_disaggregated():
    cfg = SimConfig(workload=("qwen3-0.6b-gsm8k",) * 2, mode=("one-step-off", "fully-async"), steps=1)
    for policy, refused in (("streamrl", "not fully-async"), ("areal", "not one-step-off")):
        with pytest.raises(Infeasible, match=refused):
            simulate(replace(cfg, policy=policy))
    runs, *_ = build(replace(cfg, policy="streamrl", mode=("one-step-off",) * 2))
    assert [(r.name, r.devices) for r in runs] == [("p0-qwen3-0.6b-gsm8k", (0,)), ("p0-qwen3-0.6b-gsm8k.train", (1,)),
                                                   ("p1-qwen3-0.6b-gsm8k", (2,)), ("p1-qwen3-0.6b-gsm8k.train", (3,))]
