"""Builders for scheduler tests: synthetic slowdown grids and small pipeline graphs.

The synthetic grid is a stand-in with a one-parameter model per kind (the share of
its time that scales with SMs); it exists so tests control every number.  Tests of
the shipped priors use the real files in profiles/.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.plan import NodeSpec, PipelineState
from jigsaw.graph.substage import SubStage
from jigsaw.graph.substage import SubStageKind as K
from jigsaw.mux.model.slowdown import SlowdownGrid

SM = (0.25, 0.5, 0.75, 1.0)
MEM = (0.2, 0.4, 0.6, 0.8)
COMPUTE_FRAC = {"rollout_prefill": 0.9, "rollout_decode": 0.6, "rollout_tail": 0.05,
                "reference": 0.85, "training": 0.9}
GIB = 1 << 30
Seconds = float | Sequence[float]
NODE = NodeSpec(num_devices=1, mem_bytes=80 * GIB)


def _alone(c: float, sm: float) -> float:
    return c / sm + (1.0 - c)


def synthetic_grid(compute_frac: dict[str, float] | None = None, interference: float = 0.05,
                   peak_flops: float = 989e12) -> SlowdownGrid:
    """Grid where s_alone(σ) = c/σ + (1−c), a partner adds `interference`·c_partner,
    and unpartitioned sharing stretches both by the sum of their compute shares."""
    cf = compute_frac or COMPUTE_FRAC
    kinds = list(cf)
    alone = {k: [[_alone(cf[k], sm) for _ in MEM] for sm in SM] for k in kinds}
    pairs = {}
    for a in kinds:
        pairs[a] = {}
        for b in kinds:
            rows = []
            for sm in SM:
                if sm < 1.0:
                    v = _alone(cf[a], sm) * (1.0 + interference * cf[b])
                else:
                    v = 1.0 + cf[b] * (1.0 + interference)
                rows.append([round(v, 6)] * len(MEM))
            pairs[a][b] = rows
    return SlowdownGrid.from_dict({
        "format": "jigsaw-slowdown-grid", "version": 1,
        "device": {"sku": "synthetic", "num_sms": 132, "mem_bytes": 80 * GIB, "peak_flops": peak_flops,
                   "mem_bw_bytes_per_s": 3.35e12},
        "model": "synthetic", "source": {"kind": "analytic-prior", "note": "test stand-in, not a device"},
        "sm_levels": list(SM), "mem_levels": list(MEM), "kinds": kinds,
        "alone": alone, "pairs": pairs,
    })


def sub(pipe: str, name: str, kind: K, dur: float, *, rank: int = 0, mem_gib: float = 10.0, step: int = 0,
        batch: float = 8.0, seq: float = 1000.0, steps: int = 100, flops: float = 0.0) -> SubStage:
    return SubStage(id=f"{pipe}/{step}/r{rank}/{name}", pipeline=pipe, step=step, kind=kind, dp_rank=rank,
                    duration_s=dur, mem_bytes=int(mem_gib * GIB), batch_size=batch, seq_len=seq,
                    num_steps=steps, num_tokens=int(batch * steps), flops=flops)


def chain(pipe: str, pieces: list[tuple[str, K, float, float]], rank: int = 0) -> SubStageGraph:
    """A one-worker pipeline: pieces (name, kind, duration_s, mem_gib) in sequence."""
    nodes = [sub(pipe, n, k, d, rank=rank, mem_gib=m) for n, k, d, m in pieces]
    return SubStageGraph(nodes, {b.id: (a.id,) for a, b in zip(nodes, nodes[1:])})


def rollout(pipe: str, rounds: int, decode_s: Seconds, tail_s: Seconds, *, ranks: int = 1,
            train_s: Seconds | None = None) -> SubStageGraph:
    """Rounds of decode + tail per worker; with `train_s`, a training gang closes each one (a
    synchronous pipeline).  A duration is one for every round, or one per round."""
    nodes, deps, prev = [], {}, []
    for n in range(rounds):
        ends = []
        for r in range(ranks):
            a = sub(pipe, "rollout_decode/0", K.ROLLOUT_DECODE, _at(decode_s, n), rank=r, step=n)
            b = sub(pipe, "rollout_tail/0", K.ROLLOUT_TAIL, _at(tail_s, n), rank=r, step=n)
            nodes += [a, b]
            deps[a.id], deps[b.id] = tuple(prev), (a.id,)
            ends.append(b.id)
        prev = ends
        if train_s is not None:
            gang = [sub(pipe, "training/0", K.TRAINING, _at(train_s, n), rank=r, step=n) for r in range(ranks)]
            deps.update({x.id: tuple(ends) for x in gang})
            nodes += gang
            prev = [x.id for x in gang]
    return SubStageGraph(nodes, deps)


def training(pipe: str, steps: int, train_s: Seconds, *, ranks: int = 1, first: int = 0) -> SubStageGraph:
    """Steps of reference (1 s) + training gangs, from step `first`."""
    nodes, deps, prev = [], {}, []
    for n in range(first, first + steps):
        ref = [sub(pipe, "reference/0", K.REFERENCE, 1.0, rank=r, step=n) for r in range(ranks)]
        gang = [sub(pipe, "training/0", K.TRAINING, _at(train_s, n - first), rank=r, step=n) for r in range(ranks)]
        deps.update({x.id: tuple(prev) for x in ref})
        deps.update({x.id: tuple(y.id for y in ref) for x in gang})
        nodes += ref + gang
        prev = [x.id for x in gang]
    return SubStageGraph(nodes, deps)


def _at(seconds: Seconds, n: int) -> float:
    return float(seconds) if isinstance(seconds, (int, float)) else float(seconds[n])


def states(*graphs: SubStageGraph, devices: tuple[int, ...] = (0,)) -> list[PipelineState]:
    return [PipelineState(graph=g, devices=devices) for g in graphs]


def colocated(**fields):
    """A simulation whose jigsaw and greedy pipelines share every device (placement
    `colocated`, what every simulation ran on before placements were chosen): the co-location
    paths a test means to exercise, where `auto` could pick a shape that shares nothing."""
    from jigsaw.sim.run import SimConfig

    return SimConfig(placement="colocated", **fields)


def workload_toml(fields: dict) -> str:
    """A workload TOML of these fields (nested tables as sections), every parameter sourced
    'hypothesis'."""
    def value(v):
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()

    top = [f"{k} = {value(v)}" for k, v in fields.items() if not isinstance(v, dict)]
    sections = [f"[{k}]\n" + "\n".join(f"{kk} = {value(vv)}" for kk, vv in v.items())
                for k, v in fields.items() if isinstance(v, dict)]
    paths = [k for k, v in fields.items() if not isinstance(v, dict)]
    paths += [f"{k}.{kk}" for k, v in fields.items() if isinstance(v, dict) for kk in v]
    provenance = "[provenance]\n" + "\n".join(f'"{p}" = "hypothesis"' for p in paths)
    return "\n".join([*top, "", *sections, provenance, ""])


def write_workloads(pipes: list[dict], where: Path) -> tuple[str, ...]:
    """Each pipeline's fields as w<i>.toml under `where`; their paths."""
    where.mkdir(parents=True, exist_ok=True)
    out = []
    for i, fields in enumerate(pipes):
        path = where / f"w{i}.toml"
        path.write_text(workload_toml({"name": f"w{i}", "description": "drawn", **fields}))
        out.append(str(path))
    return tuple(out)
