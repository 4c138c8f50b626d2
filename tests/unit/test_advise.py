"""`jigsaw advise` and the cost columns: jobs from solo traces, a pair under jigsaw / one after the
other / a static split, slowdowns against alone, the best grouping of more jobs, and what a run
costs (sim/cost.py) in `jigsaw sim`, `jigsaw advise` and the timeline's page."""

from __future__ import annotations

import itertools
import re

import pytest
from factories import colocated

from jigsaw import timeline as tlm
from jigsaw.cli.main import main
from jigsaw.sim import advise as adv
from jigsaw.sim.cost import cost_of
from jigsaw.sim.replay import grid_of, recorded
from jigsaw.sim.run import simulate
from jigsaw.trace import Trace

STEPS = 3


def _solo(tmp_path, workload: str, seed: int = 1):
    path = tmp_path / f"{workload}-{seed}.jsonl"
    simulate(colocated(workload=(workload,), gpus=4, steps=STEPS, seed=seed, policy="serial")).trace.write(path)
    return path


@pytest.fixture(scope="module")
def solos(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("solo")
    return [_solo(tmp, w) for w in ("qwen3-0.6b-gsm8k", "qwen3-4b-gsm8k-multiturn", "qwen3-4b-gsm8k")]


@pytest.fixture(scope="module")
def grid(solos):
    return grid_of(recorded(Trace.read(solos[0])))


def test_cost_is_devices_times_time_over_steps_and_tokens():
    c = cost_of(device_s=8 * 1800.0, steps=4, tokens=2_000_000, usd_per_gpu_hour=2.0)
    assert c.gpu_hours == pytest.approx(4.0) and c.gpu_hours_per_step == pytest.approx(1.0)
    assert c.usd_per_mtok == pytest.approx(2.0 * 4.0 / 2.0)
    assert cost_of(device_s=3600.0, steps=0, tokens=0).cells() == ("0", "—")
    with pytest.raises(ValueError, match="usd-per-gpu-hour"):
        cost_of(device_s=1.0, steps=1, tokens=1, usd_per_gpu_hour=0.0)


def test_one_after_the_other_is_the_two_alone_back_to_back_and_nobody_slows(solos, grid):
    a, b = adv.jobs_of(solos[:2], warmup_steps=0)
    pair = adv.advise_pair(a, b, grid)
    serial = pair.options["serial"]
    assert serial.makespan_s == pytest.approx(pair.alone[a.name].makespan_s + pair.alone[b.name].makespan_s, rel=1e-6)
    assert [pair.slowdown("serial", n) for n in pair.jobs] == pytest.approx([1.0, 1.0])
    for o in pair.options.values():  # every policy does all the work of both
        assert o.refused is None and o.tokens == a.tokens + b.tokens > 0
    co = pair.options["jigsaw"]
    assert co.makespan_s < serial.makespan_s  # co-located, the pair ends earlier than back to back ...
    assert max(pair.slowdown("jigsaw", n) for n in pair.jobs) > 1.0  # ... and someone's steps pay for it
    assert co.cost.gpu_hours == pytest.approx(co.num_devices * co.makespan_s / 3600)


def test_jobs_leave_the_warmup_out_and_two_of_one_name_are_told_apart(solos):
    full, = adv.jobs_of(solos[:1], warmup_steps=0)
    later, = adv.jobs_of(solos[:1], warmup_steps=1)
    assert (full.steps, later.steps) == (STEPS, STEPS - 1) and 0 < later.tokens < full.tokens
    twice = adv.jobs_of([solos[0], solos[0]], warmup_steps=0)
    assert len({j.name for j in twice}) == 2 and twice[1].name.startswith(twice[0].name + "@")
    assert {s.pipeline for s in twice[1].state.graph.substages} == {twice[1].name}
    assert twice[1].tokens == twice[0].tokens


def test_the_best_pairing_is_searched_not_built_greedily():
    alone = dict.fromkeys("abcd", 10.0)
    # The cheapest pair (a, b) leaves (c, d), which pair badly: greedy gets 12 + 19 = 31.
    pairs = {frozenset(k): v for k, v in {"ab": 12.0, "cd": 19.0, "ac": 15.0, "bd": 15.0, "ad": 20.0,
                                          "bc": 20.0}.items()}
    got = adv.best_pairing("abcd", alone, pairs)
    assert sorted(map(sorted, got.groups)) == [["a", "c"], ["b", "d"]] and got.node_s == 30.0
    assert got.alone_node_s == 40.0
    worse = {k: 25.0 for k in pairs}  # every pair costs more than its two alone: nobody pairs
    assert adv.best_pairing("abcd", alone, worse).groups == (("a",), ("b",), ("c",), ("d",))


def test_three_jobs_get_the_grouping_with_the_fewest_node_hours(solos, grid):
    jobs = adv.jobs_of(solos, warmup_steps=0)
    pairs, pairing = adv.advise(jobs, grid)
    assert len(pairs) == 3
    alone = {n: o.node_s for p in pairs for n, o in p.alone.items()}
    paired = {frozenset(p.jobs): p.options["jigsaw"].node_s for p in pairs}
    names = [j.name for j in jobs]
    every = [sum(alone.values())] + [paired[frozenset(two)] + alone[next(n for n in names if n not in two)]
                                     for two in itertools.combinations(names, 2)]
    assert pairing.node_s == pytest.approx(min(every)) and pairing.alone_node_s == pytest.approx(every[0])
    assert sorted(n for g in pairing.groups for n in g) == sorted(names)


def test_advise_needs_two_jobs_and_at_most_max_jobs(solos, grid):
    one = adv.jobs_of(solos[:1], warmup_steps=0)
    with pytest.raises(ValueError, match="at least two jobs"):
        adv.advise(one, grid)
    with pytest.raises(ValueError, match=f"at most {adv.MAX_JOBS}"):
        adv.best_pairing([str(i) for i in range(adv.MAX_JOBS + 1)], {}, {})


def test_cli_prints_the_pair_the_verdict_and_prices_it(solos, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps the verdict at a narrow terminal's width
    assert main(["advise", str(solos[0]), str(solos[1]), "--warmup-steps", "0", "--usd-per-gpu-hour", "2.5"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"(do not )?pair them: jigsaw co-located is \d\.\d\d× one after the other", out)
    for policy in adv.PAIR_POLICIES:
        assert re.search(rf"│ {policy}\s+│", out)
    assert "$/M tok" in out and "—" not in out.split("predicted")[1]  # priced: a $ figure in every row
    assert main(["advise", str(solos[0]), "--warmup-steps", "0"]) == 2  # one job: an error, not a traceback
    assert "at least two jobs" in capsys.readouterr().err
    assert main(["advise", str(solos[0]), str(solos[1]), "--usd-per-gpu-hour", "-1"]) == 2


def test_sim_table_prices_each_policy_from_its_makespan():
    import io

    from rich.console import Console

    from jigsaw.cli.sim import _table

    config = colocated(workload=("qwen3-0.6b-gsm8k",), gpus=4, steps=2, policy="serial")
    r = simulate(config)
    out = io.StringIO()
    Console(file=out, width=250).print(_table({"serial": r}, None, config, {}, usd_per_gpu_hour=3.0))
    want = cost_of(device_s=4 * r.makespan_s, steps=2, tokens=r.tokens, usd_per_gpu_hour=3.0)
    row = next(line for line in out.getvalue().splitlines() if line.startswith("│ serial"))
    assert [c.strip() for c in row.split("│")[-3:-1]] == list(want.cells())
    unpriced = io.StringIO()
    Console(file=unpriced, width=250).print(_table({"serial": r}, None, config, {}))
    assert "GPU-h/step" not in unpriced.getvalue()  # no price asked: the table keeps its width


def test_timeline_page_prices_each_pipeline_by_its_share_and_the_node_by_its_devices(solos):
    tl = tlm.build(Trace.read(solos[0]))
    page = tlm.html_page(tl, usd_per_gpu_hour=2.0)
    node = cost_of(device_s=tl.window_s * len(tl.devices), steps=sum(tl.steps.values()),
                   tokens=sum(tl.tokens.values()), usd_per_gpu_hour=2.0)
    row = re.search(r"<tr><td>node: 4 GPUs held</td>.*?</tr>", page).group(0)
    assert row.endswith("".join(f"<td>{c}</td>" for c in node.cells()) + "</tr>")
    assert "<th>GPU-h/step</th><th>$/M tok</th>" in page


def test_advise_on_two_recorded_cpu_demo_jobs_predicts_the_measured_pairing_within_10_percent(tmp_path):
    """tests/recorded/README.md: each job's real run alone, and the two run together under jigsaw."""
    import gzip
    from pathlib import Path

    from jigsaw.mux.model.slowdown import load_grid
    from jigsaw.profiles import CPU_DEFAULT, resolve
    from jigsaw.sim.replay import recorded_tokens_per_s

    here = Path(__file__).resolve().parents[1] / "recorded"

    def unpacked(name: str) -> Trace:
        path = tmp_path / name.removesuffix(".gz")
        path.write_bytes(gzip.decompress((here / name).read_bytes()))
        return Trace.read(path)

    solos = []
    for name, solo in adv.per_pipeline(unpacked("cpu-demo-serial-live.trace.jsonl.gz")).items():
        solos.append(tmp_path / f"{name}.jsonl")
        solo.write(solos[-1])
    a, b = adv.jobs_of(solos, warmup_steps=1)
    # The grid the daemon planned with, by name (the trace holds its path on the recording machine).
    pair = adv.advise_pair(a, b, load_grid(resolve(CPU_DEFAULT)))
    measured = recorded_tokens_per_s(unpacked("cpu-demo-jigsaw.trace.jsonl.gz"), first_step=1)
    assert measured == pytest.approx(3346, rel=1e-3)  # the README's number: the right recording
    assert pair.options["jigsaw"].tokens_per_s == pytest.approx(measured, rel=0.10)
    assert pair.gain("jigsaw", "serial") > 1.5  # a pairing worth making, as measured (3,346 vs 1,613 tokens/s)


def test_jobs_of_different_models_are_priced_by_their_pair_views_as_the_simulator_prices_them(solos, grid):
    """A 0.6B and a 4B job: one grid (the first trace's, the 0.6B's) would price the 4B's training
    beside the 0.6B's rollout as the 0.6B's own; the advice follows the simulator's pricing."""
    a, b = adv.jobs_of(solos[:2], warmup_steps=0)
    assert a.deployment[1][0] != b.deployment[1][0]  # two models, both known from the traces
    sim = {p: simulate(colocated(workload=("qwen3-0.6b-gsm8k", "qwen3-4b-gsm8k-multiturn"), gpus=4, steps=STEPS,
                                 seed=1, policy=p)) for p in ("serial", "static")}
    simulated = sim["static"].tokens_per_s / sim["serial"].tokens_per_s
    viewed = adv.advise_pair(a, b, grid).gain("static", "serial")
    one_grid = adv.advise_pair(a, b, grid, views=False).gain("static", "serial")
    assert abs(viewed / simulated - 1) < abs(one_grid / simulated - 1)
    assert viewed == pytest.approx(simulated, rel=0.05)
