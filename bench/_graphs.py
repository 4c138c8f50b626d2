"""GRPO-shaped sub-stage graphs for benchmarks (a stand-in until `jigsaw sim` workloads exist).

Per DP worker: prefill -> large-batch decode -> long tail (lognormal, so a few workers
run much longer), optionally a tool wait and a second turn; then a host reward, and the
reference and training stages in lockstep on all workers.  Steps are chained.
"""

from __future__ import annotations

import random

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.ids import SubStageId
from jigsaw.graph.substage import SubStage
from jigsaw.graph.substage import SubStageKind as K

GIB = 1 << 30


def grpo_graph(name: str, dp: int, rng: random.Random, *, steps: int = 2, multi_turn: bool = False,
               model_flops_per_token: float = 8e9) -> SubStageGraph:
    graph = None
    for step in range(steps):
        g = _one_step(name, step, dp, rng, multi_turn, model_flops_per_token)
        graph = g if graph is None else graph.then(g)
    return graph


def _one_step(name, step, dp, rng, multi_turn, fpt):
    nodes, deps, sinks = [], {}, []

    def add(kind, rank, ordinal, dur, mem_gib, after, batch=64.0, seq=1500.0, nsteps=200):
        s = SubStage(id=str(SubStageId(name, step, rank, kind, ordinal)), pipeline=name, step=step, kind=kind,
                     dp_rank=rank, duration_s=dur, mem_bytes=int(mem_gib * GIB), batch_size=batch, seq_len=seq,
                     num_steps=nsteps, num_tokens=int(batch * nsteps), flops=fpt * batch * nsteps)
        nodes.append(s)
        deps[s.id] = tuple(after)
        return s.id

    for r in range(dp):
        last = add(K.ROLLOUT_PREFILL, r, 0, rng.uniform(0.5, 2.0), 20, ())
        last = add(K.ROLLOUT_DECODE, r, 0, rng.uniform(5, 15), 30, (last,), batch=400)
        if multi_turn and rng.random() < 0.5:
            last = add(K.TOOL, r, 0, rng.uniform(1, 4), 0, (last,))
            last = add(K.ROLLOUT_PREFILL, r, 1, rng.uniform(0.3, 1.0), 20, (last,))
        tail = min(60.0, rng.lognormvariate(2.0, 0.8))
        last = add(K.ROLLOUT_TAIL, r, 0, tail, 15, (last,), batch=12, seq=4000, nsteps=int(tail * 40))
        sinks.append(last)
    reward = add(K.REWARD, 0, 0, 0.3, 0, sinks)
    ref = [add(K.REFERENCE, r, 0, 4.0, 25, (reward,), batch=32) for r in range(dp)]
    for r in range(dp):
        add(K.TRAINING, r, 0, 12.0, 45, ref, batch=32)
    return SubStageGraph(nodes, deps)
