"""Problem construction: a pipeline's part patched from an earlier graph of the same shape
equals one built from scratch."""

from __future__ import annotations

from dataclasses import replace

from factories import GIB, sub

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.plan import NodeSpec
from jigsaw.graph.problem import SchedulerCache, Task, _Shape
from jigsaw.graph.substage import SubStageKind as K

NODE = NodeSpec(num_devices=2, mem_bytes=80 * GIB)


def grpo(head_s: float, tail_s: float, tool: bool = False) -> SubStageGraph:
    nodes, deps, sinks = [], {}, []
    for r in range(2):
        chain = [sub("A", "prefill", K.ROLLOUT_PREFILL, head_s + r, rank=r),
                 sub("A", "tail", K.ROLLOUT_TAIL, tail_s * (1 + r), rank=r, batch=4, seq=2000)]
        if tool:
            chain.insert(1, sub("A", "search", K.TOOL, 2.0, rank=r, mem_gib=0))
        for a, b in zip(chain, chain[1:]):
            deps[b.id] = (a.id,)
        nodes += chain
        sinks.append(chain[-1].id)
    train = [sub("A", "train", K.TRAINING, 5.0, rank=r, mem_gib=40) for r in range(2)]
    deps.update({t.id: tuple(sinks) for t in train})
    return SubStageGraph(nodes + train, deps)


def fields(t: Task) -> tuple:
    return tuple(getattr(t, name) for name in Task.__slots__)


def test_patched_part_equals_a_fresh_build():
    for tool in (False, True):
        cache = SchedulerCache()
        first = grpo(1.0, 10.0, tool)
        before = cache.part(first, (0, 1), 0, 0, NODE)
        # Same shape, a head and a tail changed: the tails before them, and dominant kinds,
        # must follow (the prefill's worker is now mostly prefill).
        changed = grpo(30.0, 10.0, tool)
        patched = cache.part(changed, (0, 1), 0, 0, NODE)
        fresh = _Shape.build(changed, (0, 1), 0, 0, NODE).part
        assert [fields(t) for t in patched.tasks] == [fields(t) for t in fresh.tasks]
        assert patched.dominant == fresh.dominant and patched.decode == fresh.decode
        assert patched.dominant != before.dominant
        # The earlier part is untouched (Problems built from it may still be cached).
        again = _Shape.build(first, (0, 1), 0, 0, NODE).part
        assert [fields(t) for t in before.tasks] == [fields(t) for t in again.tasks]


def test_a_changed_sub_stage_in_the_middle_updates_its_ancestors_tails():
    cache = SchedulerCache()
    g = grpo(1.0, 10.0)
    cache.part(g, (0, 1), 0, 0, NODE)
    nodes = [replace(s, duration_s=50.0) if s.id == "A/0/r0/tail" else s for s in g]
    longer = SubStageGraph(nodes, g.deps)
    part = cache.part(longer, (0, 1), 0, 0, NODE)
    prefill = next(t for t in part.tasks if t.ids == ("A/0/r0/prefill",))
    assert prefill.tail_s == 50.0 + 5.0
    assert [fields(t) for t in part.tasks] == [fields(t) for t in _Shape.build(longer, (0, 1), 0, 0, NODE).part.tasks]
