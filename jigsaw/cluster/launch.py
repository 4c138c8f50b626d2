"""Pipelines submitted to the cluster, placed, and each run where it was placed.

    launch([Submitted(name, workload, cmd), ...], address)   (a batch: placed together)
      ─► the controller: submit each (name, workload) ─► place() over the live nodes (the
         simulator's trials price each group: the `jigsaw sim --nodes` decision) ─► Assigned
      ─► per pipeline, its nodes' daemons (NodeInfo.endpoint, devices) ─► CMD as a Ray task
         pinned to the group's first node, with JIGSAW_PIPELINE, JIGSAW_ENDPOINT (that node's
         daemon), JIGSAW_OWNER (its token: each of its processes joins it on every node) and,
         placed on several nodes, JIGSAW_NODES (runtime/across.py: a client per node, gangs
         started on all at once); `{gpus}` in CMD is the GPUs its group gives it
      ─► Launched: the placement, each pipeline's nodes, exit code and output tail; each
         pipeline's nodes booked in the controller until it ends (arrivals meanwhile get others)
    arrive(Submitted)   (`jigsaw run --cluster`: one pipeline, arriving while others run)
      ─► the controller books it nodes beside the running ones (Controller.arriving: RollMux's
         admission rule, each group priced by the policy's scheduler) ─► CMD pinned there as
         above, its output forwarded by Ray ─► its nodes given back when it ends
    either, with LaunchConfig.replace_on_loss (_go: a thread per pipeline of a batch)
      ─► a node it runs on leaves the cluster (its daemon or
         raylet lost) ─► CMD stopped (SIGTERM: the recipe ends the step in flight and saves it;
         after stop_grace_s, SIGKILL to its process group: nothing of it runs on), its nodes
         given back, and it arrives again: placed on the live nodes, CMD run again, going on
         from its own checkpoint (the recipe's --checkpoint-dir, on storage every node sees)

The workload is what placement prices the pipeline as (a `jigsaw sim` workload: its model and
lengths); the command is what runs.  The CPU engines start a pipeline's processes beside its
driver, so on one machine's loopback cluster the nodes differ in their daemons only.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from jigsaw.cluster.controller import NAMESPACE, NodeInfo, get_or_start
from jigsaw.cluster.questions import Assigned
from jigsaw.env import ENV_ENDPOINT, ENV_NODES, ENV_OWNER, ENV_PIPELINE
from jigsaw.extras import require

OUTPUT_TAIL_CHARS = 4000
"""How much of a pipeline's output (stdout and stderr) comes back to the launcher."""
LOSS_POLL_S = 1.0
"""How often a run that may be re-placed checks that its nodes are still in the cluster."""
NODE_GONE_S = 30.0
"""How long a run that died with its node waits for the controller to see the node gone."""
STOP_S = 30.0
"""How long a stopped run's task has, past CMD's grace, to end before Ray kills the task."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Submitted:
    """A pipeline for the cluster."""

    name: str
    workload: str
    """What placement prices it as: a `jigsaw sim` workload name or file."""
    cmd: tuple[str, ...]
    """Its command; `{gpus}` in a word is the GPUs of the nodes it is placed on."""
    env: tuple[tuple[str, str], ...] = ()
    """What CMD runs with besides its placement's (a verl job: Ray's runtime-env hook, which
    hands the placement's to every worker)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ran:
    """A pipeline's run where it was placed."""

    name: str
    nodes: tuple[str, ...]
    """Node ids it ran on (its driver on the first)."""
    returncode: int
    output: str
    """The tail of its stdout and stderr."""
    before: tuple[tuple[str, ...], ...] = ()
    """The node ids of each placement it was stopped on (a node of it lost), in order."""


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
    stop_grace_s: float = 120.0
    """A pipeline stopped to be placed again gets SIGTERM and this long to end (the recipe ends
    the step in flight and saves it) before what is left of it is killed."""
    replace_on_loss: int = 0
    """Times a pipeline (arriving alone, `jigsaw run --cluster`, or one of a batch, launch()) is
    re-placed when a node it runs on leaves the cluster: stopped and run again where the
    controller places it then, as an arrival.  Its command must go on from its own checkpoint
    (the recipe's --checkpoint-dir, on storage every node sees), else it starts over.  0: it
    runs on, its pieces on the lost node without a daemon."""


def environment(name: str, nodes: list[NodeInfo], owner: str) -> dict[str, str]:
    """What a pipeline placed on `nodes` (its driver on the first) runs with; `owner`: its
    token (owners.py), the same at every node and placement, so each of its processes (a verl
    job's workers are Ray actors of their own) registers as the one pipeline there."""
    if any(not n.endpoint for n in nodes):
        missing = [n.node_id for n in nodes if not n.endpoint]
        raise ValueError(f"{name}: node(s) {missing} joined without a daemon endpoint "
                         "(not a `jigsaw daemon --cluster`)")
    env = {ENV_PIPELINE: name, ENV_ENDPOINT: nodes[0].endpoint, ENV_OWNER: owner}
    if len(nodes) > 1:
        env[ENV_NODES] = json.dumps([[n.node_id, n.endpoint, n.gpus] for n in nodes])
    return env


def command(cmd: tuple[str, ...], gpus: int) -> list[str]:
    return [word.replace("{gpus}", str(gpus)) for word in cmd]


def _run(cmd: list[str], env: dict[str, str], timeout_s: float, capture: bool = True,
         grace_s: float = 0.0) -> tuple[int, str]:
    """CMD on this node (a Ray task's body): its exit code and output tail (`capture`: else its
    output is the task's, which Ray forwards to the driver).  Cancelled (KeyboardInterrupt):
    SIGTERM to CMD and `grace_s` to end (the recipe ends its step in flight and saves it), then
    SIGKILL to what is left of its process group."""
    import signal
    import subprocess

    _interruptible()
    out, err = (subprocess.PIPE, subprocess.STDOUT) if capture else (None, None)
    try:  # a session of its own: stopped (cancelled, timed out), nothing it started runs on
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=err, text=True,
                                start_new_session=True)
    except OSError as exc:
        return 127, f"cannot run {cmd[0]!r}: {exc}"
    try:
        got, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        got, _ = proc.communicate()
        return 124, (got or "")[-OUTPUT_TAIL_CHARS:] + f"\n(killed after {timeout_s:g} s)"
    except KeyboardInterrupt:  # ray.cancel: stopped to be placed again
        if grace_s > 0:  # CMD alone: its workers and ranks are its to stop (a step in flight needs them)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        raise
    finally:  # also on ray.cancel (KeyboardInterrupt here): its workers and ranks too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, (got or "")[-OUTPUT_TAIL_CHARS:]


def _interruptible() -> None:
    """ray.cancel stops a running task with a KeyboardInterrupt, which needs SIGINT to be
    Python's: a worker that inherited it ignored (a cluster started from a shell's background
    job) would never stop, and its CMD would run on beside the run placed again."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def start(pipelines: list[Submitted], placing: LaunchConfig = LaunchConfig(), timeout_s: float = 3600.0):
    """Submit, place and start every pipeline (ray.init already called); (Assigned, the Ray
    futures of each pipeline's run, each pipeline's nodes) without waiting for the runs.  Each
    holds its nodes in the controller's book until told it ended (launch() does, as each run
    ends; Controller.ended)."""
    require("cluster", "launching pipelines on a cluster")
    placed, booked = _place(get_or_start(), pipelines, placing)
    futures = [_started(p, nodes, secrets.token_hex(16), timeout_s) for p, (_, nodes) in zip(pipelines, booked)]
    return placed, futures, [ids for ids, _ in booked]


def _started(sub: Submitted, nodes: list[NodeInfo], owner: str, timeout_s: float, **run):
    """CMD started as a Ray task pinned to the first of `nodes`, with their environment; the
    task's future (`run`: _run's capture and grace_s)."""
    env = {**dict(sub.env), **environment(sub.name, nodes, owner)}
    return _pinned(nodes[0].node_id).remote(command(sub.cmd, sum(n.gpus for n in nodes)), env, timeout_s, **run)


def _place(ctrl, pipelines: list[Submitted], placing: LaunchConfig) -> tuple[Assigned, list[tuple]]:
    """The batch submitted and placed together: (Assigned, per pipeline (node ids, NodeInfo))."""
    import ray

    for p in pipelines:
        ray.get(ctrl.submit.remote(p.name, p.workload))
    placed: Assigned = ray.get(ctrl.place.remote(steps=placing.steps, trial_steps=placing.trial_steps,
                                                 seed=placing.seed, policy=placing.policy))
    known = {n.node_id: n for n in ray.get(ctrl.nodes.remote())}
    return placed, [(tuple(placed.nodes[p.name]), [known[i] for i in placed.nodes[p.name]]) for p in pipelines]


def _pinned(node_id: str):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # max_retries=0: a retry would run the pipeline's steps twice
    return ray.remote(num_cpus=0, max_retries=0)(_run).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


def arrive(sub: Submitted, placing: LaunchConfig = LaunchConfig(), timeout_s: float = 3600.0,
           say=lambda line: None) -> Ran:
    """One pipeline arriving while others may run (`jigsaw run --cluster`; ray.init already
    called): the controller books it nodes (Controller.arriving), CMD runs there, its output
    forwarded here by Ray, and the nodes are given back when it ends, however it ends; placed
    again where a node of it is lost, up to `placing.replace_on_loss` times."""
    require("cluster", "jigsaw run --cluster")
    return _go(get_or_start(), sub, placing, timeout_s, say)


def _go(ctrl, sub: Submitted, placing: LaunchConfig, timeout_s: float, say, first: tuple | None = None,
        capture: bool = False) -> Ran:
    """`sub` run where it is booked (`first`: (node ids, NodeInfo) a batch placement booked it;
    else booked now, as an arrival), placed again as an arrival where a node of it is lost, up
    to `placing.replace_on_loss` times; its nodes given back however it ends.  `capture`: its
    output comes back in Ran.output (else Ray forwards it)."""
    owner, before = secrets.token_hex(16), []
    while True:
        try:
            ids, nodes = first or _booked(ctrl, sub, placing)
        except ValueError as exc:
            if before:  # stopped on a lost node, and nowhere to go now: say so, not just the refusal
                raise ValueError(f"{exc}; it was stopped on node(s) {', '.join(before[-1])} after losing one, "
                                 "and goes on from its checkpoint when run again") from None
            raise
        first = None
        try:
            gpus = sum(n.gpus for n in nodes)
            say(f"{sub.name} placed on {len(nodes)} {nodes[0].kind} node(s), {gpus} GPU(s): {', '.join(ids)}")
            run = _started(sub, nodes, owner, timeout_s, capture=capture, grace_s=placing.stop_grace_s)
            lost = _watch(ctrl, run, ids) if len(before) < placing.replace_on_loss else ()
            if not lost:
                rc, out = _result(run, ctrl, ids)
                return Ran(name=sub.name, nodes=tuple(ids), returncode=rc, output=out, before=tuple(before))
            say(f"{sub.name}: node(s) {', '.join(lost)} left the cluster: stopped, placed again "
                f"({len(before) + 1} of {placing.replace_on_loss}), to go on from its checkpoint")
            _stop_run(run, placing.stop_grace_s)
            before.append(tuple(ids))
        finally:
            _ended(ctrl, sub.name)


def _booked(ctrl, sub: Submitted, placing: LaunchConfig):
    """The node ids the controller books `sub` and their NodeInfo; its refusal as a ValueError."""
    import ray

    try:
        ids = ray.get(ctrl.arrive.remote(sub.name, sub.workload, steps=placing.steps, trial_steps=placing.trial_steps,
                                         seed=placing.seed, policy=placing.policy))
    except ray.exceptions.RayTaskError as exc:  # the controller refused it: its reason, not its traceback
        if isinstance(exc.cause, ValueError):
            raise ValueError(f"{sub.name}: {exc.cause}") from None
        raise
    known = {n.node_id: n for n in ray.get(ctrl.nodes.remote())}
    if missing := sorted(set(ids) - set(known)):
        _ended(ctrl, sub.name)
        raise RuntimeError(f"{sub.name}: node(s) {missing} left the cluster meanwhile")
    return ids, [known[i] for i in ids]


def _lost(ctrl, ids) -> tuple[str, ...]:
    """`ids` no longer in the cluster; () while the controller does not answer (lost itself: the
    run goes on, its nodes deciding alone, as they do)."""
    import ray

    try:
        alive = {n.node_id for n in _get(ctrl.nodes.remote(), timeout_s=LOSS_POLL_S * 10)}
    except ray.exceptions.RayError:
        return ()
    return tuple(i for i in ids if i not in alive)


def _ended(ctrl, name: str) -> None:
    """Tell the controller `name` ended (its nodes are free); a lost one cannot be told, and a
    new one never booked it."""
    import ray

    try:
        _get(ctrl.ended.remote(name))
    except ray.exceptions.RayError:
        pass


def _watch(ctrl, run, ids, poll_s: float = LOSS_POLL_S) -> tuple[str, ...]:
    """Wait for `run`; the ids of its nodes that left the cluster meanwhile, () once it ended
    with all of them alive (a run that died with its node's raylet counts as lost there)."""
    import ray

    while not ray.wait([run], timeout=poll_s)[0]:
        if lost := _lost(ctrl, ids):
            return lost
    try:
        ray.get(run)
    except ray.exceptions.RayError:  # its node died under it: lost, if the controller agrees
        deadline = time.monotonic() + NODE_GONE_S
        while not (lost := _lost(ctrl, ids)) and time.monotonic() < deadline:
            time.sleep(poll_s)
        return lost
    return ()


def _result(run, ctrl, ids) -> tuple[int, str]:
    import ray

    try:
        return ray.get(run)
    except ray.exceptions.RayError as exc:
        return 1, f"its run failed ({type(exc).__name__}: {exc}); node(s) lost: {list(_lost(ctrl, ids))}"


def _stop_run(run, grace_s: float) -> None:
    """Cancel the run: its task stops CMD's process group (`_run`); forced where it does not end."""
    import ray

    ray.cancel(run)
    if not ray.wait([run], timeout=grace_s + STOP_S)[0]:
        ray.cancel(run, force=True)


def _get(ref, timeout_s: float = 120.0):
    import ray

    return ray.get(ref, timeout=timeout_s)


def launch(pipelines: list[Submitted], address: str = "auto", placing: LaunchConfig = LaunchConfig(),
           timeout_s: float = 3600.0, say=lambda line: None) -> Launched:
    """Every pipeline placed together and run to its end (see the module docstring); with
    `placing.replace_on_loss`, one that loses a node is stopped and placed again as an arrival."""
    require("cluster", "launching pipelines on a cluster")
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    ctrl = get_or_start()
    placed, booked = _place(ctrl, pipelines, placing)
    with ThreadPoolExecutor(max_workers=len(pipelines), thread_name_prefix="jigsaw-launch") as pool:
        ran = pool.map(lambda k: _go(ctrl, pipelines[k], placing, timeout_s, say, first=booked[k], capture=True),
                       range(len(pipelines)))
        return Launched(placed=placed, ran=tuple(ran))


__all__ = ["LaunchConfig", "Launched", "Ran", "Submitted", "arrive", "command", "environment", "launch", "start"]
