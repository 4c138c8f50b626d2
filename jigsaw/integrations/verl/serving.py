"""The engine thread of a verl rollout replica: requests in, the jigsaw daemon's regimes out.

    inbox ── ("generate", pending) ──► no rollout open: Rollout.start(prompt tokens) waits for
       │                                the daemon's grant, then engine.submit(...)
       ├──── ("abort_all", reply) ──► engine.abort_all(): each partial output to its caller
       └──── ("update_weights", …) ──► engine.update_weights() between forwards
       └──── ("migrate", replica) ──► like a daemon's migration order, below
    every POLL_S: engine.forward_steps() ─► Rollout.forward()   (regime sub-stages)
                  the grant's routing weights, when new ─► verl's balancer (balancer.py)
                  the grant's migration orders from this rank ─► every request in flight is
                      aborted here and its caller's future gets Moved(target replica, partial):
                      the actor resumes it there (server.py), prompt + partial, same budget
                  engine.poll()          ─► the callers' futures
                  nothing in flight      ─► Rollout.close()      (this replica's rollout is over)

Only this thread touches the engine (it is for one caller thread); replies cross back to the
actor's event loop with `call_soon_threadsafe`.  Without a daemon (not under `jigsaw run`, or
it died) the client grants everything exclusively and the replica serves on, unscheduled.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import time
from dataclasses import dataclass, field

from jigsaw.engines.rollout import Completion, Request

log = logging.getLogger("jigsaw.verl")
GEN = "gen"
"""verl's name of the generation stage (its `marked_timer`), the label of the regimes."""
POLL_S = 0.005
IDLE_WAIT_S = 0.1


@dataclass(frozen=True, slots=True)
class Moved:
    """A request this replica handed over: where it goes on, and what was generated so far."""

    target_replica: int
    completion: Completion


@dataclass(slots=True)
class Stats:
    """What this replica did with migrations (for tests and the bench)."""

    forwards: int = 0
    """Forward steps of the engine so far."""
    moved_out: int = 0
    resumed: list = field(default_factory=list)
    """(rid, partial tokens carried, tokens prefilled here, tokens generated here) per request
    that arrived with a partial output and finished here."""


def say(line: str) -> None:
    """A migration, in the job's own output (Ray forwards a replica's stderr to the driver)."""
    print(f"(jigsaw) {line}", file=sys.stderr, flush=True)


def _resolve(p_loop, fut, value=None, error: BaseException | None = None) -> None:
    def put():
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    p_loop.call_soon_threadsafe(put)


class Serving:
    def __init__(self, engine, config, step_of, on_routing=None):
        from jigsaw.integrations.verl.placement import dp_rank, node_devices
        from jigsaw.runtime.client import connect

        self.engine, self.config, self.step_of = engine, config, step_of
        self.client = connect()
        devices = node_devices(self.client)
        self.dp_rank = dp_rank(config.replica_rank, devices)
        if self.client.connected and config.replica_rank >= devices:
            log.warning("jigsaw: rollout replica %d shares DP rank %d with replica %d: the daemon has %d device(s); "
                        "with one per replica (jigsaw daemon --devices) each is a DP worker of its own",
                        config.replica_rank, self.dp_rank, self.dp_rank, devices)
        self.on_routing = on_routing
        self._routed: tuple[float, ...] | None = None
        self.pending: dict = {}
        self.rollout = None
        self._step = None
        self._ordered: set = set()
        self.stats = Stats()
        self.params = sum(p.numel() for p in engine.model.parameters())

    def serve(self, inbox: queue.Queue) -> None:
        while True:
            self.tick(inbox)

    def tick(self, inbox: queue.Queue) -> int:
        """One round: take requests, follow the forward steps and the daemon's orders, answer
        what finished.  The forward steps seen."""
        self._take(inbox, POLL_S if self.pending else IDLE_WAIT_S)
        seen = self._steps()
        self.stats.forwards += seen
        self._orders()
        self._route()
        for c in self.engine.poll(0.0):
            if (p := self.pending.pop(c.rid, None)) is not None:
                if p.partial_ids:
                    self.stats.resumed.append((c.rid, len(p.partial_ids), c.prefilled_tokens, c.generated_tokens))
                    say(f"replica {self.config.replica_rank} finished {c.rid}, migrated here: "
                        f"{len(p.partial_ids)} tokens carried, {c.prefilled_tokens} prefilled, "
                        f"{c.generated_tokens} generated")
                _resolve(p.loop, p.done, c)
        if self.rollout is not None and not self.pending:
            self._close()
        return seen

    def _take(self, inbox: queue.Queue, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        todo = []
        while True:
            try:
                todo.append(inbox.get(timeout=max(0.0, deadline - time.monotonic()) if not todo else 0.0))
            except queue.Empty:
                break
        new = [arg for what, arg in todo if what == "generate"]
        if new:
            self._open(sum(len(p.prompt_ids) for p in new))
        for p in new:
            self._submit(p)
        for what, arg in todo:
            if what != "generate":
                self._control(what, *arg)

    def _open(self, prompt_tokens: int) -> None:
        step = self.step_of()
        if self.rollout is not None and step != self._step:
            self._close()
        if self.rollout is None:
            self._step = step
            self.rollout = self.client.rollout(dp_rank=self.dp_rank, step=step, pids=(os.getpid(),), label=GEN)
            self.rollout.flops_per_token = 2.0 * self.params
            self.rollout.start(prompt_tokens)  # waits for the daemon's admission

    def _submit(self, p) -> None:
        try:
            self.engine.submit(Request(rid=p.rid, prompt_ids=p.prompt_ids, max_new_tokens=p.max_new_tokens,
                                       partial_ids=p.partial_ids, partial_logprobs=p.partial_logprobs))
            self.pending[p.rid] = p
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the replica serves on
            _resolve(p.loop, p.done, error=exc)

    def _control(self, what: str, arg, fut, loop) -> None:
        try:
            if what == "update_weights":
                self.engine.update_weights(arg)
                _resolve(loop, fut, None)
            elif what == "migrate":
                _resolve(loop, fut, self._migrate(int(arg)))
            elif what == "abort_all":
                aborted = self.engine.abort_all()
                for c in aborted:
                    if (p := self.pending.pop(c.rid, None)) is not None:
                        _resolve(p.loop, p.done, c)
                _resolve(loop, fut, len(aborted))
            else:
                raise ValueError(f"unknown control {what!r}")
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            _resolve(loop, fut, error=exc)

    def _steps(self) -> int:
        steps = self.engine.forward_steps()
        if self.rollout is not None:
            for fs in steps:
                self.rollout.forward(fs.num_prefill_tokens, fs.num_decode_reqs, fs.kv_tokens)
        return len(steps)

    def _orders(self) -> None:
        """The daemon's migration orders from this replica's rank (each carried out once)."""
        grant = self.rollout.grant if self.rollout is not None else None
        for m in grant.migrations if grant is not None else ():
            key = (self._step, m.source_rank, m.target_rank)
            if m.source_rank == self.dp_rank != m.target_rank and key not in self._ordered:
                self._ordered.add(key)
                self._migrate(m.target_rank)

    def _route(self) -> None:
        """The plan's routing weights, when a grant brings new ones, go to verl's balancer."""
        weights = self.rollout.grant.routing if self.rollout is not None and self.rollout.grant is not None else None
        if weights and weights != self._routed and self.on_routing is not None:
            self._routed = tuple(weights)
            self.on_routing(self._routed)

    def _migrate(self, target_replica: int) -> int:
        """Hand every request in flight to `target_replica`: aborted here (its partial output
        kept), resumed there by the actor.  This replica's rollout is over."""
        if target_replica == self.config.replica_rank:
            return 0
        carried = []
        for rid in self.engine.active():
            c = self.engine.abort(rid)
            if (p := self.pending.pop(rid, None)) is not None:
                _resolve(p.loop, p.done, Moved(target_replica, c))
                carried.append(len(c.output_ids))
        moved = len(carried)
        self.stats.moved_out += moved
        if moved:
            say(f"replica {self.config.replica_rank} handed {moved} request(s) in flight to replica {target_replica}, "
                f"carrying {' '.join(map(str, carried))} tokens")
        if moved and self.rollout is not None:
            self._close()
        return moved

    def _close(self) -> None:
        self.rollout.close()
        self.rollout = None
