"""The cluster layer (issue 35): nodes of kinds, placement of pipelines on them, and the
cluster simulated with the same simulator a node runs.

The placement search is tested against an exhaustive enumeration written independently here
(itertools over every grouping and node count); estimates in those tests are tables, because
the search is a pure function of them.  The simulator tests run the real simulator."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from jigsaw.cli.main import main
from jigsaw.cluster.placement import RESIDENCY, Group, admit, place
from jigsaw.cluster.simulate import ClusterConfig, estimator, group_config, simulate_cluster, trial_streams
from jigsaw.cluster.spec import NodeKind, parse_nodes
from jigsaw.graph.placement import groupings
from jigsaw.sim.run import SimConfig, simulate

pytestmark = pytest.mark.timeout(600)


def test_nodes_parse_into_kinds_and_malformed_ones_say_why():
    assert parse_nodes("4xh100, 2xa100:4,1xh100") == (NodeKind(kind="h100", count=5, gpus=8),
                                                       NodeKind(kind="a100", count=2, gpus=4))
    for bad, says in (("4*h100", "COUNTxKIND"), ("2xb200", "unknown"), ("0xh100", "at least one node"),
                      ("1xh100:0", "at least one"), (",", "names no node")):
        with pytest.raises(ValueError, match=says):
            parse_nodes(bad)
    with pytest.raises(ValueError, match="unknown"):
        ClusterConfig(nodes="2xtpu")  # a usage error before any trial runs
    with pytest.raises(ValueError, match="cluster-policy"):
        ClusterConfig(nodes="1xh100", cluster_policy=("verl",))


@pytest.mark.parametrize("count,expected", [(1, 1), (2, 2), (3, 4), (4, 10), (5, 26), (6, 76)])
def test_every_grouping_into_singles_and_pairs_once(count, expected):
    got = list(groupings(count, 2))
    assert len(got) == expected == len({frozenset(map(frozenset, g)) for g in got})  # the telephone numbers
    for g in got:
        assert sorted(i for group in g for i in group) == list(range(count))
        assert all(1 <= len(group) <= 2 for group in g)
    assert list(groupings(count, 1)) == [tuple((i,) for i in range(count))]


def _brute(count, cluster, estimate, max_group):
    """The best (makespan, GPU-seconds) over every grouping and every node count of every kind."""
    best = (math.inf, math.inf)
    options = [(k, n) for k, node in enumerate(cluster) for n in range(1, node.count + 1)]
    for grouping in groupings(count, max_group):
        for pick in itertools.product(options, repeat=len(grouping)):
            used = [sum(n for k2, n in pick if k2 == k) for k in range(len(cluster))]
            if any(u > node.count for u, node in zip(used, cluster)):
                continue
            groups = [Group(pipelines=g, kind=cluster[k].kind, gpus_per_node=cluster[k].gpus, nodes=n)
                      for g, (k, n) in zip(grouping, pick)]
            times = [estimate(g) for g in groups]
            if any(math.isinf(t) for t in times):
                continue
            key = (max(times), sum(g.gpus * t for g, t in zip(groups, times)))
            if key[0] < best[0] - 1e-9 or (abs(key[0] - best[0]) <= 1e-9 and key[1] < best[1]):
                best = key
    return best


@pytest.mark.parametrize("seed", range(12))
def test_placement_finds_what_an_exhaustive_search_finds(seed):
    rng = random.Random(seed)
    count = rng.choice([2, 3, 4])
    cluster = (NodeKind(kind="h100", count=rng.choice([1, 2, 3]), gpus=8),
               NodeKind(kind="a100", count=rng.choice([1, 2]), gpus=4))
    table: dict = {}
    cut: list[Group] = []

    def estimate(g: Group, until_s: float | None = None) -> float:
        if g not in table:  # a random group cannot run (inf) one time in eight
            table[g] = math.inf if rng.random() < 0.125 else rng.uniform(10, 100) / g.nodes ** rng.uniform(0, 1)
        return table[g]

    def stops(g: Group, until_s: float | None) -> float:
        """A trial stopped at the bound it is given, as the simulator's is (node.Cut)."""
        t = estimate(g)
        if until_s is not None and t > until_s:
            cut.append(g)
            return math.inf
        return t

    for max_group in (1, 2):
        want = _brute(count, cluster, estimate, max_group)
        if math.isinf(want[0]):
            with pytest.raises(ValueError):
                place(count, cluster, estimate, max_group)
            continue
        for how in (estimate, stops):
            got = place(count, cluster, how, max_group)
            assert (got.makespan_s, got.gpu_s) == pytest.approx(want)
            assert sorted(i for g in got.groups for i in g.pipelines) == list(range(count))
            for node in cluster:  # no node given twice
                assert sum(g.nodes for g in got.groups if g.kind == node.kind) <= node.count
    assert seed != 0 or cut  # the bound does stop trials (seed 0 has some); never one of the winners'


def test_a_trial_is_bounded_by_the_best_placement_found_before_it():
    cluster = (NodeKind(kind="h100", count=2),)
    bounds: dict[Group, float | None] = {}

    def estimate(g: Group, until_s: float | None = None) -> float:
        bounds[g] = until_s
        return {1: 30.0, 2: 20.0}[g.nodes] if len(g.pipelines) == 2 else 25.0

    got = place(2, cluster, estimate, max_group=2)
    assert [(g.pipelines, g.nodes) for g in got.groups] == [((0, 1), 2)]
    first = next(iter(bounds))
    assert first.pipelines == (0, 1) and first.nodes == 2 and bounds[first] is None  # pairs, most nodes first
    assert all(b == pytest.approx(20.0) for g, b in bounds.items() if g != first)  # every later one bounded


def test_a_pair_shares_nodes_where_its_estimate_beats_each_alone_and_kinds_go_where_they_run_fastest():
    cluster = (NodeKind(kind="h100", count=1), NodeKind(kind="a100", count=1))
    calls: list[Group] = []

    def estimate(g: Group, until_s: float | None = None) -> float:
        calls.append(g)
        speed = {"h100": 1.0, "a100": 2.0}[g.kind]
        if g.pipelines == (0, 1):
            return 14.0 * speed / g.nodes  # the pair on one node ends before either alone on the slower kind
        return (10.0 if g.pipelines == (0,) else 8.0) * speed / g.nodes

    alone = place(2, cluster, estimate, max_group=1)
    assert {g.pipelines: g.kind for g in alone.groups} == {(0,): "h100", (1,): "a100"}  # the longer one on h100
    assert alone.makespan_s == 16.0
    calls.clear()
    paired = place(2, cluster, estimate, max_group=2)
    assert [(g.pipelines, g.kind, g.nodes) for g in paired.groups] == [((0, 1), "h100", 1)]
    assert paired.makespan_s == 14.0 and paired.gpu_s == 8 * 14.0
    assert len(calls) == len(set(calls)) == paired.estimates  # each group once


def test_each_group_is_estimated_once_and_equal_makespans_keep_the_fewest_gpus():
    cluster = (NodeKind(kind="h100", count=2),)
    calls: list[Group] = []

    def estimate(g: Group, until_s: float | None = None) -> float:
        calls.append(g)
        return 10.0  # whatever the group: two nodes buy nothing

    got = place(2, cluster, estimate, max_group=2)
    assert len(calls) == len(set(calls)) == got.estimates
    assert [(g.pipelines, g.nodes) for g in got.groups] == [((0, 1), 1)]  # 80 GPU-s, not 160 or 240
    with pytest.raises(ValueError, match="need more nodes"):
        place(3, cluster, estimate, max_group=1)


SIM = SimConfig(workload=("qwen3-0.6b-gsm8k", "qwen3-0.6b-math"), steps=2, trace=False)


def _table(alone: dict[int, float], together: float, kinds: dict[str, float] | None = None):
    """An estimate: pipeline i alone takes alone[i] (× its kind's factor), any group of several
    `together` × their slowest alone; every call counted."""
    calls: list[Group] = []
    factor = kinds or {"h100": 1.0, "a100": 2.0}

    def estimate(g: Group, until_s: float | None = None) -> float:
        calls.append(g)
        t = max(alone[i] for i in g.pipelines) * factor[g.kind] / g.nodes
        return t if len(g.pipelines) == 1 else together * t

    return estimate, calls


def test_rollmux_admission_packs_within_its_slo_before_it_takes_a_node_and_never_searches():
    cluster = (NodeKind(kind="h100", count=2), NodeKind(kind="a100", count=2))
    estimate, calls = _table({0: 10.0, 1: 10.0, 2: 10.0}, together=1.5)  # packing: 1.5x, within a 2x SLO
    got = admit(3, cluster, estimate)
    assert [(g.pipelines, g.kind, g.nodes) for g in got.groups] == [((0, 1, 2), "h100", 1)]  # one node held
    assert got.makespan_s == 15.0 and len(calls) == len(set(calls)) == got.estimates
    estimate, _ = _table({0: 10.0, 1: 10.0, 2: 10.0}, together=2.5)  # packing breaks the SLO: a node each
    got = admit(3, cluster, estimate)
    assert [(g.pipelines, g.kind) for g in got.groups] == [((0,), "h100"), ((1,), "h100"), ((2,), "a100")]
    estimate, _ = _table(dict.fromkeys(range(5), 10.0), together=2.5)  # no node left for the fifth: packed
    got = admit(5, cluster, estimate)
    assert sorted(len(g.pipelines) for g in got.groups) == [1, 1, 1, 2] and sum(g.nodes for g in got.groups) == 4
    estimate, _ = _table(dict.fromkeys(range(RESIDENCY + 1), 1.0), together=1.0)
    assert [len(g.pipelines) for g in admit(RESIDENCY + 1, cluster, estimate).groups] == [RESIDENCY, 1]


def test_rollmux_admission_holds_fewer_gpus_where_the_search_ends_sooner():
    # Two pipelines packed 1.5x slower than alone: within RollMux's SLO, so it packs them on one
    # node and leaves the other free; the search, for the makespan, gives the pair both nodes.
    cluster = (NodeKind(kind="h100", count=2),)
    estimate, _ = _table({0: 10.0, 1: 10.0}, together=1.5)
    rm, js = admit(2, cluster, estimate), place(2, cluster, estimate, max_group=2)
    assert [(g.pipelines, g.nodes) for g in rm.groups] == [((0, 1), 1)] and rm.makespan_s == 15.0
    assert [(g.pipelines, g.nodes) for g in js.groups] == [((0, 1), 2)] and js.makespan_s == 7.5


def test_two_pipelines_of_one_workload_are_priced_alike_so_no_placement_favours_a_lucky_draw():
    keys = [("A",), ("B",), ("A",)]
    assert trial_streams(keys, (0,)) == trial_streams(keys, (2,)) == (0,)  # the same draw alone
    assert trial_streams(keys, (0, 2)) == trial_streams(keys, (2, 0)) == (0, 3)  # a pair: two draws
    assert len(set(trial_streams(keys, (2, 1, 0)))) == 3
    sim = SimConfig(workload=("qwen3-0.6b-gsm8k", "qwen3-0.6b-gsm8k"), steps=2, trace=False)
    estimate = estimator(sim, ClusterConfig(nodes="3xh100:1", cluster_trial_steps=1), "serial")
    alone = [estimate(Group(pipelines=(i,), kind="h100", gpus_per_node=1, nodes=n)) for i in (0, 1) for n in (1, 2)]
    assert alone[:2] == alone[2:] and alone[0] != alone[1]  # by pipeline alike; by node count not
    # Both alike, the slower single decides: 1 + 2 nodes never beats what the pair's trials say.
    got = simulate_cluster(sim, ClusterConfig(nodes="4xh100:1", cluster_trial_steps=1), "hetrl")
    assert sorted(g.nodes for g in got.placement.groups) == [2, 2]


def test_a_pipeline_trains_the_same_samples_wherever_it_is_placed():
    pair = simulate(group_config(SIM, Group(pipelines=(0, 1), kind="h100", gpus_per_node=2, nodes=1), "jigsaw"))
    alone = simulate(group_config(SIM, Group(pipelines=(1,), kind="a100", gpus_per_node=1, nodes=1), "serial"))
    by_name = {p.workload: p for p in pair.pipelines}
    assert alone.pipelines[0].workload == "qwen3-0.6b-math"
    assert alone.pipelines[0].tokens == by_name["qwen3-0.6b-math"].tokens
    assert alone.pipelines[0].samples == by_name["qwen3-0.6b-math"].samples
    # the stream is what keeps them: the math pipeline alone on stream 0 draws other samples
    other = simulate(SimConfig(workload=("qwen3-0.6b-math",), steps=2, trace=False, device="a100", gpus=1,
                               policy="serial"))
    assert other.pipelines[0].tokens != alone.pipelines[0].tokens


def test_a_node_kind_prices_the_workload_there():
    cfg = SimConfig(workload=("qwen3-4b-gsm8k",), steps=1, trace=False, policy="serial", gpus=8)
    h100, a100 = simulate(cfg).makespan_s, simulate(SimConfig(**{**_fields(cfg), "device": "a100"})).makespan_s
    assert a100 > 1.3 * h100
    with pytest.raises(ValueError, match="--device 'v100' unknown"):
        simulate(SimConfig(**{**_fields(cfg), "device": "v100"}))


def _fields(cfg: SimConfig) -> dict:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def test_a_mixed_cluster_is_placed_and_every_group_runs_every_step():
    cfg = ClusterConfig(nodes="1xh100:1,1xa100:1", cluster_trial_steps=1)
    got = {p: simulate_cluster(SIM, cfg, p) for p in ("jigsaw", "hetrl")}
    for r in got.values():
        assert sorted(i for g in r.placement.groups for i in g.pipelines) == [0, 1]
        assert len(r.runs) == len(r.placement.groups)
        for g, run in zip(r.placement.groups, r.runs):  # each group ran where it was placed
            assert run.config.device == g.kind and run.config.gpus == g.gpus
            assert all(p.steps == SIM.steps for p in run.pipelines)
    assert got["jigsaw"].tokens == got["hetrl"].tokens  # the same samples under both placements
    assert all(len(g.pipelines) == 1 for g in got["hetrl"].placement.groups)
    with pytest.raises(ValueError, match="fits no node"):  # its pools need two GPUs of one kind
        simulate_cluster(SIM, cfg, "rollmux")
    rm = simulate_cluster(SIM, ClusterConfig(nodes="2xh100:2", cluster_trial_steps=1), "rollmux")
    assert rm.tokens == got["jigsaw"].tokens and all(run.config.policy == "rollmux" for run in rm.runs)
    assert sum(g.nodes for g in rm.placement.groups) <= 2


def test_jigsaw_sim_nodes_prints_each_placement_and_a_bad_cluster_is_a_usage_error(capsys):
    argv = ["sim", "--workload", "qwen3-0.6b-gsm8k", "qwen3-0.6b-math", "--nodes", "1xh100:1", "--steps", "1",
            "--cluster-trial-steps", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "jigsaw: qwen3-0.6b-gsm8k + qwen3-0.6b-math on 1xh100:1" in out  # one node: only the pair fits
    assert "hetrl: cannot place: 2 pipelines each on nodes of its own need more nodes" in " ".join(out.split())
    assert main(argv + ["--cluster-policy", "hetrl"]) == 2  # no policy can place them: an error
    assert "need more nodes" in capsys.readouterr().err
    assert main(argv[:-4] + ["--nodes", "2xb200"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_jigsaw_run_cluster_refuses_a_negative_re_placement_count_before_asking_any_cluster(capsys):
    argv = ["run", "--cluster", "auto", "--workload", "qwen3-0.6b-math", "--cluster-replace", "-1", "--", "true"]
    assert main(argv) == 2
    assert "--cluster-replace is a count of re-placements, at least 0, got -1" in capsys.readouterr().err


def test_a_kinds_node_is_its_usual_one_and_a_shard_group_inside_a_node_is_priced_on_nvlink():
    from jigsaw.mux.model.roofline import Roofline
    from jigsaw.mux.model.specs import A100, LINK_BW_BYTES_PER_S, MODELS, NET_BW_BYTES_PER_S, PriorConfig

    # the paper's A100 nodes hold 4 GPUs (§5.1), DGX H100 8: what the cost model prices FSDP by
    assert parse_nodes("2xa100,1xh100") == (NodeKind(kind="a100", count=2, gpus=4),
                                            NodeKind(kind="h100", count=1, gpus=8))
    assert (str(NodeKind(kind="a100", count=2)), str(NodeKind(kind="a100", count=1, gpus=8))) == ("2xa100", "1xa100:8")

    def link(node_gpus: int) -> float:
        return Roofline(A100, MODELS["qwen3-0.6b"], PriorConfig(fsdp_degree=8, node_gpus=node_gpus)).link_bw

    assert link(8) == LINK_BW_BYTES_PER_S[A100.sku] and link(4) == link(0) == NET_BW_BYTES_PER_S[A100.sku]
    # a group of one node of 8 A100 trains its 8-way shard group there, faster than on two of 4
    sim = SimConfig(workload=("qwen3-0.6b-math",), steps=1, trace=False, fsdp_degree=(8,))

    def step_s(gpus_per_node: int) -> float:
        group = Group(pipelines=(0,), kind="a100", gpus_per_node=gpus_per_node, nodes=8 // gpus_per_node)
        return simulate(group_config(sim, group, "serial")).pipelines[0].finish_s

    assert step_s(8) < step_s(4)  # the same samples, rollouts alike: the collectives differ
