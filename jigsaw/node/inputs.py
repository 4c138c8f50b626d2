"""Worker messages into node facts: the one mapping the daemon, the simulator and a replay use.

    protocol request (jigsaw/protocol.py) of pipeline NAME
      Admit      ─► checked (kind, memory, step) ─► NodeState.request ─► Waiting
      Done       ─► NodeState.finish              (a waiting one: withdrawn, it never ran)
      Progress   ─► NodeState.report              LiveNumbers + memory of a piece
      Samples    ─► NodeState.count
      Lengths    ─► NodeState.observe             (parts joined until the last)
      NoRollout  ─► NodeState.rollout_over
      Forecast   ─► NodeState.forecast            pieces assembled as a step graph
      Opened     ─► NodeState.ran_open            a step its worker reached without the daemon;
                                                  the request it gave up on is withdrawn
    trace: `record(msg)` is what the daemon writes for each, `message(event)` reads it back
    (older traces' field names too), so a replay feeds the node the requests it had

A request the node cannot take raises `ProtocolError` (code bad-request), one whose facts are
out of order a ValueError, each with the reason, and changes nothing; the daemon answers it,
the simulator stops on it (its own bug).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from jigsaw import protocol as pr
from jigsaw.graph.builder import assemble_step_graph
from jigsaw.graph.ids import SubStageId
from jigsaw.graph.substage import SubStage, SubStageKind
from jigsaw.node.ledger import LiveNumbers, Waiting
from jigsaw.node.state import NodeState

KINDS = {k.value: k for k in SubStageKind}
EVENTS = {pr.Admit: "request", pr.Done: "done", pr.Progress: "progress", pr.Samples: "samples",
          pr.Lengths: "lengths", pr.NoRollout: "no_rollout", pr.Forecast: "forecast", pr.Opened: "open",
          pr.Migrate: "migrate"}
"""The trace event that records each kind of request the node takes."""
_BY_EVENT = {v: k for k, v in EVENTS.items()}
_TRACE_NAMES = {pr.Admit: {"dp_rank": "rank", "mem_bytes": "need_bytes"}, pr.Opened: {"dp_rank": "rank"}}
"""A request event's fields keep the names traces have always had (timelines and tools read them)."""
_FIELD_NAMES = {cls: {v: k for k, v in names.items()} for cls, names in _TRACE_NAMES.items()}


class Inbox:
    """Feeds one node's state; holds what a request in parts has sent so far."""

    def __init__(self, state: NodeState):
        self.state = state
        self._turns: dict[str, list[int]] = {}

    def register(self, msg: pr.Register) -> None:
        if 0.0 < msg.slo_slowdown < 1.0:
            raise pr.ProtocolError("bad-request", f"an SLO is a step slowdown >= 1.0 against the step alone, "
                                                  f"got {msg.slo_slowdown}")
        self.state.register(msg.pipeline, tuple(msg.devices), steps=msg.steps or None, max_tokens=msg.max_tokens,
                            slo_slowdown=msg.slo_slowdown or None, job=msg.job, mode=msg.mode,
                            staleness=msg.staleness)

    def release(self, name: str, sid: str, now_s: float):
        """A Done whose report was refused: the piece ends, its numbers unknown (what
        NodeState.finish returns)."""
        return self.state.finish(name, sid, now_s)

    def take(self, name: str, msg, now_s: float, owner=None):
        """The facts of one request of pipeline `name`: what NodeState returned (the Waiting an
        Admit became, what a Done finished, the requests an Opened withdrew), else None.
        ProtocolError (bad-request): the node cannot take it; ValueError: facts out of order
        (a step already over, a sub-stage that does not run); either way nothing changed."""
        s = self.state
        if isinstance(msg, pr.Admit):
            return self._admit(name, msg, now_s, owner)
        if isinstance(msg, pr.Done):
            return s.finish(name, msg.substage, now_s, final=msg.final, batch_size=msg.batch_size,
                            seq_len=msg.seq_len, num_steps=msg.num_steps, num_tokens=msg.num_tokens, flops=msg.flops)
        if isinstance(msg, pr.Progress):
            live = LiveNumbers(batch_size=float(msg.requests), context_tokens=msg.context_tokens,
                               generated=tuple(msg.generated)) if msg.requests else None
            s.report(name, msg.substage, live, msg.mem_bytes)
        elif isinstance(msg, pr.Samples):
            s.count(name, msg.step, msg.done, msg.total)
        elif isinstance(msg, pr.Lengths):
            turns = self._turns.setdefault(name, [])
            turns.extend(msg.turns)
            if not msg.more:
                s.observe(name, self._turns.pop(name))
        elif isinstance(msg, pr.NoRollout):
            s.rollout_over(name, msg.dp_rank, msg.step)
        elif isinstance(msg, pr.Forecast):
            s.forecast(name, forecast_graph(name, msg))
        elif isinstance(msg, pr.Opened):
            return s.ran_open(name, msg.dp_rank, msg.step, KINDS.get(msg.kind))
        else:
            raise pr.ProtocolError("bad-request", f"{type(msg).__name__} carries no facts of a pipeline")
        return None

    def _admit(self, name: str, msg: pr.Admit, now_s: float, owner) -> Waiting:
        kind = KINDS.get(msg.kind)
        if kind is None:
            raise pr.ProtocolError("bad-request", f"unknown sub-stage kind {msg.kind!r}; one of {', '.join(KINDS)}")
        if msg.mem_bytes > self.state.node.mem_bytes:
            raise pr.ProtocolError("bad-request", f"{kind.value} needs {msg.mem_bytes} bytes; a device of this "
                                                  f"node has {self.state.node.mem_bytes}")
        p = self.state.pipeline(name)
        if msg.step > p.step + 1 and p.started:
            raise pr.ProtocolError("bad-request", f"step {msg.step} of {name} jumps ahead of its step {p.step}")
        return self.state.request(name, kind, msg.dp_rank, msg.step, now_s, urgent=msg.urgent,
                                  need_bytes=msg.mem_bytes, expected_s=msg.expected_s or None,
                                  batch_size=msg.batch_size, elapsed_s=msg.elapsed_s, pids=tuple(msg.pids),
                                  owner=owner, ordinal=None if msg.ordinal < 0 else msg.ordinal,
                                  computes=msg.computes)

    def forget(self, name: str) -> None:
        """The pipeline left: a request it sent in parts is dropped."""
        self._turns.pop(name, None)


def forecast_graph(name: str, msg: pr.Forecast):
    """A Forecast's pieces as a step graph (chains per worker in order, stages in RL order)."""
    seen: dict[tuple[int, str], int] = {}
    pieces, order = [], {}
    for i, x in enumerate(msg.pieces):
        kind = KINDS.get(x.kind)
        if kind is None:
            raise pr.ProtocolError("bad-request", f"unknown sub-stage kind {x.kind!r} in a forecast")
        n = seen[(x.dp_rank, x.kind)] = seen.get((x.dp_rank, x.kind), -1) + 1
        sid = str(SubStageId(name, msg.step, x.dp_rank, kind, n))
        pieces.append(SubStage(id=sid, pipeline=name, step=msg.step, kind=kind, dp_rank=x.dp_rank,
                               duration_s=x.duration_s, mem_bytes=x.mem_bytes))
        order[sid] = float(i)
    return assemble_step_graph(pieces, order)


def forecast_of(graph) -> tuple[pr.Piece, ...]:
    """A step graph as a Forecast's pieces (what `forecast_graph` assembles back)."""
    return tuple(pr.Piece(kind=s.kind.value, dp_rank=s.dp_rank, duration_s=s.duration_s, mem_bytes=s.mem_bytes)
                 for s in graph)


# ---------------------------------------------------------------- trace

_UNRECORDED = ("type", "v", "req", "session", "owner")
"""Never in a trace: what routes a request, and an owner's secret."""


def record(msg) -> dict[str, Any]:
    """A request's facts as trace data (no session, request id or version)."""
    names = _TRACE_NAMES.get(type(msg), {})
    return {names.get(k, k): v for k, v in msgspec.to_builtins(msg).items() if k not in _UNRECORDED}


def message(event: str, data: Mapping[str, Any]):
    """The request a trace event recorded (None for an event that records none); fields it
    does not know (the daemon's own notes, such as `queued_ms`) are left out."""
    cls = _BY_EVENT.get(event)
    if cls is None:
        return None
    names = _FIELD_NAMES.get(cls, {})
    fields = {names.get(k, k): v for k, v in data.items() if names.get(k, k) in cls.__struct_fields__}
    return msgspec.convert({**fields, "session": ""} if "session" in cls.__struct_fields__ else fields, cls)
