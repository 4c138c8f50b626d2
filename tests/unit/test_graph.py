"""SubStageGraph: validation, frontier, critical path, chaining."""

import pytest

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.substage import SubStage
from jigsaw.graph.substage import SubStageKind as K


def node(sid, dur, kind=K.ROLLOUT_DECODE, rank=0, step=0):
    return SubStage(id=sid, pipeline="P", step=step, kind=kind, dp_rank=rank, duration_s=dur)


def diamond():
    #   a(1) ─► b(5) ─► d(1)
    #      └──► c(2) ──┘
    nodes = [node("a", 1), node("b", 5), node("c", 2, rank=1), node("d", 1, K.TRAINING)]
    return SubStageGraph(nodes, {"b": ["a"], "c": ["a"], "d": ["b", "c"]})


def test_frontier_follows_dependencies():
    g = diamond()
    assert [s.id for s in g.frontier()] == ["a"]
    assert [s.id for s in g.frontier(done={"a"})] == ["b", "c"]
    assert [s.id for s in g.frontier(done={"a"}, running={"b"})] == ["c"]
    assert [s.id for s in g.frontier(done={"a", "b"})] == ["c"]
    assert [s.id for s in g.frontier(done={"a", "b", "c"})] == ["d"]


def test_critical_path_is_the_longest_chain():
    g = diamond()
    cp = g.critical_path()
    assert cp.ids == ("a", "b", "d") and cp.length_s == 7
    cp = g.critical_path({"b": 0.5})
    assert cp.ids == ("a", "c", "d") and cp.length_s == 4


def test_invalid_graphs_are_rejected():
    with pytest.raises(ValueError, match="cycle"):
        SubStageGraph([node("a", 1), node("b", 1)], {"a": ["b"], "b": ["a"]})
    with pytest.raises(ValueError, match="unknown"):
        SubStageGraph([node("a", 1)], {"a": ["zz"]})
    with pytest.raises(ValueError, match="duplicate"):
        SubStageGraph([node("a", 1), node("a", 2)], {})
    with pytest.raises(ValueError, match="duration_s"):
        node("x", -1)


def test_then_chains_steps_with_a_barrier():
    g1 = diamond()
    g2 = SubStageGraph([node("e", 3, step=1), node("f", 4, rank=1, step=1)], {})
    g = g1.then(g2)
    assert g.deps["e"] == ("d",) and g.deps["f"] == ("d",)
    assert g.critical_path().length_s == 11
    assert g.steps == (0, 1) and g.num_dp_ranks == 2


def test_gangs_group_collective_replicas():
    nodes = [node("t0", 1, K.TRAINING, 0), node("t1", 1, K.TRAINING, 1), node("r", 1, K.REFERENCE, 0)]
    g = SubStageGraph(nodes, {})
    assert sorted(len(x) for x in g.gangs()) == [1, 2]
    assert g.total_work_s() == 3
