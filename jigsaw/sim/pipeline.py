"""One simulated RL pipeline: its steps, stages, workers and records.

    begin_step ─► samples (workload) ─► dispatch to DP workers (routing weights)
        ROLLOUT   RolloutWorker per rank (rollout.py), started when the policy admits them
        REWARD    host, the samples' reward times (workload [reward], cut at its timeout)
        REFERENCE Gang: actor old log-probs + reference log-probs (two forward passes, verl)
        TRAINING  Gang: forward, recompute, backward, optimizer share
                  both priced from the trained samples' sequence lengths: dealt to the FSDP
                  ranks (verl's balance_batch) ─► each rank's micro-batches (StepCost:
                  attention ∝ ΣL² per micro-batch) ─► the slowest rank (lockstep)
    end_step  ─► records + columns ─► GraphBuilder ─► the step's graph (its true work; the node
                  assembles its own from what the workers' clients report, as live)

A Gang's replicas run in lockstep: it progresses at the balanced rate Σ(1/s_d)/n when the
plan skews micro-batches (jigsaw), else at 1/max(s_d) (verl's equal split).

Dynamic sampling (DAPO) generates batches of `prompts` prompts until enough pass the group
filter (the batches of one step run as one rollout) and trains on the first `prompts` that
pass; ppo_epochs repeats the training pass.
A trajectory past trajectory_timeout_s is cut where it is (rollout.py).

Tail batching (RollPacker §3): short rounds launch ⌈ηP⌉ prompts × ⌈ηR⌉ responses, keep the
first R responses of the first P prompts to finish them and defer the others' prompts;
once P prompts are deferred, a long round runs them without speculation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from jigsaw.graph.builder import GraphBuilder, GraphConfig
from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.ids import SubStageId
from jigsaw.graph.substage import Stage, StepRecord, SubStage, SubStageKind
from jigsaw.mux.model.costmodel import StepCost
from jigsaw.sim.request import Request
from jigsaw.sim.rollout import RolloutWorker
from jigsaw.sim.workload import WorkloadSpec, prompt_scales, reward_wall_s, sample_step

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
                 graph_config: GraphConfig = GraphConfig(), kv_pool_tokens: int | None = None,
                 slo_slowdown: float | None = None):
        self.index, self.spec, self.name, self.steps_total = index, spec, name, steps
        self.slo_slowdown = slo_slowdown
        """Its steps may take at most this × their exclusive time (registered with the node)."""
        self.device_mem_bytes = cost.device.mem_bytes
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
        self.last_graph: SubStageGraph | None = None
        """The builder's graph of the last finished step (the ground truth of its work: the
        lower bound's device-seconds; the node learns the step from its clients' reports)."""
        self._stage_s: dict[str, float] = {}
        self._step_start = 0.0
        self._reward_s = np.zeros(0)

    def _default_pool(self) -> int:
        """KV pool for every sample of a worker at twice the median response, at most what the
        device holds beside the weights and the reserve (an engine sizes its pool from free
        memory).  The paper resizes the pool from recent peaks every ~30 steps; a pool too
        small for the batch makes the engine queue and retract (rollout.py)."""
        w = self.spec
        per_worker = math.ceil(w.samples * (TAILBATCH_ETA**2 if self.tailbatch else 1) / len(self.rollout_devices))
        c = self.cost
        fits = (self.device_mem_bytes - c.weights_bytes() - c.config.rollout_reserve_bytes) // c.kv_bytes_per_token()
        return int(max(0, min(per_worker * (w.prompt_tokens + 2 * w.lengths.median_tokens), fits)))

    # ------------------------------------------------------------ steps

    @property
    def finished_all(self) -> bool:
        return self.stage == DONE

    # What an asynchronous side (sim/asynchronous.py) changes; a whole pipeline is its own job.
    job = ""
    """The asynchronous job this run is one side of ("": a job of its own)."""
    keeps_aborted = False
    """Requests aborted mid-step come back to `aborted` (a fully async round's tail) instead of
    being dropped (tail batching's surplus)."""

    def may_begin(self) -> bool:
        """Whether its next step may begin now (a whole pipeline: always, after its last)."""
        return True

    def aborted(self, rank: int, reqs: list[Request]) -> None:
        """Requests aborted on worker `rank` (only called when `keeps_aborted`)."""

    def new_weights(self) -> PipelineRun | None:
        """The run whose running rollout picks up the weights a step just published (fully
        async: interrupted and resumed with its partial output), if any."""
        return None

    def step_facts(self) -> dict:
        """What the trace records of its finished step besides its times and tokens."""
        return {}

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
        requests, n = self._requests(), len(self.rollout_devices)
        cores = self.spec.tool.cores
        self.workers = [RolloutWorker(pipeline=self.name, step=self.step, rank=r, cost=self.cost,
                                      mem_bytes=self.rollout_mem, graph_config=self.graph_config,
                                      blocking_tools=self.spec.tool.blocking,
                                      max_new_tokens=self.spec.lengths.max_tokens,
                                      deadline_s=t + self.spec.trajectory_timeout_s if self.spec.trajectory_timeout_s
                                      else None, tool_cores=max(1, cores // n) if cores else 0)
                        for r in range(n)]
        for r, chunk in enumerate(_split(requests, weights or (1.0,) * len(self.workers))):
            self.workers[r].add(chunk, t)
            self.workers[r].t = t

    def _requests(self) -> list[Request]:
        w, step = self.spec, self.step
        if not self.tailbatch:
            batches, kept = self._filter()
            n = batches * (w.gen_prompts or w.prompts)
            smp = sample_step(w if n == w.prompts else replace(w, prompts=n), self.rng, step=step)
            self._round = {"kind": "plain", "group": w.group, **kept}
        elif len(self.deferred_scales) >= w.prompts:
            scales = np.array(self.deferred_scales[: w.prompts])
            self.deferred_scales = self.deferred_scales[w.prompts:]
            smp = sample_step(w, self.rng, prompt_scale=scales, step=step)
            self._round = {"kind": "long", "group": w.group}
        else:
            n = math.ceil(TAILBATCH_ETA * w.prompts)
            scales = prompt_scales(w, self.rng, n)
            wide = _with_group(w, math.ceil(TAILBATCH_ETA * w.group))
            smp = sample_step(wide, self.rng, prompt_scale=scales, step=step)
            self._round = {"kind": "short", "group": wide.group, "scales": scales,
                           **_accepted(smp.turn_tokens, wide.group, w.group, w.prompts)}
        self._reward_s = smp.reward_s
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
        """The accepted responses were fixed from their lengths (`_accepted`); a prompt whose
        accepted responses are all done aborts its others, and the round stops once every
        accepted response is done."""
        rd, g = self._round, self._round["group"]
        abort: set[int] = set()
        for r in reqs:
            p = r.rid // g
            left = rd["left"].get(p)
            if left is None or r.rid not in left:
                continue
            left.discard(r.rid)
            if not left:
                abort.update(p * g + k for k in range(g) if p * g + k not in rd["accepted"])
        if rd["left"] and not any(rd["left"].values()):
            rd["left"] = {}
            abort |= {q.rid for wk in self.workers for q in wk._active()}
            kept = {rid // g for rid in rd["accepted"]}
            self.deferred_scales += [float(s) for p, s in enumerate(rd["scales"]) if p not in kept]
        return abort

    def _filter(self) -> tuple[int, dict]:
        """Dynamic sampling (DAPO): generation rounds of `gen_prompts` prompts (default: the
        training batch) until `prompts` of them pass the group filter (probability keep_frac
        each, from the pipeline's own generator, so every policy keeps the same), at most
        max_gen_batches; the first `prompts` that pass are trained on.  Without it: one batch,
        every prompt."""
        ds, w = self.spec.dynamic_sampling, self.spec
        if ds is None:
            return 1, {}
        per = w.gen_prompts or w.prompts
        passed = np.flatnonzero(self.rng.random(ds.max_gen_batches * per) < ds.keep_frac)
        need = int(passed[w.prompts - 1]) + 1 if len(passed) >= w.prompts else ds.max_gen_batches * per
        batches = math.ceil(need / per)
        kept = passed[passed < batches * per][: w.prompts]
        return batches, {"accepted": {p * w.group + k for p in kept.tolist() for k in range(w.group)}}

    def trained_samples(self) -> list[Request]:
        reqs = [q for wk in self.workers for q in wk.finished]
        if "accepted" in self._round:
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
        self.reward_end_s = t + self._reward_time_s()
        self.records.append(StepRecord(pipeline=self.name, step=self.step, stage=Stage.REWARD, dp_rank=0,
                                       t_start_s=t, t_end_s=self.reward_end_s, num_decode_reqs=n))
        return self.reward_end_s

    def _reward_time_s(self) -> float:
        """Host reward of the generated samples on the workload's reward workers (one after
        another by default, as verl's reward manager); one call for the whole batch when the
        workload says so.  Each already cut at its timeout."""
        r = self._reward_s
        if len(r) == 1 and self.spec.reward is not None and self.spec.reward.per_batch:
            return float(r[0])
        # Dynamic sampling scores every generated sample (that is its filter); otherwise the
        # samples trained on (tail batching's accepted ones).
        every = self.spec.dynamic_sampling is not None
        done = [q.rid for q in ([q for wk in self.workers for q in wk.finished] if every else self.trained_samples())]
        return reward_wall_s(self.spec, r[done])

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
        # final context = prompt + response (+ tool text): the sequence trained on
        lengths = np.array([q.context for q in samples], dtype=float)
        ranks = len(self.train_devices)
        gpus = ranks * self.cost.gpus_per_device  # FSDP ranks: every GPU of every scheduling device
        per_rank, seqs = float(lengths.sum()) / gpus, len(samples) / gpus
        first = self.train_rank0
        # FSDP ranks meet in every micro-batch's collectives: the slowest rank sets the pace.
        excl = max(self._gang_seconds(kind, rank) for rank in _deal_to_ranks(lengths, gpus))
        mem = self.cost.fsdp_mem_bytes(train=kind is SubStageKind.TRAINING)
        ids = tuple(str(SubStageId(self.name, self.step, first + r, kind, 0)) for r in range(ranks))
        return Gang(kind=kind, ids=ids, ranks=tuple(range(first, first + ranks)), devices=self.train_devices,
                    excl_s=excl, tokens_per_rank=per_rank, seqs_per_rank=seqs, mem_bytes=mem, rem_s=excl)

    def _gang_seconds(self, kind: SubStageKind, seq_tokens: np.ndarray) -> float:
        """Exclusive seconds on one rank holding sequences of `seq_tokens` (batch order), with
        verl's micro-batches and mini-batch updates."""
        w, seqs = self.spec, len(seq_tokens)
        if kind is SubStageKind.REFERENCE:
            # verl computes the actor's old log-probs and the reference log-probs: two forwards.
            return 2 * self.cost.reference_s(seq_tokens, math.ceil(seqs / w.logprob_micro_batch_seqs))
        updates = max(1, math.ceil(w.prompts / w.mini_batch_prompts))
        micro = updates * math.ceil(seqs / updates / w.micro_batch_seqs)
        # every epoch passes over the whole batch again
        return w.ppo_epochs * self.cost.training_s(seq_tokens, micro, updates)

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

    def counted_samples(self) -> list[Request]:
        """The samples its step counts as trained (an asynchronous rollout side's: none, they
        count once, on the training side)."""
        return self.trained_samples()

    def _end_step(self, t: float) -> None:
        samples = self.counted_samples()
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
        nodes, deps, last = self._cold_rollout()
        return self._cold_gangs(nodes, deps, last)

    def _cold_rollout(self) -> tuple[list[SubStage], dict, list[str]]:
        """Each worker's prefill and tail at the cap: (nodes, deps, the last of each worker)."""
        w, c = self.spec, self.cost
        per = w.samples / len(self.rollout_devices)
        steps = w.lengths.max_tokens
        decode_s = steps * c.decode_s(max(1, int(per)), int(per * (w.prompt_tokens + steps / 2)))
        nodes, deps, last = [], {}, []
        for r in range(len(self.rollout_devices)):
            prefill_s = c.prefill_s(int(per * w.prompt_tokens), 0, max(1, int(per)))
            a = self._cold(r, SubStageKind.ROLLOUT_PREFILL, prefill_s, self.rollout_mem)
            b = self._cold(r, SubStageKind.ROLLOUT_TAIL, decode_s, self.rollout_mem)
            nodes += [a, b]
            deps[b.id] = (a.id,)
            last.append(b.id)
        return nodes, deps, last

    def _cold_gangs(self, nodes: list[SubStage], deps: dict, last: list[str]) -> SubStageGraph:
        """Reference and training at the cap's mean length, after `last`."""
        w, c = self.spec, self.cost
        seqs = math.ceil(w.samples / (len(self.train_devices) * c.gpus_per_device))
        lengths = np.full(seqs, w.prompt_tokens + w.lengths.max_tokens / 2)
        for kind in (SubStageKind.REFERENCE, SubStageKind.TRAINING):
            excl = self._gang_seconds(kind, lengths)
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


def _accepted(turn_tokens: list, wide_group: int, group: int, prompts: int) -> dict:
    """Which responses a short round keeps: RollPacker keeps the first `group` responses of the
    first `prompts` prompts to finish; the simulator ranks them by length instead of by finish
    time, so every policy trains the same samples (finish order also depends on the policy)."""
    n = len(turn_tokens) // wide_group
    length = [int(np.sum(t)) for t in turn_tokens]
    best = {p: sorted(range(p * wide_group, (p + 1) * wide_group), key=lambda i: (length[i], i))[:group]
            for p in range(n)}
    kept = sorted(best, key=lambda p: (length[best[p][-1]], p))[:prompts]
    accepted = {i for p in kept for i in best[p]}
    return {"accepted": accepted, "left": {p: set(best[p]) for p in kept}}


def _deal_to_ranks(lengths: np.ndarray, ranks: int) -> list[np.ndarray]:
    """Sequence lengths of each of `ranks` FSDP ranks as verl's balance_batch leaves them:
    equal counts, near-equal tokens (longest first, dealt back and forth), each rank's
    samples in batch order (its micro-batches are consecutive runs of them)."""
    order = np.argsort(-lengths, kind="stable")
    lap = np.arange(len(order)) % (2 * ranks)
    rank = np.where(lap < ranks, lap, 2 * ranks - 1 - lap)
    return [lengths[np.sort(order[rank == r])] for r in range(ranks)]


def _with_group(w: WorkloadSpec, group: int) -> WorkloadSpec:
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
