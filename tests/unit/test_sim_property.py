"""Robustness as a property: workloads nobody tuned for, drawn by hypothesis.

For every drawn node (2–4 pipelines of 0.6–70B dense or MoE models, caps 1k–32k, groups,
turns, tools, TP / FSDP / offload, 4–64 GPUs) and every policy: the simulation finishes or
says cleanly why it cannot (`Infeasible`), never another exception; no invariant violation;
every sample trained once; no makespan below the lower bound (jigsaw on the placement its
trials chose included); the same workloads listed in another order give the same result.

JIGSAW_PROPERTY_EXAMPLES sets the number of examples (default 15; with the FOUND nodes about
three minutes on a 2-core machine).  Examples are derandomized: CI draws the same nodes every run;
JIGSAW_PROPERTY_RANDOM=1 (with pytest --hypothesis-seed=N) draws others.  Nodes longer runs
found failing are in FOUND and run every time.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from factories import write_workloads
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jigsaw.graph.policies import ASYNC_ONLY, NAMES
from jigsaw.mux.model.specs import MODELS
from jigsaw.sim.node import Infeasible
from jigsaw.sim.run import SimConfig, lower_bound, simulate

EXAMPLES = int(os.environ.get("JIGSAW_PROPERTY_EXAMPLES", "15"))
RANDOM = os.environ.get("JIGSAW_PROPERTY_RANDOM", "") not in ("", "0")
"""Draw other nodes than CI's (with pytest --hypothesis-seed=N to repeat a run)."""
pytestmark = pytest.mark.timeout(60 + 90 * EXAMPLES)
STEPS = 2


@st.composite
def workloads(draw, device: str) -> dict:
    """One pipeline's workload as TOML fields (every parameter sourced 'hypothesis')."""
    cap = draw(st.sampled_from([1024, 2048, 4096, 8192, 16384, 32768]))
    turns = draw(st.integers(1, 3))
    tool_s = draw(st.sampled_from([0.0, 0.5, 5.0, 30.0])) if turns > 1 else 0.0
    return {
        "model": draw(st.sampled_from(sorted(MODELS))), "device": device, "gpus": 8,
        "rollout_tp": draw(st.sampled_from([1, 2, 4, 8])),
        "offload": draw(st.sampled_from(["none", "none", "optimizer", "full"])),
        "prompts": draw(st.sampled_from([4, 8, 16, 32])), "group": draw(st.integers(1, 16)),
        "prompt_tokens": float(draw(st.sampled_from([60, 300, 1500]))), "prompt_sigma": 0.3,
        "mini_batch_prompts": draw(st.sampled_from([4, 16])), "micro_batch_seqs": 4, "logprob_micro_batch_seqs": 8,
        "gradient_checkpointing": draw(st.booleans()), "reward_s_per_sample": 0.0005,
        "lengths": {"median_tokens": float(cap * draw(st.sampled_from([0.05, 0.2, 0.5]))), "prompt_sigma": 0.4,
                    "response_sigma": 0.6, "max_tokens": cap},
        "turns": {"probs": [1.0 / turns] * turns, "context_tokens": 200 if turns > 1 else 0, "context_sigma": 0.3},
        "tool": {"latency_s": tool_s, "latency_sigma": 0.5 if tool_s else 0.0, "blocking": draw(st.booleans())},
    }


@st.composite
def nodes(draw) -> tuple[list[dict], int]:
    device = draw(st.sampled_from(["h100", "a100"]))
    pipes = draw(st.lists(workloads(device), min_size=2, max_size=4))
    tp = max(p["rollout_tp"] for p in pipes)
    gpus = draw(st.sampled_from([g for g in (4, 8, 16, 32, 64) if g >= tp]))
    return pipes, gpus


def _check(result, bound) -> None:
    assert not result.violations, (result.config.policy, result.violations[:3])
    for p in result.pipelines:
        assert p.steps == STEPS
    assert result.makespan_s >= bound.makespan_s * (1 - 1e-9)


def _drawn(model: str, **fields) -> dict:
    """A pipeline as `workloads` draws it; `fields` override (nested tables whole)."""
    base = {"model": model, "device": "h100", "gpus": 8, "rollout_tp": 1, "offload": "none", "prompts": 16,
            "group": 8, "prompt_tokens": 60.0, "prompt_sigma": 0.3, "mini_batch_prompts": 4, "micro_batch_seqs": 4,
            "logprob_micro_batch_seqs": 8, "gradient_checkpointing": True, "reward_s_per_sample": 0.0005,
            "lengths": {"median_tokens": 16384.0, "prompt_sigma": 0.4, "response_sigma": 0.6, "max_tokens": 32768},
            "turns": {"probs": [1 / 3] * 3, "context_tokens": 200, "context_sigma": 0.3},
            "tool": {"latency_s": 30.0, "latency_sigma": 0.5, "blocking": True}}
    return {**base, **fields}


def _lengths(median: float, cap: int) -> dict:
    return {"median_tokens": median, "prompt_sigma": 0.4, "response_sigma": 0.6, "max_tokens": cap}


def _tool(s: float, blocking: bool) -> dict:
    return {"latency_s": s, "latency_sigma": 0.5 if s else 0.0, "blocking": blocking}


FOUND = [
    # A worker re-enters its tail before its first tool wait (tail/1, then tool/0); the
    # prediction has tail/1 after tool/0, so tool/1 was taken as ready while tool/0 ran: its
    # hold filled the device and the other pipeline's urgent tail ran ungranted.
    ([_drawn("qwen3-0.6b"), _drawn("qwen3-0.6b", mini_batch_prompts=16)], 8),
    # A 30B MoE engine back from a tool needs 69.0 GB where 66.1 GB was predicted and a 14B
    # reference took the rest of the device meanwhile: its whole need fits nowhere beside
    # it, and it ran ungranted; an urgent engine now takes what the partner leaves.
    ([_drawn("qwen3-30b-a3b", prompts=32, group=13, prompt_tokens=1500.0, gradient_checkpointing=False,
             lengths=_lengths(204.8, 1024), tool=_tool(30.0, False)),
      _drawn("deepseek-r1-distill-qwen-14b", prompts=32, group=12, prompt_tokens=1500.0, mini_batch_prompts=16,
             lengths=_lengths(1638.4, 8192), turns={"probs": [0.5, 0.5], "context_tokens": 200, "context_sigma": 0.3},
             tool=_tool(0.0, True)),
      _drawn("qwen3-4b", offload="optimizer", prompts=8, group=4, prompt_tokens=300.0, mini_batch_prompts=16,
             gradient_checkpointing=False, lengths=_lengths(4096.0, 8192), tool=_tool(5.0, False)),
      _drawn("qwen3-30b-a3b", prompts=8, group=3, prompt_tokens=300.0, mini_batch_prompts=16,
             gradient_checkpointing=False, tool=_tool(5.0, False))], 8),
]
"""Nodes the 100-example runs found failing, run every time (each fixed, see the comments)."""


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@example(node=FOUND[0])
@example(node=FOUND[1])
@given(node=nodes())
def test_every_policy_runs_or_says_why_on_any_drawn_node(node, tmp_path_factory):
    pipes, gpus = node
    names = write_workloads(pipes, tmp_path_factory.mktemp("node"))
    cfg = SimConfig(workload=names, gpus=gpus, steps=STEPS, trace=False)
    try:
        bound = lower_bound(cfg)
    except Infeasible:
        bound = None  # the deployment itself cannot run: every policy must say so too
    ran = {}
    for policy in (p for p in NAMES if p not in ASYNC_ONLY):  # on synchronous nodes they are split again
        # jigsaw chooses its placement (trials of every shape); greedy, the same code at W = 1,
        # runs on every device, as it did before placements were chosen
        placement = "colocated" if policy == "greedy" else "auto"
        try:
            ran[policy] = simulate(replace(cfg, policy=policy, placement=placement))
        except Infeasible as exc:
            assert str(exc)
            continue
        assert bound is not None, f"{policy} ran a deployment the lower bound could not"
        _check(ran[policy], bound)
    # samples: every policy trained the same work
    assert len({(r.tokens, sum(p.samples for p in r.pipelines)) for r in ran.values()}) <= 1
    if "jigsaw" in ran and len(ran) > 1:  # reported (pytest -s), not asserted: issue 32's open goal
        best = min((p for p in ran if p != "jigsaw"), key=lambda p: ran[p].makespan_s)
        print(f"{'+'.join(names)} on {gpus}: jigsaw {ran[best].makespan_s / ran['jigsaw'].makespan_s:.3f}× {best}")
    for policy in ran.keys() & {"jigsaw", "static"}:  # listing order changes nothing
        again = simulate(replace(cfg, policy=policy, workload=names[::-1]))
        assert again.makespan_s == ran[policy].makespan_s
        assert {p.name: p.tokens for p in again.pipelines} == {p.name: p.tokens for p in ran[policy].pipelines}
