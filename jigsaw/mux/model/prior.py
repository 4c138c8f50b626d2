"""Analytic roofline PRIORS of slowdown grids: stand-ins until `jigsaw profile` measures one.

    Deployment A, B (specs.py) ─► Roofline each (roofline.py) ─► A alone, A's kinds beside B's
        ─► dict ─► SlowdownGrid.from_dict (validated like a measured file)
    analytic_prior(d, m, c)            a model's own grid: analytic_pair_prior(d, (m, c), (m, c))
    analytic_pair_prior(d, A, B)       A's view of A beside B (another model or deployment)
    [A, B, ...] ─► analytic_pair_prior of every ordered pair ─► entrywise max ─► mix_prior
    analytic_pair_prior(A, B) + analytic_pair_prior(B, A) ─► pair_actual ─► exact (s_a, s_b)
    SHIPPED, shipped_path              the priors under profiles/ (`jigsaw prior --shipped`)

The result is a prior, never a measurement, and every file says so in `source`.

A deployment is (model name in `specs.MODELS`, `PriorConfig`); one builder (`_pair_data`)
serves the own, pair and mix priors, and this module only reads specs.py and roofline.py.

Pair prior G_AB = analytic_pair_prior(device, A, B):
  * `alone[x]` is A's kind x alone, normalised as A's own grid (equal to A's prior);
  * `pairs[x][y][σ][m]` is A's kind x holding SM share σ and memory share m beside B's kind
    y holding 1-σ and 1-m (σ = 1.0: both see every SM), over A's x alone on the whole device
    at the top memory level.  Kinds on the first axis are A's, on the second B's.  Each side
    is timed by its own roofline (`roofline.partitioned` / `roofline.shared` take two
    sides), so a small model beside a big one sees the big one's bandwidth and SM demand,
    not its own;
  * B's time at that point is G_BA.pairs[y][x][σ'][1-m] (σ' = 1-σ, or 1.0 shared):
    `pair_actual(G_AB, G_BA, ...)` reads both.  G_AB's own `pair()`, `pair_options()` and
    `actual()` read pairs[y][x] as the partner's view, which here is A's y beside B's x:
    right only when A == B;
  * feasibility: a point is null when A's x does not fit m or B's y does not fit 1-m, and
    also when the swapped placement (A's y in 1-m, B's x in m) does not fit.  The file
    validator demands null(pairs[x][y] at (σ, m)) == null(pairs[y][x] at the complement),
    a same-model assumption: there the second entry is the partner's view of the same point.
    In a pair grid it is another placement, so only the conjunction of both placements'
    fits satisfies the check; it is the transpose of G_BA's nulls and exactly the nulls of
    mix_prior([A, B]).  Price: a point that fits only one way round (the small model's
    rollout in 20% beside the big model's training in 80%, when the big model's rollout
    does not fit 20%) is null in G_AB.  The source kind stays "analytic-prior" (the format
    knows no other analytic kind) and `source.partner` names B.

Mix prior, the grid a node schedules with when its pipelines run different deployments:
entrywise the MAX over every ordered pair (X, Y), X == Y included, of G_XY (alone: max over
the deployments; null if null in any).  A scheduler given one grid cannot know which pipeline
a sub-stage belongs to at every query, so it plans with the most pessimistic slowdown any
pairing could have: a plan that meets its deadline on the mix meets it on every real pairing,
and a point feasible in the mix is feasible in every G_XY.  The cost is conservatism (a
small model's cheap co-location is priced like the big one's).  The simulator's physics use
the exact pair priors (`pair_actual`), so plans are judged by what really happens.  Inputs
are deduplicated and sorted, so the mix is order-independent by construction; one
deployment (or all equal) gives `analytic_prior` exactly.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import asdict

from jigsaw.mux.model.roofline import Roofline, Side, partitioned, shared
from jigsaw.mux.model.slowdown import DEFAULT_MEM_LEVELS, DEFAULT_SM_LEVELS, DeviceInfo, SlowdownGrid
from jigsaw.mux.model.specs import DEVICE_KIND_NAMES, MODELS, Deployment, PriorConfig, config_dict, spec_dict

_NOTE = "roofline prior, not a measurement; calibrated to JigsawRL Fig. 7/8/§4.2 figures"
Unit = tuple[str, float, float]
"""(kind, sm_frac, mem_frac) of one side of a co-located pair."""


def analytic_prior(device: DeviceInfo, model_name: str, config: PriorConfig = PriorConfig()) -> SlowdownGrid:
    """The labelled roofline prior grid of `model_name` on `device`: the pair prior of the
    deployment beside itself (see the module docstring)."""
    return analytic_pair_prior(device, (model_name, config), (model_name, config))


def analytic_pair_prior(device: DeviceInfo, a: Deployment, b: Deployment) -> SlowdownGrid:
    """A's view of A beside B on `device`: A's kinds on the first axis, B's on the second
    (see the module docstring).  analytic_pair_prior(device, B, A) is B's view."""
    return SlowdownGrid.from_dict(_pair_data(device, a, b))


def mix_prior(device: DeviceInfo, deployments: Iterable[Deployment]) -> SlowdownGrid:
    """Entrywise max over the pair priors of every ordered pair of two of the deployments (one
    per pipeline: a deployment is paired with itself only when two pipelines run it), see
    the module docstring."""
    given = sorted(deployments, key=_key)
    unique = sorted(set(given), key=_key)
    if not unique:
        raise ValueError("mix_prior needs at least one (model, config)")
    if len(unique) == 1:
        return analytic_pair_prior(device, unique[0], unique[0])
    pairs = sorted({(x, y) for i, x in enumerate(given) for j, y in enumerate(given) if i != j},
                   key=lambda p: (_key(p[0]), _key(p[1])))
    grids = [_pair_data(device, x, y) for x, y in pairs]  # every deployment is some pair's first
    kinds = DEVICE_KIND_NAMES
    data = {**grids[0], "model": "+".join(name for name, _ in unique),
            "source": {"kind": "analytic-prior",
                       "note": f"{_NOTE}; mix prior: entrywise max over every ordered pair of the "
                               "deployments' pair priors (a conservative plan, not any one pairing)",
                       "mix": [{"model": name, "parameters": _parameters(_roofline(device, name, cfg))}
                               for name, cfg in unique]},
            "alone": {k: _max_table([g["alone"][k] for g in grids]) for k in kinds},
            "pairs": {x: {y: _max_table([g["pairs"][x][y] for g in grids]) for y in kinds} for x in kinds}}
    return SlowdownGrid.from_dict(data)


def pair_actual(ab: SlowdownGrid, ba: SlowdownGrid, unit_a: Unit, unit_b: Unit) -> tuple[float, float] | None:
    """Exact (s_a, s_b) of A's unit beside B's unit: s_a from A's view `ab`
    (analytic_pair_prior(device, A, B)), s_b from B's view `ba`.  Both σ 1.0 is unpartitioned
    sharing, else σ_b should be 1 - σ_a and mem_b 1 - mem_a.  None if infeasible."""
    check_views(ab, ba)
    return pair_slowdowns(ab, ba, unit_a, unit_b)


def check_views(ab: SlowdownGrid, ba: SlowdownGrid) -> None:
    """Raise unless `ab` and `ba` are the two views of one pair (A beside B, B beside A)."""
    if ab.device != ba.device or _partner(ab) != ba.model or _partner(ba) != ab.model:
        raise ValueError(f"{ab!r} and {ba!r} are not the two views of one pair")


def pair_slowdowns(ab: SlowdownGrid, ba: SlowdownGrid, unit_a: Unit, unit_b: Unit) -> tuple[float, float] | None:
    """`pair_actual` without the check (the search asks often; check once with `check_views`)."""
    (ka, sa, ma, *na), (kb, sb, mb, *nb) = unit_a, unit_b  # an optional 4th: the side's memory need
    s_a = ab.slowdown(ka, kb, sa, ma, need_frac_a=na[0] if na else None)
    s_b = ba.slowdown(kb, ka, sb, mb, need_frac_a=nb[0] if nb else None)
    return None if math.isinf(s_a) or math.isinf(s_b) else (s_a, s_b)


def _partner(grid: SlowdownGrid) -> str:
    return grid.source.get("partner", {}).get("model", grid.model)


def _key(d: Deployment) -> tuple[str, str]:
    name, cfg = d
    return name, json.dumps(asdict(cfg), sort_keys=True)


def _max_table(tables: list[list[list[float | None]]]) -> list[list[float | None]]:
    """Entrywise max of [sm][mem] tables; null where any is null (infeasible for some pairing)."""
    return [[None if any(v is None for v in vs) else max(vs) for vs in zip(*rows)] for rows in zip(*tables)]


def _pair_data(device: DeviceInfo, a: Deployment, b: Deployment) -> dict:
    """Grid dict of A's kinds beside B's, each side timed by its own roofline on `device`.

        A, B ─► Roofline each ─► work per (kind, memory level) ─► A alone, A beside B ─► dict"""
    # NOTE: B gets its own roofline even when B == A, so a model's own prior goes through the
    # same two-sided path as a pair of different models (and the shipped files check it).
    roof_a, roof_b = _roofline(device, *a), _roofline(device, *b)
    sm_levels, mem_levels, kinds = DEFAULT_SM_LEVELS, DEFAULT_MEM_LEVELS, DEVICE_KIND_NAMES
    works_a = {(k, m): roof_a.work(k, m) for k in kinds for m in mem_levels}
    works_b = {(k, m): roof_b.work(k, m) for k in kinds for m in mem_levels}
    base = _base_s(roof_a, works_a, a[0])
    _base_s(roof_b, works_b, b[0])  # B must fit on its own too: its view of the pair is built alike

    def alone(k: str, sm: float, mem: float) -> float | None:
        w = works_a[(k, mem)]
        return None if w is None else roof_a.parts(w, sm).total_s / base[k]

    def beside(x: str, y: str, sm: float, mem: float) -> float | None:
        comp = min(mem_levels, key=lambda lv: abs(lv - (1.0 - mem)))  # 1 - 0.8 lands on 0.2
        wa, wb = works_a[(x, mem)], works_b[(y, comp)]
        # NOTE: kept only if the swapped placement fits too (module docstring: the validator's
        # feasibility symmetry).  With A == B both conditions are the same one.
        if wa is None or wb is None or works_a[(y, comp)] is None or works_b[(x, mem)] is None:
            return None
        sa, sb = Side(roof_a, wa), Side(roof_b, wb)
        return (shared(sa, sb)[0] if sm == 1.0 else partitioned(sa, sb, sm)[0]) / base[x]

    def grid(f) -> list[list[float | None]]:
        return [[_round(f(sm, mem)) for mem in mem_levels] for sm in sm_levels]

    return {
        "format": SlowdownGrid.FORMAT, "version": SlowdownGrid.VERSION, "device": asdict(device),
        "model": a[0], "source": _source(roof_a, a, roof_b, b),
        "sm_levels": list(sm_levels), "mem_levels": list(mem_levels), "kinds": list(kinds),
        "alone": {k: grid(lambda sm, mem, k=k: alone(k, sm, mem)) for k in kinds},
        "pairs": {x: {y: grid(lambda sm, mem, x=x, y=y: beside(x, y, sm, mem)) for y in kinds} for x in kinds},
    }


def _roofline(device: DeviceInfo, model_name: str, config: PriorConfig) -> Roofline:
    if model_name not in MODELS:
        raise KeyError(f"unknown model {model_name!r}; known: {sorted(MODELS)}")
    return Roofline(device, MODELS[model_name], config)


def _base_s(roof: Roofline, works: dict, model_name: str) -> dict[str, float]:
    """Seconds per unit of each kind alone on the whole device at the top memory level."""
    top = DEFAULT_MEM_LEVELS[-1]
    base = {}
    for k in DEVICE_KIND_NAMES:
        if works[(k, top)] is None:
            raise ValueError(f"{k} of {model_name} does not fit {roof.device.sku} even at memory share "
                             f"{top}; change rollout_tp / fsdp_degree")
        base[k] = roof.parts(works[(k, top)], 1.0).total_s
    return base


def _source(roof_a: Roofline, a: Deployment, roof_b: Roofline, b: Deployment) -> dict:
    """`source` of a prior: A's constants, and B's as `partner` when B is another deployment."""
    source = {"kind": "analytic-prior", "note": _NOTE, "parameters": _parameters(roof_a)}
    if b != a:
        source["note"] = (f"{_NOTE}; pair prior: pairs[x][y] is {a[0]}'s x beside {b[0]}'s y; "
                          f"{b[0]}'s view is the pair prior the other way round")
        source["partner"] = {"model": b[0], "parameters": _parameters(roof_b)}
    return source


def _parameters(roof: Roofline) -> dict:
    return {"config": config_dict(roof.cfg), "model": spec_dict(roof.model), "link_bw_bytes_per_s": roof.link_bw}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


SHIPPED = (
    ("h100", "qwen3-0.6b", PriorConfig()),
    ("h100", "qwen3-4b", PriorConfig()),
    ("h100", "llama-3.1-8b", PriorConfig(fsdp_degree=8)),
    ("h100", "qwen3-32b", PriorConfig(rollout_tp=4, fsdp_degree=16)),
    ("a100", "qwen3-4b", PriorConfig()),
    ("a100", "deepseek-r1-distill-qwen-14b", PriorConfig(rollout_tp=2, fsdp_degree=8)),
    ("a100", "qwen3-32b", PriorConfig(rollout_tp=4, fsdp_degree=16)),
)
"""(device directory, model, config) of every prior under profiles/."""


def shipped_path(out_dir: str | os.PathLike, device_dir: str, model_name: str) -> str:
    """Where a shipped prior lives: <out>/<device>/<model>.prior.json."""
    return os.path.join(os.fspath(out_dir), device_dir, f"{model_name}.prior.json")
