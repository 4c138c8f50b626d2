"""Collective sub-stages of pipelines that span nodes, held until the cluster admits their gang.

    Register(nodes=(A, B, ...)) ─► span(): the pipeline's ranks run on those nodes, this one too
    Admit of a collective kind (training, reference) of such a pipeline ─► hold(): not yet a fact
      of the node state, kept under its gang "pipeline/step/kind/k" (the k-th such stage of the
      step, counted alike on every node)
      ─► once every local rank asked, and no spanning gang this node was told of runs here:
         link.ready(gang, nodes) ─► the cluster controller (cluster/gangs.py: whole or not at all)
    released(), every turn of the daemon's loop, from what the link heard (link.news()):
      admitted ─► each held Admit, urgent: this node starts it at once (the policy picks its
         budget), as every other member node does
      refused (a member node left, or one never asked for its part while free) ─► each held
         Admit as it came, and any of that gang's ranks that ask later: this node decides it alone
      the controller lost (news() is None) ─► everything held, as it came; nothing is held
         until it answers again (each node keeps deciding its own pipelines)
    started(gang, sid) / finished(sid): the gang's local part ─► when all of it ended,
      link.done(gang), and the held gangs are offered again (the controller consumed this
      node's other offers when it admitted that one: spanning gangs mostly take turns; two
      admitted together both start at once on every member, where each node co-locates them)
    forget(sessions): a client gone ─► its held Admits go, their gangs withdrawn

Why no deadlock: a node offers a gang while holding nothing for it, and starts it only when
every member starts it; a gang half-admitted (one node's part started, waiting in its
collective for a part another node gave its devices away from) cannot happen.  Decisions
stay the node's own: the controller says only when a spanning gang may start.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from jigsaw import protocol as pr
from jigsaw.graph.ids import SubStageKind

log = logging.getLogger("jigsaw.daemon")
_KINDS = {k.value: k for k in SubStageKind}
ALONE_KEPT = 1024


class Link(Protocol):
    """The node's line to the cluster controller (cluster/controller.py RayLink)."""

    node_id: str

    def ready(self, gang: str, members: tuple[str, ...]) -> None:
        """Offer this node's part of `gang` (never blocks: a lost controller shows in news())."""

    def withdraw(self, gang: str) -> None: ...

    def done(self, gang: str) -> None: ...

    def news(self) -> list[tuple[str, str]] | None:
        """What the controller said since the last call: (gang, "") admitted, (gang, why)
        refused; None while the controller is lost."""


@dataclass(frozen=True, slots=True)
class Held:
    """An Admit held for its gang, with what the daemon needs to take it later."""

    msg: pr.Admit
    session: str
    conn: int
    arrived_s: float


@dataclass(slots=True)
class _Gang:
    pipeline: str
    ranks: dict[int, Held] = field(default_factory=dict)
    offered: bool = False


class Spanning:
    """The node daemon's gate for gangs that span nodes (see the module docstring)."""

    def __init__(self, link: Link | None):
        self.link = link
        self.spans: dict[str, tuple[str, ...]] = {}
        """Pipeline -> every node its ranks run on."""
        self.ranks: dict[str, int] = {}
        """Pipeline -> its ranks on this node."""
        self.held: dict[str, _Gang] = {}
        self.running: dict[str, set[str]] = {}
        """Admitted gangs here: the ids of their local sub-stages not yet ended."""
        self._sid_gang: dict[tuple[str, str], str] = {}
        self._counts: Counter[tuple[str, int, str, int]] = Counter()
        self.alone: dict[str, None] = {}
        """Gangs the cluster refused (the newest ALONE_KEPT): their ranks are decided here."""
        self.lost = False
        self.admitted = self.refused = 0

    def span(self, pipeline: str, nodes: tuple[str, ...], local_ranks: int) -> None:
        """`pipeline` runs on `nodes`; ValueError where this node is not one of them."""
        if len(nodes) < 2:
            return
        if self.link is None:
            log.warning("%s spans nodes %s, but this daemon is in no cluster (--cluster): its gangs are "
                        "decided here alone", pipeline, ", ".join(nodes))
            return
        if self.link.node_id not in nodes:
            raise pr.ProtocolError("bad-request", f"pipeline {pipeline!r} names nodes {list(nodes)}, "
                                                  f"not this one ({self.link.node_id})")
        self.spans[pipeline], self.ranks[pipeline] = tuple(sorted(set(nodes))), local_ranks

    def hold(self, pipeline: str, held: Held) -> bool:
        """Whether this Admit waits here for its gang (False: the node takes it now)."""
        msg = held.msg
        kind = _KINDS.get(msg.kind)
        if pipeline not in self.spans or self.lost or kind is None or not kind.collective:
            return False
        k = msg.ordinal
        if k < 0:  # the worker does not count: the k-th such stage of this rank's step, alike on every node
            key = (pipeline, msg.step, msg.kind, msg.dp_rank)
            k, self._counts[key] = self._counts[key], self._counts[key] + 1
        gang = f"{pipeline}/{msg.step}/{msg.kind}/{k}"
        if gang in self.alone:  # refused before this rank asked (its other nodes' parts ran alone)
            return False
        g = self.held.setdefault(gang, _Gang(pipeline=pipeline))
        if msg.dp_rank in g.ranks:
            raise pr.ProtocolError("bad-request", f"{gang}: rank {msg.dp_rank} asked twice")
        g.ranks[msg.dp_rank] = held
        self._offer()
        return True

    def released(self) -> list[tuple[str, Held, bool]]:
        """Held Admits the daemon takes now: (gang, held, admitted: start it at once)."""
        if self.link is None or not (self.held or self.running or self.spans):
            return []
        news = self.link.news()
        if news is None:
            if not self.lost:
                log.warning("the cluster controller is lost: this node decides its spanning gangs alone")
            self.lost = True
            return [(gang, h, False) for gang in list(self.held) for h in self._pop(gang, withdraw=False)]
        if self.lost:
            log.info("the cluster controller answers again: spanning gangs wait for it")
            self.lost = False
        out = []
        for gang, why in news:
            if why:
                self.alone[gang] = None
                if len(self.alone) > ALONE_KEPT:
                    del self.alone[next(iter(self.alone))]
            if gang not in self.held:
                continue  # withdrawn meanwhile
            if why:
                self.refused += 1
                log.warning("%s refused by the cluster (%s): decided here alone", gang, why)
            else:
                self.admitted += 1
                self.running[gang] = set()
                for other in self.held.values():  # the controller consumed this node's other offers
                    other.offered = False
            out += [(gang, h, not why) for h in self._pop(gang, withdraw=False)]
        self._offer()
        return out

    def started(self, gang: str, pipeline: str, sid: str) -> None:
        if gang in self.running:
            self.running[gang].add(sid)
            self._sid_gang[(pipeline, sid)] = gang

    def finished(self, pipeline: str, sid: str) -> None:
        """A local sub-stage of an admitted gang ended (done, withdrawn or migrated away)."""
        gang = self._sid_gang.pop((pipeline, sid), None)
        if gang is None:
            return
        left = self.running[gang]
        left.discard(sid)
        if not left:
            del self.running[gang]
            self.link.done(gang)
            self._offer()

    def forget(self, sessions: set[str], pipeline_gone: str | None = None) -> None:
        """Clients gone: their held Admits go (their gangs withdrawn); with `pipeline_gone`, the pipeline too."""
        for gang in list(self.held):
            g = self.held[gang]
            g.ranks = {r: h for r, h in g.ranks.items() if h.session not in sessions}
            if not g.ranks or g.pipeline == pipeline_gone:
                self._pop(gang)
            elif g.offered and len(g.ranks) < self.ranks[g.pipeline]:  # no longer whole
                g.offered = False
                self.link.withdraw(gang)
        if pipeline_gone is not None:
            self.spans.pop(pipeline_gone, None)
            self.ranks.pop(pipeline_gone, None)
            for key in [k for k in self._counts if k[0] == pipeline_gone]:
                del self._counts[key]
            for gang in [g for g in self.alone if g.startswith(f"{pipeline_gone}/")]:
                del self.alone[gang]

    def ran_open(self, pipeline: str, rank: int, step: int, kind: str) -> None:
        """A worker says it ran `kind` without the daemon: its held Admit is no longer asked for."""
        for gang in [g for g, x in self.held.items() if x.pipeline == pipeline and g.startswith(f"{pipeline}/{step}/")
                     and g.split("/")[2] == kind and rank in x.ranks]:
            self.held[gang].ranks.pop(rank)
            if self.held[gang].offered and self.link is not None:
                self.held[gang].offered = False
                self.link.withdraw(gang)
            if not self.held[gang].ranks:
                del self.held[gang]

    def _pop(self, gang: str, withdraw: bool = True) -> list[Held]:
        g = self.held.pop(gang)
        if withdraw and g.offered and self.link is not None:
            self.link.withdraw(gang)
        return [g.ranks[r] for r in sorted(g.ranks)]

    def _offer(self) -> None:
        """Offer every whole held gang, while no admitted spanning gang runs on this node."""
        if self.running or self.lost or self.link is None:
            return
        for gang, g in self.held.items():
            if not g.offered and len(g.ranks) == self.ranks[g.pipeline]:
                g.offered = True
                self.link.ready(gang, self.spans[g.pipeline])
