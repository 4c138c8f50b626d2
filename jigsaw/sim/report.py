"""What the simulated engines tell the node state, as their clients would (runtime/client.py).

    begin_step     each worker asks for its first regime (it waits for admission)
    sync_worker    after a worker's event: a regime change finishes one sub-stage and asks
                   for the next (urgent: a running engine cannot pause); a tool wait asks as
                   host work; a worker out of requests finishes its last one
    ask_reward     the host reward, its length known from the batch
    ask_gang       a reference / training stage on every rank, its size known from the batch
    finish_stage   the stage in flight ended
    live_numbers   what each engine knows before a decision: its requests (decoding, or queued
                   for their prefill), their contexts and generated tokens (tail residuals),
                   the memory it holds, samples done

Ids are the engines' own (`RolloutWorker.piece_id`), which number regimes as the graph
builder does, so the node state's facts line up with the pipeline's history.
"""

from __future__ import annotations

from jigsaw.graph.ids import SubStageId
from jigsaw.node.ledger import LiveNumbers, LivePipeline
from jigsaw.graph.substage import SubStageKind
from jigsaw.sim.pipeline import PipelineRun


def begin_step(run: PipelineRun, t: float, live: dict[tuple[int, int], str]) -> None:
    p: LivePipeline = run.ledger
    p.more_steps = run.step + 1 < run.steps_total
    if not p.history:
        p.prior = run.cold_graph()  # a guess from the workload's cap until a step has run
    for r, wk in enumerate(run.workers):
        if wk.done:
            p.ended.add(r)  # routing sent it nothing this step
            continue
        sid = wk.first_piece_id()
        p.request(SubStageId.parse(sid).kind, r, run.step, t, sid=sid)
        live[(run.index, r)] = sid


def sync_worker(run: PipelineRun, rank: int, t: float, live: dict[tuple[int, int], str]) -> None:
    if rank not in run.started_workers:
        return  # still waiting for admission with its first regime
    wk, key = run.workers[rank], (run.index, rank)
    was = live.get(key)
    now = None if wk.done else (wk.piece_id() or was)
    if now == was:
        return
    if was is not None:
        _end(run.ledger, was, t, final=now is None)
        live.pop(key)
    if now is not None:
        kind = SubStageId.parse(now).kind
        began = wk.piece.start_s if wk.piece is not None else t  # recognised a few steps into it
        run.ledger.request(kind, rank, run.step, t, sid=now, urgent=kind.on_device,
                           need_bytes=int(wk.need_bytes(wk.held_kv_tokens())) if kind.on_device else 0,
                           work_s=max(0.0, t - began) / wk.s if kind.on_device else 0.0)
        live[key] = now


def ask_reward(run: PipelineRun, t: float, end_s: float) -> None:
    sid = str(SubStageId(run.name, run.step, 0, SubStageKind.REWARD, 0))
    run.ledger.request(SubStageKind.REWARD, 0, run.step, t, sid=sid, expected_s=max(end_s - t, 1e-6))


def ask_gang(run: PipelineRun, t: float) -> None:
    g = run.gang
    for sid, rank in zip(g.ids, g.ranks):
        run.ledger.request(g.kind, rank, run.step, t, sid=sid, expected_s=max(g.excl_s, 1e-6), need_bytes=g.mem_bytes,
                           batch_size=g.seqs_per_rank)


def finish_stage(run: PipelineRun, t: float) -> None:
    p = run.ledger
    for sid in [sid for sid, r in p.running.items() if not r.kind.is_rollout and r.kind is not SubStageKind.TOOL]:
        p.finish(sid, t)


def live_numbers(run: PipelineRun) -> None:
    p = run.ledger
    total = done = 0
    for wk in run.workers:
        done += len(wk.finished)
        total += len(wk.finished) + wk.num_active
        sid = wk.piece_id() or ""
        fact = p.running.get(sid) or p.waiting.get(sid)
        # queued requests count: a migrated request waits for its recompute, and moving it
        # on would recompute it again
        reqs = [*wk.queue, *wk.decoding]
        if fact is None or not reqs:
            continue
        fact.live = LiveNumbers(batch_size=float(len(reqs)), context_tokens=sum(q.context for q in reqs) / len(reqs),
                                generated=tuple(q.generated for q in reqs))
        fact.need_bytes = int(wk.need_bytes(wk.held_kv_tokens()))
    p.samples = (done, total) if total else None


def _end(p: LivePipeline, sid: str, t: float, final: bool) -> None:
    if sid in p.waiting:
        p.withdraw(sid)  # replaced before it was admitted: it never ran
        if final:
            p.ended.add(SubStageId.parse(sid).rank)
    else:
        p.finish(sid, t, final=final)  # (a no-op but `final` for one a migration ended)
