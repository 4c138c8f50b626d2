"""Pipelines submitted to the cluster, placed, and each run where it was placed.

    launch([Submitted(name, workload, cmd), ...], address)
      ─► the controller: submit each (name, workload) ─► place() over the live nodes (the
         simulator's trials price each group: the `jigsaw sim --nodes` decision) ─► Assigned
      ─► per pipeline, its nodes' daemons (NodeInfo.endpoint, devices) ─► CMD as a Ray task
         pinned to the group's first node, with JIGSAW_PIPELINE, JIGSAW_ENDPOINT (that node's
         daemon) and, placed on several nodes, JIGSAW_NODES (runtime/across.py: a client per
         node, gangs started on all at once); `{gpus}` in CMD is the GPUs its group gives it
      ─► Launched: the placement, each pipeline's nodes, exit code and output tail

The workload is what placement prices the pipeline as (a `jigsaw sim` workload: its model and
lengths); the command is what runs.  The CPU engines start a pipeline's processes beside its
driver, so on one machine's loopback cluster the nodes differ in their daemons only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from jigsaw.cluster.controller import NAMESPACE, Assigned, NodeInfo, get_or_start
from jigsaw.extras import require
from jigsaw.runtime.paths import ENV_ENDPOINT, ENV_NODES, ENV_PIPELINE

OUTPUT_TAIL_CHARS = 4000
"""How much of a pipeline's output (stdout and stderr) comes back to the launcher."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Submitted:
    """A pipeline for the cluster."""

    name: str
    workload: str
    """What placement prices it as: a `jigsaw sim` workload name or file."""
    cmd: tuple[str, ...]
    """Its command; `{gpus}` in a word is the GPUs of the nodes it is placed on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ran:
    """A pipeline's run where it was placed."""

    name: str
    nodes: tuple[str, ...]
    """Node ids it ran on (its driver on the first)."""
    returncode: int
    output: str
    """The tail of its stdout and stderr."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Launched:
    placed: Assigned
    ran: tuple[Ran, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """How the controller places the submitted pipelines."""

    policy: str = "jigsaw"
    """jigsaw (pairs priced by the simulator's trials) | hetrl (each pipeline on nodes of its own)."""
    steps: int = 8
    """Steps each pipeline's placement is priced for."""
    trial_steps: int = 3
    """Steps of each group's trial."""
    seed: int = 0
    """Seed of the trials' samples."""


def environment(name: str, nodes: list[NodeInfo]) -> dict[str, str]:
    """What a pipeline placed on `nodes` (its driver on the first) runs with."""
    if any(not n.endpoint for n in nodes):
        missing = [n.node_id for n in nodes if not n.endpoint]
        raise ValueError(f"{name}: node(s) {missing} joined without a daemon endpoint "
                         "(not a `jigsaw daemon --cluster`)")
    env = {ENV_PIPELINE: name, ENV_ENDPOINT: nodes[0].endpoint}
    if len(nodes) > 1:
        env[ENV_NODES] = json.dumps([[n.node_id, n.endpoint, n.gpus] for n in nodes])
    return env


def command(cmd: tuple[str, ...], gpus: int) -> list[str]:
    return [word.replace("{gpus}", str(gpus)) for word in cmd]


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """CMD on this node (a Ray task's body): its exit code and output tail."""
    import subprocess

    try:
        done = subprocess.run(cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return 124, out[-OUTPUT_TAIL_CHARS:] + f"\n(killed after {timeout_s:g} s)"
    except OSError as exc:
        return 127, f"cannot run {cmd[0]!r}: {exc}"
    return done.returncode, done.stdout[-OUTPUT_TAIL_CHARS:]


def start(pipelines: list[Submitted], placing: LaunchConfig = LaunchConfig(), timeout_s: float = 3600.0):
    """Submit, place and start every pipeline (ray.init already called); (Assigned, the Ray
    futures of each pipeline's run, each pipeline's nodes) without waiting for the runs."""
    require("cluster", "launching pipelines on a cluster")
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ctrl = get_or_start()
    for p in pipelines:
        ray.get(ctrl.submit.remote(p.name, p.workload))
    placed: Assigned = ray.get(ctrl.place.remote(steps=placing.steps, trial_steps=placing.trial_steps,
                                                 seed=placing.seed, policy=placing.policy))
    known = {n.node_id: n for n in ray.get(ctrl.nodes.remote())}
    remote = ray.remote(num_cpus=0, max_retries=0)(_run)  # a retry would run the pipeline's steps twice
    futures, where = [], []
    for p in pipelines:
        nodes = [known[i] for i in placed.nodes[p.name]]
        gpus = sum(n.gpus for n in nodes)
        strategy = NodeAffinitySchedulingStrategy(nodes[0].node_id, soft=False)
        futures.append(remote.options(scheduling_strategy=strategy)
                       .remote(command(p.cmd, gpus), environment(p.name, nodes), timeout_s))
        where.append(tuple(n.node_id for n in nodes))
    return placed, futures, where


def launch(pipelines: list[Submitted], address: str = "auto", placing: LaunchConfig = LaunchConfig(),
           timeout_s: float = 3600.0) -> Launched:
    """Every pipeline placed and run to its end (see the module docstring)."""
    require("cluster", "launching pipelines on a cluster")
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    placed, futures, where = start(pipelines, placing, timeout_s)
    ran = tuple(Ran(name=p.name, nodes=nodes, returncode=rc, output=out)
                for p, nodes, (rc, out) in zip(pipelines, where, ray.get(futures)))
    return Launched(placed=placed, ran=ran)


__all__ = ["LaunchConfig", "Launched", "Ran", "Submitted", "command", "environment", "launch", "start"]
