"""Simulator invariants: budgets, exactly-once samples, serial = sum of exclusive times,
determinism, event order; policies and workloads."""

from __future__ import annotations

import heapq
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from factories import colocated

from jigsaw.sim import workload as wl
from jigsaw.sim.node import Event, NodeSim, Priority
from jigsaw.sim.run import build, lower_bound, simulate
from jigsaw.trace import Trace

SMALL = colocated(workload=("qwen3-4b-gsm8k", "qwen3-0.6b-gsm8k"), gpus=4, steps=3, seed=1)
POLICIES = ("serial", "split", "static", "muxserve", "rollmux", "hrrs", "greedy", "jigsaw")


def _budgets_from_trace(trace: Trace, mem_bytes: int) -> None:
    """Replay grants and releases; every device must stay within SM and memory at all times."""
    held: dict[int, dict[str, tuple[float, int]]] = {}
    events = trace.events
    for n, e in enumerate(events):
        if e.event == "grant":
            held.setdefault(e.device, {})[e.pipeline] = (e.sm_frac, e.mem_bytes)
        elif e.event == "release" and e.device is not None:
            held.get(e.device, {}).pop(e.pipeline, None)
        if n + 1 < len(events) and events[n + 1].t_s == e.t_s:
            continue  # one decision emits several grants at one instant: check after all of them
        for d, units in held.items():
            sms = [sm for sm, _ in units.values()]
            assert len(units) <= 2, f"t={e.t_s}: {len(units)} pipelines on device {d}"
            assert sum(sms) <= 1.0 + 1e-9 or sms == [1.0, 1.0], f"t={e.t_s}: SM {sms} on device {d}"
            assert sum(m for _, m in units.values()) <= mem_bytes, f"t={e.t_s}: memory over on device {d}"


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_respect_device_budgets_and_finish_every_sample_once(policy):
    res = simulate(replace(SMALL, policy=policy))
    assert not res.violations, res.violations[:3]
    assert all(p.steps == SMALL.steps for p in res.pipelines)
    samples = {p.name: wl.get(p.workload).samples for p in res.pipelines}
    steps = [e for e in res.trace.events if e.event == "step"]
    assert len(steps) == SMALL.steps * len(res.pipelines)
    assert all(e.data["samples"] == samples[e.pipeline] for e in steps)
    _budgets_from_trace(res.trace, 80 * 2**30)


@pytest.mark.parametrize("policy", POLICIES)
def test_tool_waits_free_or_keep_gpus_without_overcommitting(policy):
    # Blocked tool calls idle whole workers; whole-GPU policies must keep their GPUs, the
    # sharing ones may lend them and re-split when the worker comes back.
    res = simulate(replace(SMALL, workload=("qwen3-4b-search-r1",) * 2, policy=policy, steps=2))
    assert not res.violations, res.violations[:3]
    _budgets_from_trace(res.trace, 80 * 2**30)


@pytest.mark.parametrize("policy", POLICIES)
def test_three_pipelines_never_crowd_a_device_a_tool_wait_holds(policy):
    # A worker back from a tool call resumes on its device at once: a third pipeline must
    # not have taken the place it left.
    mix = ("qwen3-4b-search-r1", "qwen3-4b-aime-multiturn", "qwen3-0.6b-math")
    # static runs pairs on halves of 2 GPUs: a training sharded over 2 needs 37.9 GiB of its 40 GiB half
    res = simulate(replace(SMALL, workload=mix, policy=policy, steps=2))
    assert not res.violations, res.violations[:3]
    assert all(p.steps == 2 for p in res.pipelines)
    _budgets_from_trace(res.trace, 80 * 2**30)


def test_tail_batching_trains_exactly_one_batch_per_step_and_runs_long_rounds():
    res = simulate(replace(SMALL, workload=("qwen3-4b-gsm8k",), policy="serial", steps=6, tailbatch=True))
    steps = [e for e in res.trace.events if e.event == "step"]
    assert [e.data["samples"] for e in steps] == [256] * 6
    # η = 1.25: each short round defers 16 of 80 prompts, so the fifth round is a long one.
    assert [e.data["round"] for e in steps] == ["short"] * 4 + ["long", "short"]


def test_serial_makespan_is_the_sum_of_exclusive_stage_times():
    res = simulate(replace(SMALL, policy="serial"))
    alone = []
    for i in range(len(SMALL.workload)):
        runs, node, grid, pol = build(replace(SMALL, policy="serial", trace=False), only=i)
        NodeSim(runs, node, grid, pol, trace=False).run()
        alone.append(sum(sum(m.stage_s.get(k, 0.0) for k in ("rollout", "reward", "reference", "training"))
                         for m in runs[0].metrics))
    assert res.makespan_s == pytest.approx(sum(alone), rel=1e-9)


def test_lower_bound_is_below_every_policy():
    lb = lower_bound(SMALL)
    for policy in POLICIES:
        assert simulate(replace(SMALL, policy=policy, trace=False)).makespan_s >= lb.makespan_s * (1 - 1e-9)
    assert lb.makespan_s == max(lb.critical_path_s, lb.resource_s)


def test_same_seed_same_result_and_other_seed_differs():
    a, b = simulate(SMALL), simulate(SMALL)
    assert a.makespan_s == b.makespan_s
    assert [(e.t_s, e.event, e.substage, e.device) for e in a.trace.events] == \
           [(e.t_s, e.event, e.substage, e.device) for e in b.trace.events]
    assert simulate(replace(SMALL, seed=2)).makespan_s != a.makespan_s


def test_same_time_events_fire_in_key_order():
    heap = []
    keys = [(5.0, Priority.SEGMENT, 0), (5.0, Priority.STAGE, 3), (4.0, Priority.SEGMENT, 1), (5.0, Priority.STAGE, 2)]
    for t, pr, seq in keys:
        ev = Event(time_s=t, priority=pr, seq=seq, kind="segment", pipe=0)
        heapq.heappush(heap, (ev.time_s, ev.priority, ev.seq, ev))
    popped = [heapq.heappop(heap)[3] for _ in keys]
    assert [(e.time_s, e.priority, e.seq) for e in popped] == sorted(keys)
    runs, node, grid, pol = build(replace(SMALL, trace=False))
    sim = NodeSim(runs, node, grid, pol, trace=False)
    sim.run()
    fired = [(e.time_s, e.priority, e.seq) for e in sim.fired]
    assert fired == sorted(fired) and len(fired) > 100


def test_trace_round_trips(tmp_path):
    res = simulate(SMALL)
    path = tmp_path / "t.jsonl"
    res.trace.write(path)
    back = Trace.read(path)
    assert back.events == res.trace.events
    path.write_text('{"t_s": 1, "event": "nonsense", "pipeline": "x"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1"):
        Trace.read(path)


# ---------------------------------------------------------------- workloads

def test_every_shipped_workload_loads_with_full_provenance():
    names = wl.shipped()
    assert len(names) >= 10
    for name in names:
        spec = wl.get(name)
        assert set(wl.parameter_paths(spec)) <= set(spec.provenance)


def test_workload_errors_name_the_file_and_the_problem(tmp_path):
    good = Path(wl.shipped()["qwen3-4b-gsm8k"]).read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(good.replace('"lengths.median_tokens" =', '"lengths.median_tokenz" ='))
    with pytest.raises(ValueError, match=r"bad.toml.*no provenance for \['lengths.median_tokens'\]"):
        wl.load(bad)
    bad.write_text(good.replace('model = "qwen3-4b"', 'model = "gpt-9"'))
    with pytest.raises(ValueError, match="gpt-9"):
        wl.load(bad)
    with pytest.raises(KeyError, match="shipped"):
        wl.get("nope")


def test_sampling_respects_the_cap_and_the_turn_structure():
    import numpy as np

    spec = wl.get("qwen3-4b-aime-multiturn")
    s = wl.sample_step(spec, np.random.default_rng(0))
    assert len(s.turn_tokens) == spec.samples
    assert max(int(t.sum()) for t in s.turn_tokens) <= spec.lengths.max_tokens
    assert all(len(c) == len(t) - 1 == len(x) for c, t, x in zip(s.context_tokens, s.turn_tokens, s.tool_s))
    assert max(len(t) for t in s.turn_tokens) > 1


def test_simulator_does_not_import_torch():
    probe = ("import sys; import jigsaw.sim.run as r; r.simulate(r.SimConfig(steps=1, gpus=2, trace=False)); "
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_requests_migrated_onto_a_worker_about_to_wait_on_a_tool_run_there_first():
    # The target's own request ends its turn with a tool call at the step in flight; requests
    # arriving then must be prefilled there, not hidden behind a tool wait (whose record
    # would overlap their forward steps).
    from jigsaw.mux.model.costmodel import StepCost
    from jigsaw.mux.model.specs import H100
    from jigsaw.sim.request import Request
    from jigsaw.sim.rollout import RolloutWorker

    def target() -> RolloutWorker:
        wk = RolloutWorker(pipeline="p", step=0, rank=0, cost=StepCost(H100, "qwen3-4b"), mem_bytes=40 << 30)
        wk.add([Request(rid=0, context=100, turns=[1, 50], appended=[20], tool_s=[5.0])], 0.0)
        wk.plan()
        wk.commit()  # prefilled; the decode step that ends the turn is in flight
        wk.plan()
        return wk

    migrated = [Request(rid=1, context=300, turns=[10], appended=[], tool_s=[])]
    wk = target()
    wk.settle(float(wk.segment.ends[-1]))  # what a migration does first
    wk.add(migrated, wk.t)
    wk.plan()
    assert wk.segment.kind == "prefill" and not wk.tools
    alone = target()
    alone.interrupt(float(alone.segment.ends[-1]), 1.0)  # without the requests it would wait
    assert alone.segment.kind == "idle" and len(alone.tools) == 1


def test_view_graphs_are_valid_sub_stage_graphs():
    # The view builds its graphs without the checks (from_ordered); they must pass them.
    from jigsaw.graph.graph import SubStageGraph
    from jigsaw.node.state import NodeState

    runs, node, grid, pol = build(replace(SMALL, workload=("qwen3-4b-search-r1",) * 2, steps=2, trace=False))
    sim = NodeSim(runs, node, grid, pol, trace=False)
    seen = []
    original = NodeState.view

    def checked(self, now_s):
        view, live = original(self, now_s)
        for ps in view.pipelines:
            g = ps.graph
            full = SubStageGraph(list(g), g.deps)  # validates ids, deps, acyclicity
            assert set(full.substages) == set(g.substages) and full.deps == g.deps
            assert {k: set(v) for k, v in full._succ.items()} == {k: set(v) for k, v in g._succ.items()}
            pos = {s.id: k for k, s in enumerate(g)}
            assert all(pos[d] < pos[sid] for sid, ds in g.deps.items() for d in ds)  # topological
            assert set(ps.running) <= set(pos) and set(ps.urgent) <= set(pos)
            seen.append(len(g))
        return view, live

    NodeState.view = checked
    try:
        sim.run()
    finally:
        NodeState.view = original
    assert len(seen) > 50


def test_summarised_next_step_keeps_chain_lengths_and_device_work():
    # The look-ahead sees the next step through its longest chain and per-device work only.
    from jigsaw.graph.builder import predict_next
    from jigsaw.node.view import summarised

    runs, node, grid, pol = build(replace(SMALL, workload=("qwen3-4b-search-r1",), steps=2, trace=False))
    sim = NodeSim(runs, node, grid, pol, trace=False)
    sim.run()
    full = predict_next(list(sim.state.pipelines[runs[0].name].history))
    short = summarised(full)

    def longest(g):
        end = {}
        for s in g:  # topological order
            end[s.id] = s.duration_s + max((end[d] for d in g.deps[s.id]), default=0.0)
        return max(end.values())

    def work(g):
        out = {}
        for s in g:
            if s.kind.on_device:
                out[s.dp_rank] = out.get(s.dp_rank, 0.0) + s.duration_s
        return out

    assert len(short) < len(full) / 2
    assert longest(short) == pytest.approx(longest(full), rel=1e-9)
    assert work(short) == pytest.approx(work(full), rel=1e-9)


def test_rollout_memory_is_what_its_kv_needs_capped_by_the_pool():
    # A tail holding a few requests needs far less than the pool sized for the whole batch:
    # that is what lets it share a device with a training stage.
    from jigsaw.mux.model.costmodel import StepCost
    from jigsaw.mux.model.specs import A100
    from jigsaw.sim.request import Request
    from jigsaw.sim.rollout import RolloutWorker

    cost = StepCost(A100, "qwen3-4b")
    pool = cost.rollout_mem_bytes(200_000)
    wk = RolloutWorker(pipeline="p", step=0, rank=0, cost=cost, mem_bytes=pool, max_new_tokens=200)
    wk.add([Request(rid=i, context=500, turns=[20 * (i + 1)], appended=[], tool_s=[]) for i in range(8)], 0.0)
    while wk.plan() is not None:
        wk.commit()
    cols = wk.columns()
    base = cost.weights_bytes() + cost.config.rollout_reserve_bytes
    kv = cols.kv_tokens_used * cost.kv_bytes_per_token()
    # what its KV needs, and never less than room for one request to reach the cap (500 + 200)
    expected = base + np.maximum(kv, 700 * cost.kv_bytes_per_token())
    busy = cols.kv_tokens_used > 700
    assert busy.any() and np.allclose(cols.mem_bytes[busy], expected[busy], rtol=1e-6)
    assert np.all(cols.mem_bytes >= base + 500 * cost.kv_bytes_per_token()) and np.all(cols.mem_bytes <= pool)
    assert cols.mem_bytes[-1] < cols.mem_bytes.max()  # the tail frees what finished requests held
    assert int(wk.need_bytes(10**9)) == pool


def test_a_batched_prefill_attends_within_each_request():
    # A chunk of n requests of 300 new tokens each: every token attends to its own request,
    # so the cost grows linearly with n (one 28,800-token sequence would be quadratic).
    from jigsaw.mux.model.costmodel import StepCost
    from jigsaw.mux.model.specs import A100

    cost = StepCost(A100, "qwen3-4b")

    def chunk_s(n: int) -> float:
        return cost.prefill_s(300 * n, 0, n)

    assert chunk_s(64) - chunk_s(32) == pytest.approx(2 * (chunk_s(32) - chunk_s(16)), rel=1e-6)
    assert chunk_s(96) < 0.6 * cost.prefill_s(300 * 96, 0, 1)
    assert cost.prefill_s(300, 0) == cost.prefill_s(300, 0, 1)  # one request: as before


def test_a_first_piece_of_another_kind_than_asked_for_never_reuses_the_asked_id():
    # The client asks admission for the piece the first chunk predicts (prefill: 64 prompts
    # queued).  A grant holding one request at a time makes the first forward steps decode
    # instead; when the pool grows and migrated requests arrive, a prefill piece opens.  It
    # used to be prefill/0 again, an id the node had already been asked for and seen end
    # ("was already requested": the drawn-node property test, with plans that shrink pools).
    from jigsaw.mux.model.costmodel import StepCost
    from jigsaw.mux.model.specs import H100
    from jigsaw.sim.request import Request
    from jigsaw.sim.rollout import RolloutWorker

    cost = StepCost(H100, "qwen3-4b")
    wk = RolloutWorker(pipeline="p", step=0, rank=0, cost=cost, mem_bytes=40 << 30, max_new_tokens=400)
    wk.add([Request(rid=i, context=300, turns=[300 + 20 * i], appended=[], tool_s=[]) for i in range(64)], 0.0)
    ids = [wk.first_piece_id()]
    wk.grant(cost.weights_bytes() + cost.config.rollout_reserve_bytes + 700 * cost.kv_bytes_per_token())
    for n in range(1000):
        if wk.plan() is None:
            break
        wk.commit()
        if n == 40:
            wk.grant(40 << 30)
            wk.add([Request(rid=100 + i, context=1500, turns=[50], appended=[], tool_s=[]) for i in range(120)], wk.t)
        if wk.piece_id() != ids[-1]:
            ids.append(wk.piece_id())
    assert ids[0].endswith("rollout_prefill/0") and ids[1].endswith("rollout_decode/0")  # the asked one was not opened
    assert sum(i.endswith("rollout_prefill/1") for i in ids) == 1  # the later prefill piece
    assert len(set(ids)) == len(ids), ids
