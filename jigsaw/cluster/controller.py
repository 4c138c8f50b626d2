"""The cluster controller on Ray: a detached named actor that knows every node and pipeline.

    a node (its daemon, through NodeLink) ── join / heartbeat ──► Controller ◄── submit ── a user
    Controller.place() ─► placement.place of the submitted pipelines not yet running over the
                          free nodes, priced by the simulator's trials (simulate.estimator: the
                          `jigsaw sim --nodes` code) ─► Assigned: each pipeline's concrete node
                          ids, and what the trials predicted, booked until each has ended()
    a pipeline arriving while others run (`jigsaw run --cluster`): arriving() ─► Arrival.decide
                          (placement.admit_one: packed beside a running group, or free nodes of
                          its own) ─► arrived(): its node ids, booked until ended()
    gangs across nodes: ready / withdraw / done / take ─► Gates (gangs.py): whole or not at all
    a node silent for `node_timeout_s` (daemon or raylet lost) leaves: its waiting gangs are
    refused to their other members, who run those pieces alone; placement forgets the node
    a live node that never asks for its part of a gang, while free for `gang_wait_s` (its worker
    runs without its daemon): the gang is refused too, and each member runs its part alone
    the controller lost: every NodeLink call ends within its deadline as "lost", and each node
    keeps deciding its own pipelines (nothing waits on the controller)

Ray runs the actor (`get_or_start`: detached, named, in the "jigsaw" namespace, on no CPU of its
own); everything it decides is the pure code of placement.py and gangs.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from jigsaw.cluster.gangs import Gates
from jigsaw.cluster.placement import Group
from jigsaw.cluster.questions import Arrival, Asking, Assigned
from jigsaw.cluster.spec import NodeKind
from jigsaw.extras import require

NAME = "jigsaw-cluster"
NAMESPACE = "jigsaw"
_LOST = object()  # NodeLink: the controller did not answer
GANG_WAIT_S = 60.0
"""How long a gang's parts wait for a live member node that is free and never asks for its own
(its worker runs without its daemon) before each member runs its part alone (cluster/gangs.py).
The parts of a gang are asked for together (one trainer asks for every rank), so only a part
that will not come waits this long."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeInfo:
    """What a node tells the controller when it joins."""

    node_id: str
    """Ray's node id (where the node's daemon runs)."""
    kind: str
    gpus: int
    free_mem_bytes: int = 0
    endpoint: str = ""
    """Its daemon's endpoint on that node (ipc://PATH): where a pipeline placed there connects."""


@dataclass(slots=True)
class _Running:
    """Pipelines started on some nodes (one group), until each ends."""

    names: list[str]
    kind: str
    gpus_per_node: int
    node_ids: tuple[str, ...]


class Controller:
    """The actor's body (plain Python: a test can drive it without Ray)."""

    def __init__(self, node_timeout_s: float = 10.0, clock=time.monotonic, gang_wait_s: float = GANG_WAIT_S):
        self.node_timeout_s, self.gang_wait_s, self.clock = node_timeout_s, gang_wait_s, clock
        self.members: dict[str, NodeInfo] = {}
        self.seen: dict[str, float] = {}
        self.workloads: dict[str, str] = {}
        self.gates = Gates()
        self.running: list[_Running] = []
        """Pipelines placed (a batch: `place`) or arrived one at a time (`arriving` / `arrived`),
        and not ended: the nodes they hold."""

    # ------------------------------------------------------------ nodes
    def join(self, info: NodeInfo) -> None:
        self.members[info.node_id], self.seen[info.node_id] = info, self.clock()
        self.gates.rejoin(info.node_id)

    def heartbeat(self, node_id: str) -> bool:
        """False: the controller does not know this node (it left, or the controller restarted):
        join again."""
        self._expire()
        if node_id not in self.members:
            return False
        self.seen[node_id] = self.clock()
        return True

    def leave(self, node_id: str) -> list[str]:
        self.members.pop(node_id, None)
        self.seen.pop(node_id, None)
        return self.gates.leave(node_id)

    def nodes(self) -> list[NodeInfo]:
        self._expire()
        return list(self.members.values())

    def _expire(self) -> None:
        now = self.clock()
        for node_id in [n for n, t in self.seen.items() if now - t > self.node_timeout_s]:
            self.leave(node_id)
        self.gates.overdue(now, self.gang_wait_s)

    # ------------------------------------------------------------ pipelines and placement
    def submit(self, name: str, workload: str) -> None:
        if name in self.workloads:
            raise ValueError(f"pipeline {name!r} was already submitted")
        self.workloads[name] = workload

    def place(self, steps: int = 8, trial_steps: int = 3, seed: int = 0, policy: str = "jigsaw") -> Assigned:
        """Every submitted pipeline not yet running placed on the free nodes (the simulator
        prices each group), and booked."""
        ask = self.asking(steps, trial_steps, seed, policy)
        return self.placed(ask, ask.assign(ask.search()))

    def asking(self, steps: int = 8, trial_steps: int = 3, seed: int = 0, policy: str = "jigsaw") -> Asking:
        """What a placement decides over, as the book stands now (the search needs nothing else)."""
        booked = {n for r in self.running for n in r.names}
        names = tuple(sorted(n for n in self.workloads if n not in booked))
        if not names:
            raise ValueError("no pipeline submitted (that is not already running)")
        held = {n for r in self.running for n in r.node_ids}
        by_kind: dict[tuple[str, int], list[str]] = {}
        for info in self.nodes():
            if info.node_id not in held:
                by_kind.setdefault((info.kind, info.gpus), []).append(info.node_id)
        if not by_kind:
            raise ValueError(f"no free node: running pipelines hold all {len(held)}" if held
                             else "no node has joined the cluster")
        return Asking(names=names, workloads=tuple(self.workloads[n] for n in names),
                      by_kind={k: tuple(v) for k, v in by_kind.items()}, steps=steps, trial_steps=trial_steps,
                      seed=seed, policy=policy)

    # ------------------------------------------------------------ pipelines arriving one at a time
    def arriving(self, name: str, workload: str, steps: int = 8, trial_steps: int = 3, seed: int = 0,
                 policy: str = "jigsaw") -> Arrival:
        """Where `name` may go beside the running pipelines, as the book stands now."""
        from jigsaw.cluster.simulate import PLACERS

        if policy not in PLACERS:
            raise ValueError(f"placement policy {policy!r} unknown; choose from {', '.join(PLACERS)}")
        if name in self.workloads:
            raise ValueError(f"pipeline {name!r} is already in the cluster (running, or submitted)")
        held = {n for r in self.running for n in r.node_ids}
        sizes: dict[tuple[str, int], int] = {}
        free: dict[str, int] = {}
        for info in self.nodes():
            sizes[(info.kind, info.gpus)] = sizes.get((info.kind, info.gpus), 0) + 1
            free[info.kind] = free.get(info.kind, 0) + (info.node_id not in held)
        if not sizes:
            raise ValueError("no node has joined the cluster")
        names = [n for r in self.running for n in r.names]
        index = {n: i for i, n in enumerate(names)}
        groups = tuple(Group(pipelines=tuple(index[n] for n in r.names), kind=r.kind, gpus_per_node=r.gpus_per_node,
                             nodes=len(r.node_ids)) for r in self.running)
        return Arrival(names=(*names, name), workloads=(*(self.workloads[n] for n in names), workload),
                       groups=groups, cluster=tuple(NodeKind(kind=k, count=c, gpus=g) for (k, g), c in sizes.items()),
                       free=free, steps=steps, trial_steps=trial_steps, seed=seed, policy=policy)

    def placed(self, ask: Asking, got: Assigned) -> Assigned:
        """Book `got`: each group's pipelines hold its nodes until each has ended()."""
        for g in got.groups:
            names = [ask.names[i] for i in g.pipelines]
            self.running.append(_Running(names=names, kind=g.kind, gpus_per_node=g.gpus_per_node,
                                         node_ids=got.nodes[names[0]]))
        return got

    def arrived(self, ask: Arrival, decision: tuple[int | None, Group]) -> tuple[str, ...]:
        """Book `decision` for the arriving pipeline (ask.names[-1]); the node ids it runs on."""
        k, group = decision
        name = ask.names[-1]
        self.workloads[name] = ask.workloads[-1]
        if k is not None:
            self.running[k].names.append(name)
            return self.running[k].node_ids
        held = {n for r in self.running for n in r.node_ids}
        free = [i.node_id for i in self.nodes() if i.node_id not in held
                and (i.kind, i.gpus) == (group.kind, group.gpus_per_node)]
        if len(free) < group.nodes:
            raise ValueError(f"{name}: {group.nodes} free {group.kind} node(s) wanted, {len(free)} left")
        self.running.append(_Running(names=[name], kind=group.kind, gpus_per_node=group.gpus_per_node,
                                     node_ids=tuple(free[:group.nodes])))
        return self.running[-1].node_ids

    def ended(self, name: str) -> None:
        """`name` ended: its nodes are free once its group is empty."""
        for r in self.running:
            if name in r.names:
                r.names.remove(name)
        self.running = [r for r in self.running if r.names]
        self.workloads.pop(name, None)

    # ------------------------------------------------------------ gangs across nodes
    def ready(self, gang: str, node_id: str, members: tuple[str, ...]) -> None:
        self._expire()
        self.gates.ready(gang, node_id, frozenset(members), now_s=self.clock())
        self.gates.admit()

    def withdraw(self, gang: str, node_id: str) -> None:
        self.gates.withdraw(gang, node_id)

    def done(self, gang: str) -> None:
        self.gates.done(gang, now_s=self.clock())

    def take(self, node_id: str) -> list[tuple[str, str]]:
        """What `node_id` has yet to be told: (gang, "") admitted, (gang, why) refused."""
        self._expire()
        self.gates.admit()
        return self.gates.take(node_id)


class _Actor:
    """The controller as Ray runs it (an async actor: one event loop, so the body's calls never
    interleave): the body's calls, each waking the nodes' long polls, and `wait`, a node's long
    poll for what it is told; a placement's trials run off the loop."""

    def __init__(self, node_timeout_s: float, gang_wait_s: float = GANG_WAIT_S):
        import asyncio

        self.body = Controller(node_timeout_s=node_timeout_s, gang_wait_s=gang_wait_s)
        self.changed = asyncio.Condition()
        self.arriving = asyncio.Lock()  # an arrival's trials run off the loop; the next waits for its booking

    async def _did(self, method: str, *args):
        got = getattr(self.body, method)(*args)
        async with self.changed:
            self.changed.notify_all()
        return got

    async def join(self, info: NodeInfo) -> None:
        return await self._did("join", info)

    async def heartbeat(self, node_id: str) -> bool:
        return await self._did("heartbeat", node_id)

    async def leave(self, node_id: str) -> list[str]:
        return await self._did("leave", node_id)

    async def nodes(self) -> list[NodeInfo]:
        return self.body.nodes()

    async def submit(self, name: str, workload: str) -> None:
        return self.body.submit(name, workload)

    async def ready(self, gang: str, node_id: str, members: tuple[str, ...]) -> None:
        return await self._did("ready", gang, node_id, members)

    async def withdraw(self, gang: str, node_id: str) -> None:
        return await self._did("withdraw", gang, node_id)

    async def done(self, gang: str) -> None:
        return await self._did("done", gang)

    async def take(self, node_id: str) -> list[tuple[str, str]]:
        return self.body.take(node_id)

    async def place(self, steps: int = 8, trial_steps: int = 3, seed: int = 0, policy: str = "jigsaw") -> Assigned:
        import asyncio

        async with self.arriving:  # booked before another placement or arrival asks
            ask = self.body.asking(steps, trial_steps, seed, policy)
            return self.body.placed(ask, ask.assign(await asyncio.to_thread(ask.search)))

    async def arrive(self, name: str, workload: str, steps: int = 8, trial_steps: int = 3, seed: int = 0,
                     policy: str = "jigsaw") -> tuple[str, ...]:
        """Where the arriving `name` runs (its node ids), booked; one arrival at a time."""
        import asyncio

        async with self.arriving:
            ask = self.body.arriving(name, workload, steps, trial_steps, seed, policy)
            return self.body.arrived(ask, await asyncio.to_thread(ask.decide))

    async def ended(self, name: str) -> None:
        return self.body.ended(name)

    async def arrivals(self) -> dict[str, tuple[str, ...]]:
        """Each running pipeline's node ids (arrived, or placed in a batch)."""
        return {n: r.node_ids for r in self.body.running for n in r.names}

    async def wait(self, node_id: str, timeout_s: float) -> list[tuple[str, str]]:
        """What `node_id` is told, as soon as there is any, or [] after `timeout_s`."""
        import asyncio

        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        async with self.changed:
            while True:
                got = self.body.take(node_id)  # also expires silent nodes, refusing their gangs
                left = end - loop.time()
                if got or left <= 0:
                    return got
                try:  # woken by any change; at least every 0.25 s, as silent nodes expire by the clock
                    await asyncio.wait_for(self.changed.wait(), min(left, 0.25))
                except TimeoutError:
                    pass


def get_or_start(node_timeout_s: float = 10.0, gang_wait_s: float = GANG_WAIT_S):
    """The cluster's controller actor: the running one, or a new detached one."""
    require("cluster", "the cluster controller")
    import ray

    actor = ray.remote(num_cpus=0, max_concurrency=64)(_Actor)
    # on the head node: it lives as long as the cluster does, where a worker node may go
    return actor.options(name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                         resources={"node:__internal_head__": 0.001}).remote(node_timeout_s=node_timeout_s,
                                                                                gang_wait_s=gang_wait_s)


def join(address: str, flag: str, log_to_driver: bool = False) -> None:
    """This process joins the Ray cluster at `address` in jigsaw's namespace; a ValueError that
    names `flag` and says why where it cannot (a usage error of the command)."""
    require("cluster", f"{flag} (a Ray cluster)")
    import ray

    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=log_to_driver)
    except Exception as exc:  # noqa: BLE001 - Ray's errors vary by what is missing
        raise ValueError(f"{flag} {address}: cannot join the Ray cluster ({type(exc).__name__}: {exc}); "
                         "is `ray start` running?") from exc


def stop() -> bool:
    """Kill the cluster's controller actor (it is detached: it outlives its driver); whether there was one."""
    require("cluster", "the cluster controller")
    import ray

    try:
        ray.kill(ray.get_actor(NAME, namespace=NAMESPACE))
    except ValueError:  # no such actor
        return False
    return True


class NodeLink:
    """A node's calls to the controller, each within `deadline_s`: a controller that does not
    answer is "lost" (None), and the node goes on deciding alone."""

    def __init__(self, info: NodeInfo, deadline_s: float = 5.0, handle=None):
        require("cluster", "a node's link to the cluster controller")
        import ray

        self.ray = ray
        self.info, self.deadline_s = info, deadline_s
        self.handle = handle

    def _handle(self):
        """The controller's actor handle, or None where there is none (it is gone)."""
        try:
            return self.handle or self.ray.get_actor(NAME, namespace=NAMESPACE)
        except ValueError:  # no such actor
            return None

    def _answer(self, method: str, *args, wait_s: float = 0.0):
        """The controller's answer, or _LOST where it is gone or silent past the deadline
        (`wait_s` more for a call that waits by design: a long poll)."""
        handle = self._handle()
        if handle is None:
            return _LOST
        try:  # a request the controller refuses (RayTaskError) is the node's bug: it propagates
            return self.ray.get(getattr(handle, method).remote(*args), timeout=self.deadline_s + wait_s)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            return _LOST

    def post(self, method: str, *args) -> bool:
        """Send without waiting for the answer (False: there is no controller to send to)."""
        handle = self._handle()
        if handle is not None:
            getattr(handle, method).remote(*args)
        return handle is not None

    def wait(self, timeout_s: float) -> list[tuple[str, str]] | None:
        """What this node is told, as soon as it is told (a long poll of up to `timeout_s`);
        None: the controller is lost."""
        got = self._answer("wait", self.info.node_id, timeout_s, wait_s=timeout_s)
        return None if got is _LOST else got

    def call(self, method: str, *args):
        """The controller's answer, or None where it is lost (the node falls open)."""
        got = self._answer(method, *args)
        return None if got is _LOST else got

    def join(self) -> bool:
        """Whether the controller heard (False: lost)."""
        return self._answer("join", self.info) is not _LOST

    def heartbeat(self) -> bool:
        """Whether the controller knows this node now (it joins again if it was forgotten)."""
        got = self.call("heartbeat", self.info.node_id)
        return self.join() if got is False else bool(got)

    def beat(self, interval_s: float) -> threading.Event:
        """Heartbeats every `interval_s` from a thread until the returned event is set."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                self.heartbeat()

        threading.Thread(target=loop, name="jigsaw-cluster-heartbeat", daemon=True).start()
        return stop

    def ready(self, gang: str, members: tuple[str, ...]) -> bool:
        """Whether the controller took the request (False: lost; the node decides alone)."""
        return self._answer("ready", gang, self.info.node_id, members) is not _LOST

    def take(self) -> list[tuple[str, str]] | None:
        """(gang, "") admitted, (gang, why) refused; None: the controller is lost."""
        return self.call("take", self.info.node_id)


class RayLink:
    """A node daemon's line to the controller (runtime/spanning.py's Link) over Ray: offers go
    out as they come and are never waited on; one long poll at a time brings the answers back,
    so a gang's path crosses the network once each way.  Heartbeats from their own thread."""

    def __init__(self, link: NodeLink, poll_s: float = 1.0, beat_s: float = 1.0):
        self.link, self.node_id, self.poll_s = link, link.info.node_id, poll_s
        self._news: list[tuple[str, str]] = []
        self._lost = not link.join()
        self._lock = threading.Lock()
        self._stop = link.beat(beat_s)
        threading.Thread(target=self._listen, name="jigsaw-cluster-news", daemon=True).start()

    @classmethod
    def connect(cls, address: str, kind: str, gpus: int, endpoint: str = "") -> RayLink:
        """Join the cluster at `address` (auto: this node's) as this node (its daemon at
        `endpoint`), starting its controller if it has none."""
        require("cluster", "a daemon in a cluster (--cluster)")
        import ray

        try:
            if not ray.is_initialized():
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
            ray.get(get_or_start().nodes.remote(), timeout=120)  # a new controller's start can take seconds
            me = ray.get_runtime_context().get_node_id()
        except Exception as exc:  # noqa: BLE001 - Ray's errors vary by what is missing; the daemon says why it stops
            raise RuntimeError(f"--cluster {address}: cannot join the Ray cluster ({type(exc).__name__}: {exc}); "
                               "is `ray start` running on this node?") from exc
        return cls(NodeLink(NodeInfo(node_id=me, kind=kind, gpus=gpus, endpoint=endpoint)))

    def _listen(self) -> None:
        while not self._stop.is_set():
            got = self.link.wait(self.poll_s)
            with self._lock:
                self._lost = got is None
                self._news += got or []
            if got is None:
                self._stop.wait(self.poll_s)  # lost: ask again later, the node meanwhile decides alone

    def ready(self, gang: str, members: tuple[str, ...]) -> None:
        self.link.post("ready", gang, self.node_id, members)

    def withdraw(self, gang: str) -> None:
        self.link.post("withdraw", gang, self.node_id)

    def done(self, gang: str) -> None:
        self.link.post("done", gang)

    def news(self) -> list[tuple[str, str]] | None:
        with self._lock:
            if self._lost:
                return None
            out, self._news = self._news, []
            return out

    def close(self) -> None:
        self._stop.set()


__all__ = ["NAME", "NAMESPACE", "Controller", "join", "NodeInfo", "NodeLink", "RayLink",
           "get_or_start", "stop"]
