"""One simulated RL pipeline: its steps, stages, workers and records.

    begin_step ─► samples (workload) ─► dispatch to DP workers (routing weights)
        ROLLOUT   RolloutWorker per rank (rollout.py), started when the policy admits them
        REWARD    host, reward_s_per_sample × samples
        REFERENCE Gang: actor old log-probs + reference log-probs (two forward passes, verl)
        TRAINING  Gang: forward, recompute, backward, optimizer share
    end_step  ─► records + columns ─► GraphBuilder ─► the step's graph (the node's history)

A Gang's replicas run in lockstep: it progresses at the balanced rate Σ(1/s_d)/n when the
plan skews micro-batches (jigsaw), else at 1/max(s_d) (verl's equal split).

Tail batching (RollPacker §3): short rounds launch ⌈ηP⌉ prompts × ⌈ηR⌉ responses, keep the
first R responses of the first P prompts to finish them and defer the others' prompts;
once P prompts are deferred, a long round runs them without speculation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from jigsaw.graph.builder import GraphBuilder, GraphConfig
from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.ids import SubStageId
from jigsaw.graph.residual import ResidualLength
from jigsaw.graph.substage import Stage, StepRecord, SubStage, SubStageKind
from jigsaw.mux.costmodel import StepCost
from jigsaw.sim.rollout import Request, RolloutWorker
from jigsaw.sim.workload import WorkloadSpec, sample_step

ROLLOUT, REWARD, REFERENCE, TRAINING, WAITING, DONE = "rollout", "reward", "reference", "training", "waiting", "done"
TAILBATCH_ETA = 1.25
"""RollPacker's speculation factor on prompts and responses (RollPacker §3)."""


@dataclass
class Gang:
    """A reference or training stage: replicas in lockstep on their devices."""

    kind: SubStageKind
    ids: tuple[str, ...]
    ranks: tuple[int, ...]
    devices: tuple[int, ...]
    excl_s: float
    tokens_per_rank: float
    seqs_per_rank: float
    mem_bytes: int
    rem_s: float = 0.0
    started_s: float | None = None
    t_last: float = 0.0
    rate: float = 1.0
    balanced: bool = False
    slowdowns: dict[int, float] = field(default_factory=dict)
    version: int = 0
    intervals: list[tuple[float, float, float]] = field(default_factory=list)
    """(start, end, slowdown) pieces, for its records."""

    def advance(self, t: float) -> None:
        if self.started_s is not None and t > self.t_last:
            self.rem_s = max(0.0, self.rem_s - (t - self.t_last) * self.rate)
            self.intervals.append((self.t_last, t, 1.0 / self.rate))
        self.t_last = max(self.t_last, t)

    def end_time(self) -> float:
        return self.t_last + self.rem_s / self.rate


@dataclass
class StepMetrics:
    step: int
    start_s: float
    end_s: float
    tokens: int
    """Prompt + response tokens of the samples trained on."""
    samples: int
    """Samples trained on (GRPO batch: prompts × group)."""
    round: str
    """plain | short | long (tail batching)."""
    stage_s: dict[str, float]


class PipelineRun:
    """A pipeline being simulated (see module docstring)."""

    def __init__(self, index: int, spec: WorkloadSpec, *, name: str, steps: int, seed: int, cost: StepCost,
                 rollout_devices: tuple[int, ...], train_devices: tuple[int, ...], tailbatch: bool = False,
                 graph_config: GraphConfig = GraphConfig(), kv_pool_tokens: int | None = None):
        self.index, self.spec, self.name, self.steps_total = index, spec, name, steps
        self.cost, self.tailbatch, self.graph_config = cost, tailbatch, graph_config
        self.rollout_devices, self.train_devices = rollout_devices, train_devices
        # Disaggregated placement (rollout and training on different GPUs): training ranks
        # follow the rollout ranks, so every rank of the graph has its own device.
        self.train_rank0 = 0 if rollout_devices == train_devices else len(rollout_devices)
        self.rng = np.random.default_rng(seed)
        self.builder = GraphBuilder(graph_config)
        self.kv_pool_tokens = kv_pool_tokens or self._default_pool()
        self.rollout_mem = cost.rollout_mem_bytes(self.kv_pool_tokens)
        self.step, self.stage, self.t_stage = -1, WAITING, 0.0
        self.workers: list[RolloutWorker] = []
        self.started_workers: set[int] = set()
        self.gang: Gang | None = None
        self.reward_end_s = 0.0
        self.records: list[StepRecord] = []
        self.metrics: list[StepMetrics] = []
        self.device_s = 0.0
        """Exclusive device-seconds of all finished steps (for the lower bound)."""
        self.completed: dict[int, int] = {}
        """rid -> times completed, this step (exactly-once check)."""
        self.deferred_scales: list[float] = []
        self._round: dict = {}
        self.ledger = None
        """Its facts in the node state (graph.live.LivePipeline), set by the simulator."""
        self.last_graph: SubStageGraph | None = None
        """The builder's graph of the last finished step (the pipeline's history)."""
        self.lengths = ResidualLength(max_tokens=spec.lengths.max_tokens)
        """Turn lengths of finished requests: how long a live tail still runs."""
        self._stage_s: dict[str, float] = {}
        self._step_start = 0.0

    def _default_pool(self) -> int:
        """KV pool for every sample of a worker at twice the median response.  The paper resizes
        the pool from recent peaks every ~30 steps; the engine model never preempts, so the
        pool only sets the rollout's memory footprint."""
        w = self.spec
        per_worker = math.ceil(w.samples * (TAILBATCH_ETA**2 if self.tailbatch else 1) / len(self.rollout_devices))
        return int(per_worker * (w.prompt_tokens + 2 * w.lengths.median_tokens))

    # ------------------------------------------------------------ steps

    @property
    def finished_all(self) -> bool:
        return self.stage == DONE

    @property
    def devices(self) -> tuple[int, ...]:
        """Device of every rank of the graph (training ranks after rollout ranks if disaggregated)."""
        return self.rollout_devices + (self.train_devices if self.train_rank0 else ())

    def begin_step(self, t: float, weights: tuple[float, ...] | None = None) -> None:
        self.step += 1
        if self.step >= self.steps_total:
            self.stage = DONE
            return
        self.stage, self._step_start, self._stage_s = ROLLOUT, t, {}
        self.t_stage = t
        self.records, self.completed, self.started_workers = [], {}, set()
        self.gang = None
        requests = self._requests()
        self.workers = [RolloutWorker(pipeline=self.name, step=self.step, rank=r, cost=self.cost,
                                      mem_bytes=self.rollout_mem, graph_config=self.graph_config,
                                      blocking_tools=self.spec.tool.blocking)
                        for r in range(len(self.rollout_devices))]
        for r, chunk in enumerate(_split(requests, weights or (1.0,) * len(self.workers))):
            self.workers[r].add(chunk, t)
            self.workers[r].t = t

    def _requests(self) -> list[Request]:
        w = self.spec
        if not self.tailbatch:
            smp = sample_step(w, self.rng)
            self._round = {"kind": "plain", "group": w.group}
        elif len(self.deferred_scales) >= w.prompts:
            scales = np.array(self.deferred_scales[: w.prompts])
            self.deferred_scales = self.deferred_scales[w.prompts:]
            smp = sample_step(w, self.rng, prompt_scale=scales)
            self._round = {"kind": "long", "group": w.group}
        else:
            n = math.ceil(TAILBATCH_ETA * w.prompts)
            scales = w.lengths.median_tokens * np.exp(self.rng.normal(0.0, w.lengths.prompt_sigma, n))
            wide = _with_group(w, math.ceil(TAILBATCH_ETA * w.group))
            smp = sample_step(wide, self.rng, prompt_scale=scales)
            self._round = {"kind": "short", "group": wide.group, "scales": scales, "done_prompts": [],
                           "finished": {}, "accepted": set()}
        return [Request(rid=i, context=int(smp.prompt_tokens[i]), turns=[int(x) for x in smp.turn_tokens[i]],
                        appended=[int(x) for x in smp.context_tokens[i]], tool_s=[float(x) for x in smp.tool_s[i]])
                for i in range(len(smp.prompt_tokens))]

    # ------------------------------------------------------------ rollout

    def on_completed(self, reqs: list[Request]) -> set[int]:
        """Count completions; under tail batching return the rids to abort now."""
        for r in reqs:
            self.completed[r.rid] = self.completed.get(r.rid, 0) + 1
            if self.completed[r.rid] > 1:
                raise AssertionError(f"{self.name} step {self.step}: sample {r.rid} finished twice")
        if self._round.get("kind") != "short":
            return set()
        return self._race(reqs)

    def _race(self, reqs: list[Request]) -> set[int]:
        rd, w, g = self._round, self.spec, self._round["group"]
        abort: set[int] = set()
        for r in reqs:
            p = r.rid // g
            if p in rd["done_prompts"]:
                continue
            got = rd["finished"].setdefault(p, [])
            got.append(r.rid)
            if len(got) == w.group:  # first R responses: the prompt is done, its others go
                rd["done_prompts"].append(p)
                rd["accepted"].update(got)
                abort.update(p * g + k for k in range(g) if p * g + k not in got)
        if len(rd["done_prompts"]) >= w.prompts:  # enough prompts: stop everything else
            live = {q.rid for wk in self.workers for q in wk._active()}
            abort |= live
            done = set(rd["done_prompts"])
            self.deferred_scales += [float(s) for p, s in enumerate(rd["scales"]) if p not in done]
        return abort

    def trained_samples(self) -> list[Request]:
        reqs = [q for wk in self.workers for q in wk.finished]
        if self._round.get("kind") == "short":
            acc = self._round["accepted"]
            reqs = [q for q in reqs if q.rid in acc]
        return reqs

    def rollout_done(self) -> bool:
        return all(wk.done for wk in self.workers)

    def end_rollout(self, t: float) -> float:
        """Rollout finished at t: the host reward runs; returns its end time."""
        self._stage_s[ROLLOUT] = t - self.t_stage
        last = max(self.workers, key=lambda wk: wk.t)  # the rollout's critical path
        self._stage_s["tool"] = sum(r.duration_s for r in last.tools)
        self.stage, self.t_stage = REWARD, t
        for wk in self.workers:
            self.records.extend(wk.tools)
        n = len(self.trained_samples())
        self.reward_end_s = t + self.spec.reward_s_per_sample * n
        self.records.append(StepRecord(pipeline=self.name, step=self.step, stage=Stage.REWARD, dp_rank=0,
                                       t_start_s=t, t_end_s=self.reward_end_s, num_decode_reqs=n))
        return self.reward_end_s

    # ------------------------------------------------------------ gangs

    def next_gang(self, t: float) -> None:
        """After reward: reference; after reference: training; after training: step done."""
        order = {REWARD: (REFERENCE, SubStageKind.REFERENCE), REFERENCE: (TRAINING, SubStageKind.TRAINING)}
        self._stage_s[self.stage] = t - self.t_stage
        if self.stage in (REFERENCE, TRAINING) and self.gang is not None:
            self._record_gang(self.gang)
        if self.stage == TRAINING:
            self._end_step(t)
            return
        stage, kind = order[self.stage]
        self.stage, self.t_stage = stage, t
        self.gang = self._make_gang(kind)

    def _make_gang(self, kind: SubStageKind) -> Gang:
        samples = self.trained_samples()
        self.lengths.observe(n for wk in self.workers for q in wk.finished for n in q.turns)
        tokens = sum(q.context for q in samples)  # final context = prompt + response (+ tool text)
        ranks = len(self.train_devices)
        gpus = ranks * self.cost.config.rollout_tp  # FSDP ranks: every GPU of every TP group
        per_rank, seqs = tokens / gpus, len(samples) / gpus
        first = self.train_rank0
        excl = self._gang_seconds(kind, per_rank, seqs)
        mem = self.cost.fsdp_mem_bytes(train=kind is SubStageKind.TRAINING)
        ids = tuple(str(SubStageId(self.name, self.step, first + r, kind, 0)) for r in range(ranks))
        return Gang(kind=kind, ids=ids, ranks=tuple(range(first, first + ranks)), devices=self.train_devices,
                    excl_s=excl, tokens_per_rank=per_rank, seqs_per_rank=seqs, mem_bytes=mem, rem_s=excl)

    def _gang_seconds(self, kind: SubStageKind, tokens: float, seqs: float) -> float:
        """Exclusive seconds on one rank, with verl's micro-batches and mini-batch updates."""
        w = self.spec
        if kind is SubStageKind.REFERENCE:
            # verl computes the actor's old log-probs and the reference log-probs: two forwards.
            return 2 * self.cost.reference_s(tokens, math.ceil(seqs / w.logprob_micro_batch_seqs))
        updates = max(1, math.ceil(w.prompts / w.mini_batch_prompts))
        micro = updates * math.ceil(seqs / updates / w.micro_batch_seqs)
        return self.cost.training_s(tokens, micro, updates)

    def _record_gang(self, g: Gang) -> None:
        """One record per rank and constant-rate interval; tokens in proportion to the
        exclusive work done in it."""
        stage = Stage.REFERENCE if g.kind is SubStageKind.REFERENCE else Stage.TRAINING
        for r in g.ranks:
            for t0, t1, slow in g.intervals:
                share = (t1 - t0) / slow / g.excl_s if g.excl_s > 0 else 1.0
                self.records.append(StepRecord(
                    pipeline=self.name, step=self.step, stage=stage, dp_rank=r, t_start_s=t0, t_end_s=t1,
                    num_prefill_tokens=int(g.tokens_per_rank * share),
                    num_decode_reqs=max(1, round(g.seqs_per_rank * share)),
                    mem_bytes=g.mem_bytes, flops=self.cost.flops_per_token * g.tokens_per_rank * share, slowdown=slow))

    def _end_step(self, t: float) -> None:
        samples = self.trained_samples()
        self.lengths.observe(n for wk in self.workers for q in wk.finished for n in q.turns)
        self.metrics.append(StepMetrics(step=self.step, start_s=self._step_start, end_s=t,
                                        tokens=sum(q.context for q in samples), samples=len(samples),
                                        round=self._round.get("kind", "plain"), stage_s=dict(self._stage_s)))
        cols = [c for wk in self.workers if (c := wk.columns()) is not None]
        graph = self.last_graph = self.builder.add_step(self.records, columns=cols)
        self.device_s += graph.total_work_s()
        self.stage = WAITING

    # ------------------------------------------------------------ prediction

    def cold_graph(self) -> SubStageGraph:
        """Before any step has run: a conservative guess from the workload's cap (every response
        at max_tokens, as RollMux's admission does), so a policy has something to plan with."""
        w, c = self.spec, self.cost
        per = w.samples / len(self.rollout_devices)
        steps = w.lengths.max_tokens
        decode_s = steps * c.decode_s(max(1, int(per)), int(per * (w.prompt_tokens + steps / 2)))
        seqs = w.samples / (len(self.train_devices) * c.config.rollout_tp)
        tokens = seqs * (w.prompt_tokens + w.lengths.max_tokens / 2)
        nodes, deps, last = [], {}, []
        for r in range(len(self.rollout_devices)):
            prefill_s = c.prefill_s(int(per * w.prompt_tokens), 0, max(1, int(per)))
            a = self._cold(r, SubStageKind.ROLLOUT_PREFILL, prefill_s, self.rollout_mem)
            b = self._cold(r, SubStageKind.ROLLOUT_TAIL, decode_s, self.rollout_mem)
            nodes += [a, b]
            deps[b.id] = (a.id,)
            last.append(b.id)
        for kind in (SubStageKind.REFERENCE, SubStageKind.TRAINING):
            excl = self._gang_seconds(kind, tokens, seqs)
            layer = [self._cold(self.train_rank0 + r, kind, excl, c.fsdp_mem_bytes(train=kind is SubStageKind.TRAINING))
                     for r in range(len(self.train_devices))]
            for s in layer:
                deps[s.id] = tuple(last)
            nodes += layer
            last = [s.id for s in layer]
        return SubStageGraph(nodes, deps)

    def _cold(self, rank: int, kind: SubStageKind, dur: float, mem: int) -> SubStage:
        return SubStage(id=str(SubStageId(self.name, max(self.step, 0), rank, kind, 0)), pipeline=self.name,
                        step=max(self.step, 0), kind=kind, dp_rank=rank, duration_s=dur, mem_bytes=mem)


def _with_group(w: WorkloadSpec, group: int) -> WorkloadSpec:
    from dataclasses import replace

    return replace(w, group=group)


def _split(requests: list[Request], weights: tuple[float, ...]) -> list[list[Request]]:
    """Contiguous chunks (verl chunks the batch over DP ranks), sized by routing weights."""
    w = np.asarray(weights, dtype=float)
    w = w / w.sum()
    cont = w * len(requests)
    sizes = np.floor(cont).astype(int)
    for i in np.argsort(-(cont - sizes), kind="stable")[: len(requests) - int(sizes.sum())]:
        sizes[i] += 1
    out, k = [], 0
    for n in sizes:
        out.append(requests[k:k + n])
        k += n
    return out
