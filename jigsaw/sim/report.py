"""The simulated workers' clients: the protocol requests a live worker would send, nothing else.

    Clients(inbox) ─ send(run, request, t) ─► node/inputs.py Inbox ─► NodeState  (the daemon's path)
    register       Register: the pipeline's devices, step count and response cap
    begin_step     a Forecast of the cap-based step before any history; each worker asks for
                   its first regime (Admit: its ordinal); a worker routing sent nothing: NoRollout;
                   an asynchronous training side asks for its gang
    sync_worker    after a worker's event: a regime change finishes one sub-stage (Done with the
                   numbers a live Rollout reports) and asks for the next (Admit, urgent: a
                   running engine cannot pause, with the seconds it already ran); a tool wait
                   asks as host work; a worker out of requests finishes its last one (final)
    ask_reward     the host reward, its length known from the batch
    ask_gang       a reference / training stage on every rank, its size known from the batch
    finish_stage   the stage in flight ended (Done with its numbers)
    live_numbers   before each decision: each engine's requests (Progress: decoding or queued
                   for their prefill, contexts, generated tokens) and the samples done (Samples)
    observe        finished turns' lengths (Lengths), when the engine has them

Ids are the engines' own (`RolloutWorker.piece_id`), which number regimes as the graph
builder does; Admit carries the ordinal, so the node names a piece as its worker does.
What a client knows is its own: what it asked for last (`asked`), never the node's facts.
"""

from __future__ import annotations

from typing import NamedTuple

from jigsaw import protocol as pr
from jigsaw.graph.ids import SubStageId
from jigsaw.graph.substage import SubStageKind
from jigsaw.node.inputs import Inbox, forecast_of
from jigsaw.sim.pipeline import PipelineRun


class Sent(NamedTuple):
    """A request a simulated client sent (`record`)."""

    t_s: float
    pipeline: str
    request: object


class Decided(NamedTuple):
    """The node decided here (`record`): its plan as a daemon's trace records it, None when
    nothing waited or ran."""

    t_s: float
    plan: dict | None


class Clients:
    """Every simulated worker's client on one node (module docstring)."""

    def __init__(self, inbox: Inbox, record: list | None = None):
        self.inbox = inbox
        self.asked: dict[tuple[int, int], str] = {}
        """(pipeline, rank) -> the sub-stage its worker's client asked for last."""
        self.stage: dict[int, tuple[str, ...]] = {}
        """Pipeline -> the reward or gang sub-stages it asked for (one per rank)."""
        self.counters: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        """(pipeline, rank) -> the worker's forward counters when its piece was asked for."""
        self.record = record
        """If a list: every request sent (`Sent`), and the node's decisions between them
        (`Decided`, NodeSim's), in order: what a daemon would have been given, and done."""

    def send(self, run: PipelineRun, msg, t: float):
        if self.record is not None:
            self.record.append(Sent(t, run.name, msg))
        return self.inbox.take(run.name, msg, t)

    def register(self, run: PipelineRun) -> None:
        msg = pr.Register(pipeline=run.name, pid=1, devices=run.devices, steps=run.steps_total,
                          max_tokens=run.spec.lengths.max_tokens, slo_slowdown=run.slo_slowdown or 0.0,
                          job=run.job, **({"mode": run.spec.mode, "staleness": run.spec.staleness_bound}
                                          if run.job else {}))
        if self.record is not None:
            self.record.append(Sent(0.0, run.name, msg))
        self.inbox.register(msg)

    # ------------------------------------------------------------ rollout

    def begin_step(self, run: PipelineRun, t: float, first: bool) -> None:
        if first:  # a guess from the workload's cap until a step has run
            self.send(run, pr.Forecast(session="", step=run.step, pieces=forecast_of(run.cold_graph())), t)
        for r, wk in enumerate(run.workers):
            if wk.done:
                self.send(run, pr.NoRollout(session="", dp_rank=r, step=run.step), t)
                continue
            sid = wk.first_piece_id()
            self._admit(run, r, sid, t)
        if run.gang is not None:  # an asynchronous training side: its step starts with its gang
            self.ask_gang(run, t)

    def sync_worker(self, run: PipelineRun, rank: int, t: float) -> None:
        if rank not in run.started_workers:
            return  # still waiting for admission with its first regime
        wk, key = run.workers[rank], (run.index, rank)
        was = self.asked.get(key)
        now = None if wk.done else (wk.piece_id() or was)
        if now == was:
            return
        began = wk.piece.start_s if now is not None and wk.piece is not None else t  # recognised steps into it
        if was is not None:
            self._done(run, rank, was, t, final=now is None, upto_s=began)
            self.asked.pop(key)
        if now is not None:
            kind = SubStageId.parse(now).kind
            self._admit(run, rank, now, t, urgent=kind.on_device,
                        mem_bytes=int(wk.need_bytes(wk.held_kv_tokens())) if kind.on_device else 0,
                        elapsed_s=max(0.0, t - began) if kind.on_device else 0.0, since_s=began)

    def _admit(self, run: PipelineRun, rank: int, sid: str, t: float, since_s: float | None = None, **facts) -> None:
        i = SubStageId.parse(sid)
        self.send(run, pr.Admit(session="", kind=i.kind.value, dp_rank=rank, step=run.step, ordinal=i.ordinal,
                                **facts), t)
        self.asked[(run.index, rank)] = sid
        self.counters[(run.index, rank)] = run.workers[rank].counters(since_s)

    def _done(self, run: PipelineRun, rank: int, sid: str, t: float, final: bool, upto_s: float | None = None) -> None:
        """What a live Rollout reports of a regime: its steps, tokens, FLOPs, mean decoding
        requests per step and KV tokens per request, from its first step to the next regime's."""
        wk = run.workers[rank]
        counted = wk.counters(upto_s if upto_s is not None and upto_s < t else None)
        steps, tokens, reqs, kv = (now - then for now, then in zip(counted, self.counters[(run.index, rank)]))
        self.send(run, pr.Done(session="", substage=sid, final=final, num_steps=steps, num_tokens=tokens,
                               flops=run.cost.flops_per_token * tokens,
                               batch_size=reqs / steps if steps else 0.0, seq_len=kv / reqs if reqs else 0.0), t)

    # ------------------------------------------------------------ stages

    def ask_reward(self, run: PipelineRun, t: float, end_s: float) -> None:
        sid = str(SubStageId(run.name, run.step, 0, SubStageKind.REWARD, 0))
        self.send(run, pr.Admit(session="", kind=SubStageKind.REWARD.value, dp_rank=0, step=run.step, ordinal=0,
                                expected_s=max(end_s - t, 1e-6)), t)
        self.stage[run.index] = (sid,)

    def ask_gang(self, run: PipelineRun, t: float) -> None:
        g = run.gang
        for rank in g.ranks:
            self.send(run, pr.Admit(session="", kind=g.kind.value, dp_rank=rank, step=run.step, ordinal=0,
                                    expected_s=max(g.excl_s, 1e-6), mem_bytes=g.mem_bytes,
                                    batch_size=g.seqs_per_rank), t)
        self.stage[run.index] = g.ids

    def finish_stage(self, run: PipelineRun, t: float, gang=None) -> None:
        """The reward or gang in flight ended; a gang's ranks report their batch and tokens."""
        numbers = {} if gang is None else {
            "batch_size": gang.seqs_per_rank, "num_steps": max(1, len(gang.intervals)),
            "num_tokens": int(gang.tokens_per_rank), "flops": run.cost.flops_per_token * gang.tokens_per_rank,
            "seq_len": gang.tokens_per_rank / gang.seqs_per_rank if gang.seqs_per_rank else 0.0}
        for sid in self.stage.pop(run.index, ()):
            self.send(run, pr.Done(session="", substage=sid, **numbers), t)

    # ------------------------------------------------------------ what engines know

    def live_numbers(self, run: PipelineRun, t: float) -> None:
        total = done = 0
        for wk in run.workers:
            done += len(wk.finished)
            total += len(wk.finished) + wk.num_active
            sid = wk.piece_id()
            # queued requests count: a migrated request waits for its recompute, and moving it
            # on would recompute it again
            reqs = [*wk.queue, *wk.decoding]
            if sid is None or not reqs or sid != self.asked.get((run.index, wk.rank)):
                continue
            generated = sorted(q.generated for q in reqs)[-pr.MAX_LIST:] if len(reqs) > pr.MAX_LIST else \
                [q.generated for q in reqs]
            self.send(run, pr.Progress(session="", substage=sid, requests=len(reqs),
                                       context_tokens=sum(q.context for q in reqs) / len(reqs),
                                       generated=tuple(generated), mem_bytes=int(wk.need_bytes(wk.held_kv_tokens()))),
                      t)
        self.send(run, pr.Samples(session="", step=run.step, done=done, total=total), t)

    def observe(self, run: PipelineRun, t: float) -> None:
        """The turn lengths of the step's finished requests (one observation, in parts)."""
        turns = [n for wk in run.workers for q in wk.finished for n in q.turns]
        parts = [turns[i:i + pr.MAX_LIST] for i in range(0, len(turns), pr.MAX_LIST)] or [[]]
        for i, part in enumerate(parts):
            self.send(run, pr.Lengths(session="", turns=tuple(part), more=i < len(parts) - 1), t)
