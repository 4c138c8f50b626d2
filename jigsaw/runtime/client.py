"""Pipeline-side client: admission of sub-stages, partitions bound, step summaries; fails open.

    worker ── connect() ──► Register ──► session          (JIGSAW_ENDPOINT, JIGSAW_PIPELINE)
       │  (JIGSAW_NODES: placed on several nodes ─► across.py's Across, a Client per node)
       │  with client.substage(kind, dp_rank=, step=, pids=) as grant:   Admit ─► … ─► Grant
       │      the listed processes are bound to grant.partition (mux/partition/bind.py) before the body,
       │      and the grant is posted for each of them on the board (mux/partition/board.py): a
       │      worker process applies its green side, KV room and batch share itself
       │      work under grant.sm_frac / grant.micro_batch / grant.stream …
       │      grant.report(num_tokens=…, flops=…)
       │  (exit)                                                         Done ─► Ok (or: the
       │                                                   lease was lost meanwhile: it fell open)
       │  with client.gang(kind, members=[(rank, pids), …], step=) as grants:  one Admit per
       │      member, all sent before any reply is awaited (a lockstep stage starts whole)
       │  client.step_end(step, tokens=…)                                StepEnd (no wait)
       │  what the engine knows, for the scheduler's view (no wait): rollout.progress(…)
       │      Progress · client.samples(…) Samples · client.lengths(…) Lengths ·
       │      client.no_rollout(…) NoRollout · client.forecast(…) Forecast
       └─ heartbeat thread (own socket): Heartbeat(wait_s=heartbeat_s), the next as soon as
                                          its Beat comes ─► Beat: sent when a budget changes (or
                                          after wait_s), re-bound at once (a sub-stage is
                                          re-partitioned while it runs); unknown session (daemon
                                          restarted, lease lost) ─► running grants fell open ─►
                                          Register again

Fail-open: when there is no daemon, or it stops answering for `dead_after_s`, every
sub-stage is granted the whole device at once (`grant.exclusive`, its processes unpinned),
and the pipeline goes on.  Every sub-stage that ran without the daemon is counted in
`client.fallen_open` and reported (`Opened`) once a daemon answers again, so the trace and
the pipeline both know.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from jigsaw import protocol as pr
from jigsaw.runtime.paths import ENV_ENDPOINT, ENV_NODES, ENV_PIPELINE, find_owner, socket_path
from jigsaw.runtime.wire import Channel

log = logging.getLogger("jigsaw.client")


@dataclass(slots=True)
class GrantHandle:
    """What a sub-stage may use.  Budget fields change in place when the daemon re-plans."""

    substage: str
    device: int
    kind: str = ""
    dp_rank: int = 0
    step: int = 0
    sm_frac: float = 1.0
    mem_bytes: int = 0
    micro_batch: int | None = None
    routing: tuple[float, ...] | None = None
    migrations: tuple[pr.MigrationOrder, ...] = ()
    partition: object = None
    """mux.partition.partitioners.Advisory | Cpu | Green, or None (host work, or exclusive)."""
    pids: tuple[int, ...] = ()
    """Processes bound to the partition (the caller's process if none were given)."""
    binding: object = None
    """mux.partition.bind.Binding after the last bind (its `stream` is a green partition's)."""
    exclusive: bool = False
    """True when granted without a daemon (fail-open): the whole device."""
    final: bool = False
    """Set before the end: the worker has no more rollout in this step."""
    lost: bool = False
    """The daemon took the grant back while it ran (e.g. a lease expired): it fell open."""
    waited_s: float = 0.0
    """Time spent waiting for admission."""
    started_s: float = 0.0
    numbers: dict = field(default_factory=dict)

    @property
    def stream(self):
        """The torch stream of a green partition to launch on, else None."""
        return None if self.binding is None else self.binding.stream

    def report(self, **numbers) -> None:
        """Numbers of the finished work for the graph: num_tokens, flops, batch_size,
        seq_len, num_steps."""
        self.numbers.update(numbers)

    def _update(self, g: pr.Grant) -> None:
        self.device, self.sm_frac, self.mem_bytes = g.device, g.sm_frac, g.mem_bytes
        self.micro_batch, self.routing, self.partition = g.micro_batch, g.routing, g.partition
        self.migrations = g.migrations


class Client:
    def __init__(self, pipeline: str, endpoint: str | None, devices: tuple[int, ...] = (),
                 connect_timeout_s: float = 1.0, dead_after_s: float = 2 * pr.LEASE_S, owner: str = "",
                 steps: int = 0, max_tokens: int = 0, slo_slowdown: float = 0.0, job: str = "", mode: str = "",
                 staleness: int = 0, nodes: Sequence[str] = ()):
        """`steps`: RL steps the pipeline runs in all, `max_tokens`: its response cap (0: not
        said), `slo_slowdown`: its steps may take at most this × their exclusive time (0: no
        SLO; the registration that creates the pipeline sets it), `job`: the asynchronous job
        it is one side of (graph/buffer.py), with its `mode` and `staleness` bound, told at
        registration; `nodes`: every node of a cluster the pipeline's ranks run on (this
        daemon's among them), where they are more than one: its gangs then start on all at once."""
        self.pipeline, self.endpoint, self.devices = pr.check_name(pipeline), endpoint, tuple(devices)
        self.owner, self.steps, self.max_tokens = owner, steps, max_tokens
        self.slo_slowdown, self.job, self.mode, self.staleness = slo_slowdown, job, mode, staleness
        self.nodes = tuple(nodes)
        self.refusal: pr.Error | None = None
        """Why the daemon refused to register this pipeline (None: it did not)."""
        self.dead_after_s, self.connect_timeout_s = dead_after_s, connect_timeout_s
        self.session: str | None = None
        self.heartbeat_s = pr.HEARTBEAT_S
        self.last_reply = 0.0
        self.fallen_open: list[dict] = []
        """Every sub-stage that ran without the daemon: kind, rank, step, reason, reported."""
        self._unacked: list[pr.Done] = []
        """Ends of granted sub-stages the daemon did not acknowledge (it stalled, restarted or
        was unreachable when they ended): sent again once it answers, so it gives their
        devices back instead of planning beside them."""
        self._req = 0
        self._lock = threading.Lock()
        self._reporting = threading.Lock()
        self._registering = threading.Lock()
        self._binding = threading.Lock()
        """Held while processes move: a budget change the heartbeat thread brings for a piece
        that is ending must not interleave with the next piece's bind of the same processes."""
        self._live: dict[str, GrantHandle] = {}
        self._binder = None
        self._stop = threading.Event()
        self._said_open = False
        self._open = bool(endpoint)
        self.board = socket_path(endpoint).parent / "board" if endpoint else None
        """Where this client posts its workers' grants (mux/partition/board.py): the engines'
        processes follow their postings; None without a daemon endpoint."""
        self._posted: set[int] = set()
        self._sock = self._socket() if endpoint else None
        if endpoint:
            self._register(self._sock, self.connect_timeout_s)
            self._hb = threading.Thread(target=self._heartbeats, name="jigsaw-heartbeat", daemon=True)
            self._hb.start()

    # ------------------------------------------------------------ public API

    @property
    def connected(self) -> bool:
        return self.session is not None and self._reachable()

    def _reachable(self) -> bool:
        return self._open and time.monotonic() - self.last_reply < self.dead_after_s

    @contextlib.contextmanager
    def substage(self, kind: str, *, dp_rank: int = 0, step: int = 0, urgent: bool = False,
                 mem_bytes: int = 0, pids: Sequence[int] = (), label: str = "",
                 elapsed_s: float = 0.0, computes: bool = False) -> Iterator[GrantHandle]:
        """Block until the scheduler admits this sub-stage and its processes (`pids`, default
        this one) are on its partition; report it done on exit.  `label`: the framework's name
        for the work, kept in the trace; `elapsed_s`: how long it already ran (a rollout regime
        is told apart some steps into it); `computes`: a tool that computes here, on this
        node's CPU (protocol.Admit.computes), not a wait: on a CPU node its processes (those
        this one starts meanwhile) go to the cores the device's sub-stages leave free."""
        with self.gang(kind, members=((dp_rank, pids),), step=step, urgent=urgent, mem_bytes=mem_bytes,
                       label=label, elapsed_s=elapsed_s, computes=computes) as (handle,):
            yield handle

    @contextlib.contextmanager
    def gang(self, kind: str, *, members: Sequence[tuple[int, Sequence[int]]], step: int = 0,
             urgent: bool = False, mem_bytes: int = 0, label: str = "",
             elapsed_s: float = 0.0, computes: bool = False) -> Iterator[list[GrantHandle]]:
        """One lockstep stage run by several DP workers at once (the ranks of an FSDP trainer):
        a sub-stage per (dp_rank, pids) member, all asked at once, since the scheduler starts a
        gang whole.  Blocks until every member is admitted and bound; each is reported done on
        exit, with the numbers its handle was given.  One member is `substage`."""
        t0 = time.monotonic()
        members = [(int(rank), tuple(pids)) for rank, pids in members]
        if self.session is None and self._reachable():  # forgotten by a live daemon: join it again now
            self._register(self._sock, self.connect_timeout_s)
        if self.connected:
            self._catch_up(self._sock, wait_s=8 * self.heartbeat_s)  # first: an Admit of a later step needs it
        got = self._admit(kind, members, step, urgent, mem_bytes, label, elapsed_s, computes) if self.connected \
            else [(None, "unreachable")] * len(members)
        handles = []
        for (rank, pids), (handle, why) in zip(members, got):
            if handle is None:
                self._say_open(why)
                handle = GrantHandle(substage="", device=rank, exclusive=True, pids=pids)
            else:
                self._said_open = False
            handle.kind, handle.dp_rank, handle.step = kind, rank, step
            handle.waited_s, handle.started_s = time.monotonic() - t0, time.monotonic()
            handles.append((handle, f"open-{id(handle)}" if not handle.substage else handle.substage, why))
        with self._binding:
            for handle, key, _ in handles:
                self._live[key] = handle
                self._bind(handle)
        try:
            yield [h for h, _, _ in handles]
        finally:
            with self._binding:
                for _, key, _ in handles:
                    self._live.pop(key, None)
            self._close([(h, why) for h, _, why in handles])

    def rollout(self, *, dp_rank: int = 0, step: int = 0, pids: Sequence[int] = (), label: str = ""):
        """A rollout worker's regimes from its forward steps (client-side bucketing,
        runtime/rollout.py)."""
        from jigsaw.runtime.rollout import Rollout

        return Rollout(self, dp_rank, step, tuple(pids), label)

    def step_end(self, step: int, *, tokens: int = 0, samples: int = 0, flops: float = 0.0) -> None:
        if self.connected:
            self._send(pr.StepEnd(session=self.session or "", step=step, tokens=tokens, samples=samples, flops=flops))

    def samples(self, step: int, done: int, total: int) -> None:
        """How far this step's rollout is (no wait)."""
        self.tell(pr.Samples(session="", step=step, done=done, total=total))

    def lengths(self, turns: Sequence[int]) -> None:
        """Lengths (generated tokens) of the turns that finished, one observation (no wait)."""
        turns = [int(n) for n in turns]
        parts = [turns[i:i + pr.MAX_LIST] for i in range(0, len(turns), pr.MAX_LIST)] or [[]]
        for i, part in enumerate(parts):
            self.tell(pr.Lengths(session="", turns=tuple(part), more=i < len(parts) - 1))

    def no_rollout(self, dp_rank: int, step: int) -> None:
        """DP rank `dp_rank` has nothing to generate this step (no wait)."""
        self.tell(pr.NoRollout(session="", dp_rank=dp_rank, step=step))

    def forecast(self, step: int, pieces: Sequence[pr.Piece]) -> None:
        """The pipeline's guess of `step` before it has run one (no wait)."""
        self.tell(pr.Forecast(session="", step=step, pieces=tuple(pieces)))

    def tell(self, msg) -> None:
        """Send a request that needs no answer, under this client's session (nothing without
        a daemon: the facts are for its scheduler)."""
        if self.connected:
            self._send(msgspec.structs.replace(msg, session=self.session or ""))

    def close(self, pipeline_done: bool = False) -> None:
        self._stop.set()
        if self.connected:
            self._report_open(self._sock)
            self._send(pr.Unregister(session=self.session or "", pipeline_done=pipeline_done))
        if self._open:
            self._hb.join(timeout=2 * self.heartbeat_s + 1)
            self._sock.close()
            self._open = False
        if self._binder is not None:
            self._binder.close()
        if self.board is not None:
            from jigsaw.mux.partition import board

            board.withdraw(self.board, self._posted)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ binding, fail-open

    def _bind(self, h: GrantHandle) -> None:
        """Put the sub-stage's processes on its partition (exclusive: the whole machine), and
        this process with them (see `_follow`)."""
        if h.partition is None and not h.exclusive and not h.lost:
            return  # host work (a wait, or light Python of this process): nothing to bind
        if self._binder is None:
            from jigsaw.mux.partition.bind import Binder

            self._binder = Binder()
        try:
            h.binding = self._binder.bind(None if (h.exclusive or h.lost) else h.partition, h.pids)
            self._post(h)
            self._follow(h)
        except Exception as exc:  # noqa: BLE001 - a partition that cannot be bound must not stop the work
            log.warning("cannot bind %s to %s: %s (running unbound)", h.substage or h.kind, h.partition, exc)

    def _post(self, h: GrantHandle) -> None:
        """The grant, for the sub-stage's other processes to apply themselves (a green side, the
        KV pool, the micro-batch: what cannot be set from outside)."""
        from jigsaw.mux.partition import board

        others = [p for p in h.pids if p != os.getpid()]
        if self.board is None or not others:
            return
        off = h.exclusive or h.lost
        posting = board.Posting(partition=None if off else h.partition, mem_bytes=0 if off else h.mem_bytes,
                                micro_batch=None if off else h.micro_batch)
        for pid in others:
            board.post(self.board, pid, posting)
        self._posted.update(others)

    def _follow(self, h: GrantHandle) -> None:
        """The process holding the client (a pipeline's driver: its Python between sub-stages,
        rewards, batching) goes to the cores its pipeline holds, the union of its live CPU
        partitions, so that work stays inside the pipeline's share instead of landing on a
        partner's cores.  A sub-stage that fell open takes it back to the whole machine."""
        from jigsaw.mux.partition.bind import pin
        from jigsaw.mux.partition.partitioners import Cpu

        if not h.pids or os.getpid() in h.pids:
            return  # this process runs the sub-stage itself: bound already
        if h.exclusive or h.lost:
            pin(os.getpid(), self._binder.machine)
            return
        live = [x.partition for x in (*self._live.values(), h) if not (x.exclusive or x.lost)]
        cores = sorted({c for p in live if isinstance(p, Cpu) for c in p.cores})
        if cores:
            pin(os.getpid(), cores)

    def _changed(self, grants: tuple[pr.Grant, ...]) -> None:
        """Budget changes of running sub-stages: the handles follow, and the processes move at
        once, unless the partition is the one they are on (a change of memory alone moves
        nothing: re-pinning every thread of a worker mid-step costs it for nothing)."""
        for g in grants:
            with self._binding:
                if (h := self._live.get(g.substage)) is None or h.lost:
                    continue  # it ended meanwhile: its processes belong to the next piece
                moved = g.partition != h.partition
                h._update(g)
                if moved:
                    self._bind(h)
                else:
                    self._post(h)  # memory or micro-batch alone: the workers resize, nothing moves

    def _close(self, handles: Sequence[tuple[GrantHandle, str]]) -> None:
        """Report the handles' ends, every Done in one write (a gang's members end together:
        the daemon must not decide between them); what ran without the daemon is counted."""
        told = [h for h, _ in handles if h.substage and not (h.exclusive or h.lost)]
        if told:
            dones = [pr.Done(session=self.session or "", substage=h.substage, final=h.final, **h.numbers,
                             req=self._next_req()) for h in told]
            replies = self._call_many(self._sock, dones, 4 * self.heartbeat_s) if self.connected else [None] * len(told)
            for h, reply in zip(told, replies):
                if isinstance(reply, pr.Error) and reply.code == "unknown-session":
                    h.lost = True  # reclaimed while this process could not beat (stopped, starved)
            with self._lock:
                self._unacked += [d for d, reply in zip(dones, replies) if reply is None]
            if any(h.lost for h in told):
                self._forgotten(dones[0].session)
        opened = [(h, why) for h, why in handles if h.exclusive or h.lost]
        for h, why in opened:
            with self._lock:
                self.fallen_open.append({"kind": h.kind, "dp_rank": h.dp_rank, "step": h.step,
                                         "substage": h.substage, "reason": "lost" if h.lost else why,
                                         "reported": False, "duration_s": time.monotonic() - h.started_s})
        if opened and self.connected:
            self._report_open(self._sock)

    def _say_open(self, why: str) -> None:
        """Once per outage: the daemon went away (or never answered) and the work goes on
        without it.  Without an endpoint there is nothing to say: no daemon was asked for."""
        if self.endpoint and not self._said_open:
            self._said_open = True
            log.warning("jigsaw daemon %s (%s): pipeline %s runs without it, every sub-stage on the whole device, "
                        "until it answers again", self.endpoint, why, self.pipeline)

    def _catch_up(self, sock: Channel, wait_s: float = 0.0) -> None:
        """Once the daemon answers again: the ends it missed, then what ran without it (which
        tells it the steps this pipeline reached meanwhile; `wait_s`: for the other thread's
        report, when the caller's next request needs it told first)."""
        with self._lock:
            unacked, self._unacked = self._unacked, []
        if unacked:
            again = [msgspec.structs.replace(d, req=self._next_req()) for d in unacked]
            replies = self._call_many(sock, again, 4 * self.heartbeat_s)
            with self._lock:  # answered either way (Ok, or no longer its grant): done with; unanswered: again
                self._unacked = [d for d, r in zip(unacked, replies) if r is None] + self._unacked
        self._report_open(sock, wait_s)

    def _report_open(self, sock: Channel, wait_s: float = 0.0) -> None:
        """Tell the daemon (on the calling thread's socket) what ran without it; a record
        counts as reported only once the daemon acknowledged it.  `wait_s`: how long to wait
        for the other thread's report to end (0: leave it to that one)."""
        got = self._reporting.acquire(timeout=wait_s) if wait_s > 0 else self._reporting.acquire(blocking=False)
        if not got:
            return  # the other thread is reporting
        try:
            with self._lock:
                todo = [r for r in self.fallen_open if not r["reported"]]
            for part in (todo[i:i + 64] for i in range(0, len(todo), 64)):  # in order, a write at a time
                msgs = [pr.Opened(session=self.session or "", kind=r["kind"], dp_rank=r["dp_rank"], step=r["step"],
                                  reason=r["reason"], substage=r["substage"], duration_s=r["duration_s"],
                                  req=self._next_req()) for r in part]
                for rec, reply in zip(part, self._call_many(sock, msgs, 4 * self.heartbeat_s)):
                    if reply is None or (isinstance(reply, pr.Error) and reply.code == "unknown-session"):
                        return  # again once the daemon answers (or after the next registration)
                    rec["reported"] = True  # an Ok, or a refusal that asking again would not change
        finally:
            self._reporting.release()

    def _lose_grants(self) -> None:
        """The daemon no longer knows this session: what runs now runs without it."""
        with self._binding:
            lost = [h for h in self._live.values() if not h.exclusive and not h.lost]
            for h in lost:
                h.lost = True
                self._bind(h)
        for h in lost:
            log.warning("jigsaw daemon dropped %s while it ran; it continues without the daemon", h.substage)

    # ------------------------------------------------------------ transport

    def _socket(self) -> Channel:
        """A connection per thread; it connects when it first sends, and again after the
        daemon went away (a message is never queued for a daemon that is not there)."""
        return Channel(socket_path(self.endpoint))

    def _next_req(self) -> int:
        with self._lock:
            self._req += 1
            return self._req

    def _send(self, msg, sock: Channel | None = None, *more) -> bool:
        try:
            (sock or self._sock).send(pr.encode(msg), *(pr.encode(m) for m in more))
            return True
        except OSError:
            return False

    def _call(self, sock: Channel, msg, timeout_s: float | None, give_up=None):
        """Send and wait for the reply with msg.req; None on timeout, when `give_up()` is
        true, or when the daemon cannot be reached."""
        return self._call_many(sock, [msg], timeout_s, give_up)[0]

    def _call_many(self, sock: Channel, msgs: Sequence, timeout_s: float | None, give_up=None) -> list:
        """Send every message in one write (the daemon reads them together and decides once),
        then wait for their replies (matched by req), in the messages' order; None for each
        one not answered by the deadline, or when `give_up()` is true."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._send(msgs[0], sock, *msgs[1:]):  # one write; no daemon listening (yet): again
            if (deadline is not None and time.monotonic() >= deadline) or (give_up is not None and give_up()):
                return [None] * len(msgs)
            time.sleep(0.01)
        replies: dict[int, object] = {}
        wanted = {msg.req for msg in msgs}
        while wanted - replies.keys() and (deadline is None or time.monotonic() < deadline):
            if (give_up is not None and give_up()) or sock.lost:  # lost: a restarted daemon never saw them
                break
            if not sock.poll(50):
                continue
            try:
                reply = pr.decode_reply(sock.recv())
            except pr.ProtocolError as exc:
                log.warning("%s", exc)
                continue
            self.last_reply = time.monotonic()
            if reply.req in wanted:  # a late Grant of an Admit given up on: its Opened report withdraws it
                replies[reply.req] = reply
        return [replies.get(msg.req) for msg in msgs]

    def _register(self, sock: Channel, timeout_s: float) -> None:
        """Join the daemon (on the calling thread's socket); one session at a time, whichever
        thread finds it missing first."""
        with self._registering:
            if self.session is not None:
                return
            if self.refusal is not None and self.refusal.code == "name-taken":
                return  # another job holds the name: asking again would not change that
            msg = pr.Register(pipeline=self.pipeline, pid=os.getpid(), devices=self.devices, owner=self.owner,
                              steps=self.steps, max_tokens=self.max_tokens, slo_slowdown=self.slo_slowdown,
                              job=self.job, mode=self.mode, staleness=self.staleness, nodes=self.nodes,
                              req=self._next_req())
            reply = self._call(sock, msg, timeout_s)
            if isinstance(reply, pr.Registered):
                self.refusal = None
                self.session, self.heartbeat_s = reply.session, reply.heartbeat_s
                self.dead_after_s = 2 * reply.lease_s  # the daemon reclaims after one lease; give it two
                log.info("pipeline %s registered (session %s)", self.pipeline, self.session)
            elif isinstance(reply, pr.Error):
                self.refusal = reply
                if reply.code == "name-taken":  # loud: this worker runs unscheduled all job long
                    log.error("jigsaw daemon refused pipeline %s: %s. This process (pid %d, owner token %s) "
                              "runs WITHOUT the daemon, every sub-stage on the whole device. Start it under the "
                              "job's `jigsaw run` (which hands it $JIGSAW_OWNER) or give it a name of its own.",
                              self.pipeline, reply.message, os.getpid(), "set" if self.owner else "unset")
                else:
                    log.warning("jigsaw daemon refused registration: %s", reply.message)
        if self.session is not None:
            self._report_open(sock)

    def _forgotten(self, session: str) -> None:
        """The daemon does not know `session` (restarted, or the lease was lost): what runs under
        it runs without the daemon now.  A newer session is kept."""
        with self._registering:
            if self.session != session:
                return
            self.session = None
        self._lose_grants()

    def _admit(self, kind, members, step, urgent, mem_bytes, label="", elapsed_s: float = 0.0,
               computes: bool = False, retry: bool = True) -> list[tuple[GrantHandle | None, str]]:
        """(handle, "") per member admitted, (None, why) per member that runs without the daemon."""
        msgs = [pr.Admit(session=self.session or "", kind=kind, dp_rank=rank, step=step, urgent=urgent,
                         mem_bytes=mem_bytes, pids=pids, label=label[:32], elapsed_s=max(0.0, elapsed_s),
                         computes=computes, req=self._next_req())
                for rank, pids in members]
        replies = self._call_many(self._sock, msgs, None, give_up=lambda: not self.connected)
        forgotten = [r for r in replies if isinstance(r, pr.Error) and r.code == "unknown-session"]
        if forgotten and retry:  # a new session asks for every member again: the old one's grants are gone
            self._forgotten(msgs[0].session)
            self._register(self._sock, self.connect_timeout_s)
            if self.connected:
                return self._admit(kind, members, step, urgent, mem_bytes, label, elapsed_s, computes, retry=False)
        return [self._granted(reply, kind, pids) for reply, (_, pids) in zip(replies, members)]

    @staticmethod
    def _granted(reply, kind: str, pids: tuple[int, ...]) -> tuple[GrantHandle | None, str]:
        if isinstance(reply, pr.Grant):
            h = GrantHandle(substage=reply.substage, device=reply.device, pids=pids)
            h._update(reply)
            return h, ""
        if isinstance(reply, pr.Error):
            log.warning("jigsaw daemon: %s (running %s exclusively)", reply.message, kind)
            return None, "refused"
        return None, "unreachable"

    def _heartbeats(self) -> None:
        sock = self._socket()
        try:
            while not self._stop.is_set():
                if self.session is None:
                    self._register(sock, self.heartbeat_s * 4)
                    self._stop.wait(0.0 if self.session else self.heartbeat_s)
                    continue
                sent = time.monotonic()
                beat = pr.Heartbeat(session=self.session, wait_s=self.heartbeat_s, req=self._next_req())
                reply = self._call(sock, beat, self.heartbeat_s * 5, give_up=self._stop.is_set)
                if not (isinstance(reply, pr.Beat) and reply.grants):  # never faster than one per heartbeat_s
                    self._stop.wait(max(0.0, sent + self.heartbeat_s - time.monotonic()))
                if isinstance(reply, pr.Beat):
                    self._changed(reply.grants)
                    if self._unacked or any(not r["reported"] for r in self.fallen_open):
                        self._catch_up(sock)
                elif isinstance(reply, pr.Error) and reply.code == "unknown-session":
                    self._forgotten(beat.session)  # a new daemon, or a lost lease: register again
        finally:
            sock.close()


def ask(endpoint: str, msg, timeout_s: float):
    """One request on a connection of its own (status, stop): the daemon's reply, or None
    when no daemon answers at `endpoint` within `timeout_s`."""
    ch = Channel(socket_path(endpoint))
    try:
        ch.send(pr.encode(msg))
        return pr.decode_reply(ch.recv()) if ch.poll(int(timeout_s * 1000)) else None
    except (OSError, pr.ProtocolError):
        return None
    finally:
        ch.close()


def status(endpoint: str, timeout_s: float) -> pr.StatusReply | None:
    """The daemon's StatusReply, or None when none answers (or one of another protocol)."""
    reply = ask(endpoint, pr.Status(req=1), timeout_s)
    return reply if isinstance(reply, pr.StatusReply) else None


def ping(endpoint: str, timeout_s: float) -> bool:
    """Whether a daemon answers a Status request at `endpoint` within `timeout_s`."""
    return status(endpoint, timeout_s) is not None


def wait_for_daemon(endpoint: str, timeout_s: float) -> bool:
    """Ping until a daemon answers (a daemon just started) or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ping(endpoint, 0.3):
            return True
        time.sleep(0.05)  # not listening yet: a refused connection returns at once
    return False


def connect(pipeline: str | None = None, endpoint: str | None = None, devices: tuple[int, ...] = (), *,
            steps: int = 0, max_tokens: int = 0, slo_slowdown: float = 0.0, job: str = "", mode: str = "",
            staleness: int = 0) -> Client:
    """The client of this process.  Without a daemon endpoint (not under `jigsaw run`),
    a client that grants every sub-stage exclusively.  `steps` and `max_tokens`: the
    pipeline's step count and response cap, when it knows them (the scheduler plans better);
    `slo_slowdown`: its step SLO, if this registration creates the pipeline (`jigsaw run
    --slo` sets it for its job); `job`: the asynchronous job this pipeline is one side of
    (its other side registers with the same job; a side that is not the job's own name takes
    the owner token of the job's), `mode` and `staleness` its coupling and bound."""
    ep = endpoint or os.environ.get(ENV_ENDPOINT)
    name = pipeline or os.environ.get(ENV_PIPELINE) or f"pipeline-{os.getpid()}"
    owner = find_owner(ep, name) or (find_owner(ep, job) if job else "")
    if endpoint is None and not job and (placed := os.environ.get(ENV_NODES)):
        from jigsaw.runtime.across import parse_nodes, reach

        if len(nodes := parse_nodes(placed)) > 1:  # placed across nodes by the cluster (cluster/launch.py)
            got = reach(name, nodes, Client, owner=owner, steps=steps, max_tokens=max_tokens,
                        slo_slowdown=slo_slowdown)
            if not isinstance(got, str):
                return got
            log.warning("pipeline %s was placed across nodes, but %s: scheduled by this node's daemon alone, "
                        "as if it ran on this node only", name, got)
    return Client(name, ep, devices, owner=owner, steps=steps, max_tokens=max_tokens,
                  slo_slowdown=slo_slowdown, job=job, mode=mode, staleness=staleness)
