"""The simulator on workloads users bring: any order, any mix, the knobs of real RL recipes."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from factories import colocated

from jigsaw.sim import workload as wl
from jigsaw.sim.node import Infeasible
from jigsaw.sim.run import build, simulate

pytestmark = pytest.mark.timeout(240)
POLICIES = ("serial", "split", "static", "muxserve", "rollmux", "hrrs", "greedy", "jigsaw")


def _variant(tmp_path: Path, base: str, name: str, top: dict, sections: str = "") -> str:
    """A shipped workload with top-level fields changed (and their provenance), as a TOML path."""
    text = wl.shipped()[base].read_text()
    for key, value in top.items():
        line = f"{key} = {json.dumps(value)}"
        text, n = re.subn(rf"(?m)^{key} = .*$", line, text, count=1)
        if not n:
            text = text.replace("\n[lengths]", f"{line}\n\n[lengths]", 1)
        text = text.replace("[provenance]", f'[provenance]\n{key} = "test"', 1)
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace("[provenance]", sections + "\n[provenance]", 1))
    return str(path)


def _by_name(res) -> dict:
    return {p.name: (p.tokens, p.samples, p.step_latency_s) for p in res.pipelines}


@pytest.mark.parametrize("policy", ["serial", "jigsaw", "muxserve"])
def test_the_order_the_workloads_are_listed_in_changes_nothing(policy):
    cfg = colocated(workload=("qwen3-4b-gsm8k", "qwen3-0.6b-math"), policy=policy, gpus=4, steps=3, trace=False)
    a = simulate(cfg)
    b = simulate(replace(cfg, workload=("qwen3-0.6b-math", "qwen3-4b-gsm8k")))
    assert a.makespan_s == b.makespan_s and _by_name(a) == _by_name(b)


def test_per_pipeline_flags_follow_their_workload_whatever_the_order():
    cfg = colocated(workload=("qwen3-4b-gsm8k", "qwen3-0.6b-math"), policy="serial", gpus=8, steps=1,
                    trace=False, fsdp_degree=(2, 8))
    runs, *_ = build(cfg)
    runs_swapped, *_ = build(replace(cfg, workload=cfg.workload[::-1], fsdp_degree=(8, 2)))
    for rs in (runs, runs_swapped):
        assert {r.spec.name: r.cost.config.fsdp_degree for r in rs} == {"qwen3-4b-gsm8k": 2, "qwen3-0.6b-math": 8}
    with pytest.raises(ValueError, match="--fsdp-degree gives 1 values for 2 pipelines"):
        build(replace(cfg, fsdp_degree=(2,)))


def test_a_tp1_pipeline_runs_beside_a_tp4_one_as_four_engines_per_device():
    cfg = colocated(workload=("qwen3-4b-gsm8k-a100", "qwen3-32b-math"), gpus=8, steps=2, trace=False)
    runs, node, _, _ = build(replace(cfg, policy="serial"))
    small = next(r for r in runs if r.spec.model == "qwen3-4b")
    assert node.num_devices == 2 and small.cost.n == 4 and small.cost.config.rollout_tp == 1
    # four engines' worth of KV per device, each over a quarter of the batch
    assert small.cost.kv_bytes_per_token() == pytest.approx(small.cost.base.kv_bytes_per_token() / 4)
    assert small.cost.decode_s(64, 64_000) == pytest.approx(small.cost.base.decode_s(16, 16_000))
    for policy in POLICIES:
        try:
            res = simulate(replace(cfg, policy=policy))
        except Infeasible as exc:
            assert str(exc)  # a clean reason, never a traceback of another kind
            continue
        assert not res.violations, (policy, res.violations[:3])
        assert all(p.steps == 2 for p in res.pipelines)


def test_every_policy_trains_the_same_samples_under_tail_batching():
    cfg = colocated(workload=("qwen3-4b-gsm8k", "qwen3-0.6b-gsm8k"), gpus=4, steps=6, tailbatch=True, trace=False)
    work = {}
    for policy in POLICIES:
        res = simulate(replace(cfg, policy=policy))
        work[policy] = {p.name: (p.samples, p.tokens) for p in res.pipelines}
    assert len({json.dumps(w, sort_keys=True) for w in work.values()}) == 1, work


def test_ppo_epochs_repeat_the_training_pass(tmp_path):
    two = _variant(tmp_path, "qwen3-0.6b-gsm8k", "two-epochs", {"ppo_epochs": 2})
    stage = {}
    for name in ("qwen3-0.6b-gsm8k", two):
        res = simulate(colocated(workload=(name,), policy="serial", gpus=4, steps=2))
        steps = [e for e in res.trace.events if e.event == "step"]
        stage[name] = [e.data["tokens"] for e in steps], _stage_s(name, "training")
    assert stage[two][0] == stage["qwen3-0.6b-gsm8k"][0]  # the same samples
    assert stage[two][1] == pytest.approx(2 * stage["qwen3-0.6b-gsm8k"][1], rel=1e-6)


def _stage_s(workload: str, stage: str) -> float:
    from jigsaw.sim.node import NodeSim

    runs, node, grid, pol = build(colocated(workload=(workload,), policy="serial", gpus=4, steps=2, trace=False))
    NodeSim(runs, node, grid, pol, trace=False).run()
    return sum(m.stage_s[stage] for m in runs[0].metrics)


def test_dynamic_sampling_generates_more_and_trains_one_batch(tmp_path):
    section = "[dynamic_sampling]\nkeep_frac = 0.5\nmax_gen_batches = 3\n"
    ds = _variant(tmp_path, "qwen3-0.6b-gsm8k", "dapo", {}, section)
    ds = _with_provenance(ds, {"dynamic_sampling.keep_frac": "test", "dynamic_sampling.max_gen_batches": "test"})
    from jigsaw.sim.node import NodeSim

    runs, node, grid, pol = build(colocated(workload=(ds,), policy="serial", gpus=4, steps=3, trace=False))
    NodeSim(runs, node, grid, pol, trace=False).run()
    run = runs[0]
    assert [m.samples for m in run.metrics] == [256] * 3  # 64 prompts × 4 trained, as the recipe says
    generated = sum(len(wk.finished) for wk in run.workers)
    assert generated in (2 * 256, 3 * 256)  # whole generation batches until 64 prompts pass
    trained = {q.rid // 4 for q in run.trained_samples()}
    assert len(trained) == 64 and max(trained) >= 64  # the filter dropped some of the first batch
    plain, *_ = build(colocated(workload=("qwen3-0.6b-gsm8k",), policy="serial", gpus=4, steps=3, trace=False))
    NodeSim(plain, node, grid, pol, trace=False).run()
    assert run.metrics[-1].stage_s["rollout"] > plain[0].metrics[-1].stage_s["rollout"]


def _with_provenance(path: str, extra: dict) -> str:
    p = Path(path)
    lines = "".join(f'"{k}" = "{v}"\n' for k, v in extra.items())
    p.write_text(p.read_text().replace("[provenance]\n", "[provenance]\n" + lines, 1))
    return path


def test_a_reward_timeout_caps_every_call(tmp_path):
    slow = _variant(tmp_path, "qwen3-0.6b-gsm8k", "slow-reward", {},
                    "[reward]\nmedian_s = 0.2\nsigma = 1.0\ntimeout_s = 0.3\nper_batch = false\n")
    slow = _with_provenance(slow, {f"reward.{k}": "test" for k in ("median_s", "sigma", "timeout_s")})
    reward = _stage_s(slow, "reward")
    assert 256 * 2 * 0.05 < reward <= 256 * 2 * 0.3 + 1e-9  # slow calls counted, none above the timeout
    assert reward > 100 * _stage_s("qwen3-0.6b-gsm8k", "reward")


def test_an_empirical_length_trace_is_replayed_exactly():
    spec = wl.get("qwen3-4b-longcot-empirical")
    records = [json.loads(line) for line in (wl.shipped()["qwen3-4b-longcot-empirical"].with_suffix(".jsonl"))
               .read_text().splitlines()]
    res = simulate(colocated(workload=(spec.name,), policy="jigsaw", steps=3, trace=True))
    steps = sorted((e.data["step"], e.data["tokens"], e.data["samples"]) for e in res.trace.events
                   if e.event == "step")
    for step, tokens, samples in steps:
        mine = [r for r in records if r["step"] == step]
        assert samples == len(mine) == spec.samples
        assert tokens == sum(r["prompt_len"] + r["response_len"] for r in mine)
    assert not res.violations


def test_the_policy_table_survives_an_infeasible_policy_and_violations_fail_the_run(tmp_path, capsys):
    from jigsaw.cli.main import main

    out = tmp_path / "t.jsonl"
    rc = main(["sim", "--workload", "qwen3-32b-math,qwen3-32b-math", "--policy", "all", "--steps", "1",
               "--no-bound", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and out.exists()
    for policy in POLICIES:
        assert re.search(rf"│ {policy}\s+│", text), policy
    assert "infeasible: rollmux: qwen3-32b-math on 1 of 2 devices" in " ".join(text.split())
    assert "every policy trained the same" in text


def test_violations_are_printed_and_make_the_exit_code_nonzero(capsys):
    from rich.console import Console

    from jigsaw.cli.sim import _violations

    res = simulate(colocated(workload=("qwen3-0.6b-gsm8k",), policy="serial", gpus=4, steps=1, trace=False))
    log = Console(force_terminal=False, width=200)
    assert _violations({"serial": res}, log) is False
    bad = replace(res, violations=("t=1.000: x runs on device 0 without a grant",))
    assert _violations({"serial": res, "jigsaw": bad}, log) is True
    assert "jigsaw: 1 violation(s), first: t=1.000: x runs on device 0 without a grant" in capsys.readouterr().out


@pytest.mark.parametrize("policy", ["greedy", "jigsaw"])
def test_an_engine_whose_regime_changes_is_placed_by_what_it_holds(policy):
    # Two long-CoT pipelines: a worker's prefill ends into its tail beside the other's tail.
    # Planned with its history's peak memory (the whole batch's KV) the two tails did not fit
    # together, the tail was left waiting and ran without a budget (violations).
    res = simulate(colocated(workload=("qwen3-4b-longcot-empirical",) * 2, steps=2, policy=policy, trace=False))
    assert not res.violations, res.violations[:3]


@pytest.mark.parametrize("policy", ["greedy", "jigsaw"])
def test_a_running_engine_beside_a_new_one_is_planned_by_what_it_holds(policy):
    # A small model's prefill ends into its tail beside the long-CoT tail that keeps running.
    # Planned with the running tail's history peak the new tail found no split beside it
    # ("no grid split fits beside the partner") and ran without a budget (38 violations).
    res = simulate(colocated(workload=("qwen3-4b-longcot-empirical", "qwen3-0.6b-math"), steps=2, policy=policy,
                             trace=False))
    assert not res.violations, res.violations[:3]


def test_the_physics_price_each_side_by_its_own_model_not_the_planning_mix():
    from jigsaw.mux.model.prior import analytic_pair_prior, pair_actual
    from jigsaw.mux.model.specs import A100
    from jigsaw.sim.physics import Physics

    runs, _, grid, _ = build(colocated(workload=("qwen3-4b-gsm8k-a100", "qwen3-32b-math"), gpus=8, steps=1,
                                       policy="serial", trace=False))
    keys = [(r.spec.model, r.cost.config) for r in runs]
    physics = Physics.of(grid, runs)
    small, big = (0, 1) if runs[0].spec.model == "qwen3-4b" else (1, 0)
    units = [(small, "rollout_decode", 0.5, 0.4), (big, "rollout_decode", 0.5, 0.6)]
    want = pair_actual(analytic_pair_prior(A100, keys[small], keys[big]),
                       analytic_pair_prior(A100, keys[big], keys[small]), units[0][1:], units[1][1:])
    got = physics.actual(units)
    assert want is not None and got == pytest.approx(want)
    planned = grid.actual(units[0][1:], units[1][1:])  # the mix is never more optimistic than the truth
    assert planned is None or (planned[0] >= got[0] - 1e-9 and planned[1] >= got[1] - 1e-9 and planned != got)


@pytest.mark.parametrize("policy", ["greedy", "jigsaw"])
def test_a_mixed_pair_is_planned_with_its_own_models_not_the_mix(policy):
    # The plan's predicted slowdown of every co-located pair of two models is the exact pair
    # view's (each side its own model), the one the physics charges; the mix prior (the worst
    # pairing, entrywise) differs on them, so a scheduler planning with it fails this.
    from jigsaw.graph.ids import SubStageId
    from jigsaw.sim.node import NodeSim

    runs, node, grid, pol = build(colocated(workload=("qwen3-4b-longcot-empirical", "qwen3-0.6b-math"), steps=1,
                                            policy=policy, trace=False))
    plans = []
    plan = pol.plan
    pol.plan = lambda view: plans.append(plan(view)) or plans[-1]
    sim = NodeSim(runs, node, grid, pol, trace=False)
    sim.run()
    assert not sim.violations, sim.violations[:3]
    pairs, checked, off_mix = sim.state.pairs, 0, 0
    for p in plans:
        by_device: dict[int, list] = {}
        for a in p.assignments:
            by_device.setdefault(a.device, []).append(a)
        for a, b in (v for v in by_device.values() if len(v) == 2 and v[0].pipeline != v[1].pipeline):
            ka, kb = SubStageId.parse(a.substage).kind.value, SubStageId.parse(b.substage).kind.value
            mem = a.mem_bytes / node.mem_bytes
            exact = pairs.between(a.pipeline, b.pipeline).pair(ka, kb, a.sm_frac, mem)
            assert exact is not None and (a.slowdown, b.slowdown) == pytest.approx(exact, rel=1e-6)
            checked += 1
            off_mix += grid.pair(ka, kb, a.sm_frac, mem) != pytest.approx(exact, rel=1e-6)
    assert checked > 0 and off_mix > 0, (checked, off_mix)


def test_a_generation_round_larger_than_the_training_batch_is_generated_and_filtered(tmp_path):
    section = "[dynamic_sampling]\nkeep_frac = 0.8\nmax_gen_batches = 3\n"
    prov = {"dynamic_sampling.keep_frac": "test", "dynamic_sampling.max_gen_batches": "test"}
    from jigsaw.sim.node import NodeSim

    generated = {}
    for gen in (0, 100):
        path = _with_provenance(_variant(tmp_path, "qwen3-0.6b-gsm8k", f"dapo{gen}", {"gen_prompts": gen}, section),
                                prov)
        runs, node, grid, pol = build(colocated(workload=(path,), policy="serial", gpus=4, steps=1, trace=False))
        NodeSim(runs, node, grid, pol, trace=False).run()
        assert runs[0].metrics[0].samples == 64 * 4  # the training batch, whatever was generated
        generated[gen] = sum(len(wk.finished) for wk in runs[0].workers)
    # 80% of 64 prompts is short of 64: two rounds of the batch; 80% of 100 is enough: one round of 100
    assert generated == {0: 2 * 64 * 4, 100: 100 * 4}


def test_reward_workers_run_calls_side_by_side(tmp_path):
    reward = "[reward]\nmedian_s = 0.2\nsigma = 0.5\nworkers = {}\n"
    prov = {"reward.median_s": "test", "reward.sigma": "test", "reward.workers": "test"}
    times = {n: _stage_s(_with_provenance(_variant(tmp_path, "qwen3-0.6b-gsm8k", f"rw{n}", {}, reward.format(n)),
                                          prov), "reward") for n in (1, 8, 0)}
    # per step: 256 calls one after another; a pool of 8; all at once (the slowest call)
    assert times[1] > 6 * times[8] > 6 * times[0] and times[0] < 2 * 0.2 * 2 * 5


def test_reward_wall_time_is_the_pool_schedule():
    spec = wl.get("qwen3-0.6b-gsm8k")
    pool = lambda n: replace(spec, reward=wl.Reward(median_s=1.0, workers=n),  # noqa: E731
                             provenance={**spec.provenance, "reward.median_s": "t", "reward.workers": "t"})
    calls = [3.0, 1.0, 2.0, 2.0]
    assert [wl.reward_wall_s(pool(n), calls) for n in (1, 2, 0, 9)] == [8.0, 5.0, 3.0, 3.0]


def test_tool_cores_slow_an_agent_rollout_that_outnumbers_them(tmp_path):
    text = wl.shipped()["qwen3-4b-search-r1"].read_text().replace("blocking = true", "blocking = true\ncores = 4")
    path = tmp_path / "few-cores.toml"
    path.write_text(text.replace("[provenance]", '[provenance]\n"tool.cores" = "test"', 1))
    # 256 trajectories' batched search calls on one core per worker instead of all at once
    assert _stage_s(str(path), "rollout") > 1.5 * _stage_s("qwen3-4b-search-r1", "rollout")


@pytest.mark.parametrize("policy", ["greedy", "jigsaw"])
def test_agents_back_from_their_tools_are_granted_beside_what_took_the_device_meanwhile(policy):
    # Two Qwen3-32B SWE agents on 8 H100: a worker back from a tool call found the other
    # pipeline's tail (49 GiB) or training on its device; no memory level held both, and the
    # engine ran without a grant (3-5 violations in 2 steps before the split by need).
    res = simulate(colocated(workload=("qwen3-32b-swe-agent",) * 2, steps=2, policy=policy,
                             trace=False))
    assert not res.violations, res.violations[:3]
