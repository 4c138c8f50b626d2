"""Which grids a node plans and runs with, and what its deployments cost: the model's one exit.

    daemon:     node_grid(profile) ─► the profile's grid (measured or shipped), or by default
                the analytic H100 prior of Qwen3-4B (`jigsaw daemon`, a replay of its trace,
                `jigsaw profile --calibrate`)
    simulator:  device name + {pipeline: Deployment (model, PriorConfig)}
        ├─ step_cost(device, deployment)  ─► StepCost (costmodel.py): exclusive step times
        ├─ prior_grid(device, deployments) ─► the grid policies plan with:
        │      one deployment ─► its own prior;  several ─► the mix prior (prior.mix_prior,
        │      entrywise the most pessimistic pairing)
        └─ pair_grids(device, {pipeline: deployment}) ─► PairGrids (pairing.py): each pair's
               exact views, shared by the scheduler and the physics; None for one deployment
               (the node grid is then exact)

The config flows one way: deployment (specs.py) ─► roofline.py ─► prior.py ─► pairing.py ─►
here.  Grids and costs are cached per (device, deployment): every policy of a comparison and
every step of a run reads the same objects.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import lru_cache

from jigsaw.mux.model.costmodel import StepCost
from jigsaw.mux.model.pairing import PairGrids, pair_prior
from jigsaw.mux.model.prior import analytic_prior, mix_prior
from jigsaw.mux.model.slowdown import SlowdownGrid
from jigsaw.mux.model.specs import DEVICES, Deployment


def node_grid(profile: str | os.PathLike | None) -> SlowdownGrid:
    """The grid a daemon schedules with: a profile file, or by default the analytic H100 prior
    of Qwen3-4B (what `jigsaw daemon` and a replay of its trace use)."""
    if profile is not None:
        return SlowdownGrid.load(profile)
    return analytic_prior(DEVICES["h100"], "qwen3-4b")


@lru_cache(maxsize=64)
def step_cost(device_name: str, deployment: Deployment) -> StepCost:
    """Exclusive step times of one deployment on a named device (`DEVICES`)."""
    model, config = deployment
    return StepCost(DEVICES[device_name], model, config)


def prior_grid(device_name: str, deployments: Sequence[Deployment]) -> SlowdownGrid:
    """The grid policies plan with: the pipelines' own prior when they all run one model and
    deployment, else the mix prior (entrywise the most pessimistic of every pair)."""
    if len(set(deployments)) == 1:
        one = deployments[0]
        return pair_prior(DEVICES[device_name], one, one)
    return _mix(device_name, tuple(sorted(deployments, key=repr)))


@lru_cache(maxsize=16)
def _mix(device_name: str, deployments: tuple[Deployment, ...]) -> SlowdownGrid:
    return mix_prior(DEVICES[device_name], list(deployments))


def pair_grids(device_name: str, deployments: Mapping[str, Deployment]) -> PairGrids | None:
    """The exact per-pair views of a node's pipelines ({name: deployment}), None when they
    all run one deployment (the node grid is then exact)."""
    if len(set(deployments.values())) <= 1:
        return None
    return PairGrids(DEVICES[device_name], deployments)
