"""Workloads as users describe them (issue 33): prompt classes, a tool-call tail that lasts
minutes, tool calls bounded by host cores, a cap on generated plus observation tokens, a start
step inside a drifting run.  Each field's statistics against what it specifies, its validation,
and its default leaving every existing workload's random stream alone (tests/unit/test_lengths.py
pins those streams)."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import numpy as np
import pytest
from factories import colocated

from jigsaw.mux.model.costmodel import StepCost
from jigsaw.mux.model.specs import H100
from jigsaw.sim import lengths as ln
from jigsaw.sim import workload as wl
from jigsaw.sim.request import Request
from jigsaw.sim.rollout import RolloutWorker

pytestmark = pytest.mark.timeout(60)

AIME = tomllib.loads(Path(wl.shipped()["qwen3-4b-aime"]).read_text())
SEARCH = tomllib.loads(Path(wl.shipped()["qwen3-4b-search-r1"]).read_text())
CLASSES = [{"weight": 0.7, "median_tokens": 300.0, "prompt_sigma": 0.3, "response_sigma": 0.2},
           {"weight": 0.3, "median_tokens": 6000.0, "prompt_sigma": 0.3, "response_sigma": 0.6}]


def make(base: dict = AIME, lengths: dict | None = None, tool: dict | None = None, **top) -> wl.WorkloadSpec:
    raw = {**base, "name": "t", **top}
    if lengths is not None:
        raw["lengths"] = lengths
    if tool is not None:
        raw["tool"] = {**base.get("tool", {}), **tool}
    every = {f"{p}{f.name}": "test" for p, cls in (("", wl.WorkloadSpec), ("lengths.", ln.Lengths),
                                                      ("tool.", wl.Tool)) for f in dataclasses.fields(cls)}
    raw["provenance"] = {**base["provenance"], **every}
    return wl.from_dict(raw, name="t")


def totals(s: wl.StepSamples) -> np.ndarray:
    return np.array([int(t.sum()) for t in s.turn_tokens])


# ---------------------------------------------------------------- prompt classes

def test_prompt_classes_keep_their_shares_medians_and_within_prompt_spreads():
    spec = make(lengths={"max_tokens": 32768, "classes": CLASSES}, prompts=3000, group=8)
    s = wl.sample_step(spec, np.random.default_rng(0))
    k = ln.class_index(spec.lengths, s.prompt_scale)
    assert abs((k == 0).mean() - 0.7) < 0.03
    logs = np.log(totals(s)).reshape(-1, spec.group)
    for c, want in enumerate(CLASSES):
        mine = logs[k == c]
        assert abs(np.exp(np.median(mine)) / want["median_tokens"] - 1) < 0.06
        within = np.sqrt(mine.var(axis=1, ddof=1).mean())
        assert abs(within - want["response_sigma"]) < 0.04, (c, within)
    overall = np.median(totals(s))
    assert abs(overall / spec.lengths.median_tokens - 1) < 0.1  # the derived median is the mixture's


def test_a_prompt_re_sampled_by_scale_keeps_its_class_spread():
    spec = make(lengths={"max_tokens": 32768, "classes": CLASSES}, group=64)
    s = wl.sample_step(spec, np.random.default_rng(1), prompt_scale=np.array([300.0, 6000.0]))
    logs = np.log(totals(s)).reshape(2, 64)
    assert logs[0].std(ddof=1) < 0.3 < 0.45 < logs[1].std(ddof=1)


@pytest.mark.parametrize("lengths,match", [
    ({"classes": [{**CLASSES[0], "weight": 0.5}]}, "lengths.classes.weights must be non-negative and sum to 1"),
    ({"classes": CLASSES, "tail_frac": 0.1, "pareto": {"alpha": 2.0, "scale_tokens": 100.0}},
     r"remove \['tail_frac'\]"),
    ({"classes": CLASSES, "response_sigma": 0.3}, "lengths.response_sigma is set per class"),
    ({"classes": [{"weight": 1.0, "median_tokens": 0.0}]}, "median_tokens must be > 0"),
    ({"classes": [{"weight": 1.0, "median": 5.0}]}, r"unknown key\(s\) \['median'\]"),
    ({"classes": []}, "non-empty array of tables"),
])
def test_bad_classes_are_refused_naming_the_field(lengths, match):
    with pytest.raises(ValueError, match=match):
        make(lengths={"max_tokens": 8192, **lengths})


def test_classes_need_one_source_and_derive_the_rest():
    spec = make(lengths={"max_tokens": 8192, "classes": CLASSES})
    paths = set(wl.parameter_paths(spec))
    assert "lengths.classes" in paths
    assert not paths & {"lengths.median_tokens", "lengths.prompt_sigma", "lengths.response_sigma"}


# ---------------------------------------------------------------- tools

def test_a_tool_tail_makes_rare_calls_last_minutes_then_cut_at_the_timeout():
    tool = {"tail_frac": 0.05, "tail_latency_s": 120.0, "timeout_s": 200.0}
    spec = make(SEARCH, tool=tool, prompts=1000, group=8)
    calls = np.concatenate(wl.sample_step(spec, np.random.default_rng(0)).tool_s)
    slow = calls > 10.0
    assert abs(slow.mean() - 0.05) < 0.01
    assert abs(np.median(calls[slow]) / 120.0 - 1) < 0.15
    assert calls.max() == 200.0 and np.median(calls[~slow]) < 1.0


@pytest.mark.parametrize("tool,match", [
    ({"tail_frac": 1.0, "tail_latency_s": 60.0}, r"tool.tail_frac must be in \[0, 1\)"),
    ({"tail_frac": 0.1, "tail_latency_s": 0.1}, "tool.tail_latency_s .* must exceed tool.latency_s"),
    ({"cores": -1}, "tool.cores must be an int >= 0"),
])
def test_bad_tool_fields_are_refused(tool, match):
    with pytest.raises(ValueError, match=match):
        make(SEARCH, tool=tool)


def test_tool_cores_need_a_tool():
    with pytest.raises(ValueError, match=r"tool.cores needs a tool"):
        make(tool={"cores": 4})


def _tool_run(cores: int, blocking: bool = False) -> tuple[list[float], float]:
    """Four requests whose first turn ends in a 10 s tool call, on one worker: when each call
    returns, and when the worker is done."""
    wk = RolloutWorker(pipeline="p", step=0, rank=0, cost=StepCost(H100, "qwen3-4b"), mem_bytes=40 << 30,
                       tool_cores=cores, blocking_tools=blocking)
    wk.add([Request(rid=i, context=50, turns=[1, 5], appended=[10], tool_s=[10.0]) for i in range(4)], 0.0)
    back: dict[int, float] = {}
    while not wk.done:
        if wk.plan() is None:
            break
        wk.commit()
        back.update({r.rid: r.ready_at for r in wk.in_tool})
    return sorted(back.values()), wk.t


def test_tool_calls_wait_for_a_free_core():
    free, end_free = _tool_run(0)
    one, end_one = _tool_run(1)
    two, _ = _tool_run(2)
    assert max(free) - min(free) < 0.1  # every call at once
    assert np.allclose(np.diff(one), 10.0, atol=0.1)  # one core: one call after the other
    assert np.allclose(two, [two[0], two[0], two[0] + 10.0, two[0] + 10.0], atol=0.1)
    assert end_one - end_free > 29.0


def test_a_blocked_batch_of_calls_returns_when_its_last_call_on_the_cores_does():
    free, _ = _tool_run(0, blocking=True)
    two, _ = _tool_run(2, blocking=True)
    assert len(set(np.round(two, 6))) == 1 and abs(two[0] - free[0] - 10.0) < 0.1


# ---------------------------------------------------------------- the cap, the start step

def test_a_cap_on_generated_and_observation_tokens_ends_trajectories_where_they_reach_it():
    lengths = {**SEARCH["lengths"], "max_tokens": 600, "median_tokens": 150.0, "cap_counts_observations": True}
    spec = make(SEARCH, lengths=lengths, prompts=500)
    s = wl.sample_step(spec, np.random.default_rng(0))
    spent = np.array([int(t.sum() + c.sum()) for t, c in zip(s.turn_tokens, s.context_tokens)])
    assert spent.max() <= 600 and (spent >= 540).mean() > 0.05  # some trajectories run into it
    assert all(len(c) == len(t) - 1 == len(x) for t, c, x in zip(s.turn_tokens, s.context_tokens, s.tool_s))
    loose = wl.sample_step(make(SEARCH, lengths={**lengths, "cap_counts_observations": False}, prompts=500),
                           np.random.default_rng(0))
    assert max(int(t.sum() + c.sum()) for t, c in zip(loose.turn_tokens, loose.context_tokens)) > 600


def test_the_start_step_is_where_drift_and_an_empirical_trace_count_from():
    drifting = {**AIME["lengths"], "drift_per_step": 0.02, "step_jitter_sigma": 0.1}
    late = make(lengths=drifting, start_step=40)
    early = make(lengths=drifting)
    a = wl.sample_step(late, np.random.default_rng(3), step=2)
    b = wl.sample_step(early, np.random.default_rng(3), step=42)
    assert np.array_equal(totals(a), totals(b))
    assert not np.array_equal(totals(a), totals(wl.sample_step(early, np.random.default_rng(3), step=2)))
    emp = wl.get("qwen3-4b-longcot-empirical")
    shifted = dataclasses.replace(emp, start_step=3, provenance={**emp.provenance, "start_step": "test"})
    assert np.array_equal(totals(wl.sample_step(shifted, np.random.default_rng(0), step=1)),
                          totals(wl.sample_step(emp, np.random.default_rng(0), step=4)))


def test_a_negative_start_step_is_refused():
    with pytest.raises(ValueError, match="start_step must be an int >= 0"):
        make(start_step=-1)


# ---------------------------------------------------------------- a model jigsaw does not ship

QWEN25_32B = {"num_hidden_layers": 64, "hidden_size": 5120, "intermediate_size": 27648, "num_attention_heads": 40,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 152064, "tie_word_embeddings": False}


def test_a_model_given_by_its_config_is_priced_by_its_shape(tmp_path):
    from jigsaw.mux.model.specs import MODELS

    spec = make(model="test-qwen2.5-32b", model_config=QWEN25_32B)
    shape = MODELS["test-qwen2.5-32b"]
    assert spec.model == "test-qwen2.5-32b" and abs(shape.params / 32.5e9 - 1) < 0.03  # the model card: 32.5B
    assert shape.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    from jigsaw.mux.model.specs import PriorConfig

    cost = StepCost(H100, "test-qwen2.5-32b", PriorConfig(fsdp_degree=16, rollout_tp=4))
    assert cost.decode_s(64, 64 * 2000) > StepCost(H100, "qwen3-4b").decode_s(64, 64 * 2000)
    shipped = wl.get("qwen2.5-32b-dapo")
    assert MODELS[shipped.model].params == 32.5e9  # the card's count where the workload gives it


def test_a_model_config_that_contradicts_a_known_model_or_lacks_a_shape_is_refused():
    with pytest.raises(ValueError, match="'qwen3-4b' is already known with another shape"):
        make(model="qwen3-4b", model_config=QWEN25_32B)
    with pytest.raises(ValueError, match=r"\[model_config\]: lacks 'vocab_size'"):
        make(model="test-broken", model_config={k: v for k, v in QWEN25_32B.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="unknown .*describe it in a \\[model_config\\] table"):
        make(model="test-nobody")


def test_a_trace_of_a_described_model_replays_in_a_process_that_never_loaded_its_workload(tmp_path):
    import subprocess
    import sys

    from jigsaw.sim.run import simulate

    raw = tomllib.loads(Path(wl.shipped()["qwen2.5-32b-dapo"]).read_text())
    raw.update(model="test-own-32b", prompts=8, gen_prompts=12, gpus=8)
    path = tmp_path / "own.toml"
    import tomli_w

    path.write_text(tomli_w.dumps(raw))
    res = simulate(colocated(workload=(str(path),), policy="jigsaw", steps=1))
    res.trace.write(tmp_path / "t.jsonl")
    code = ("from jigsaw.sim.replay import grid_of, recorded, replay; from jigsaw.trace import Trace; "
            "from jigsaw.graph.policies import make; rec = recorded(Trace.read('t.jsonl')); "
            "print(replay(rec, make('serial'), grid_of(rec)).makespan_s > 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
