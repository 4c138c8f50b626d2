"""An asynchronous pipeline, simulated as its two sides joined by a sample buffer.

    job "p0-w" (mode one-step-off | fully-async, staleness k)
      RolloutSide "p0-w"  on its rollout devices: step n = generate batch n (+ reward)
          may begin once buffer.may_generate(n) (weights at most k versions behind step n)
          fully-async: a round ends when the batch carried in is done and (1 - carry_frac) of its own
          is; the rest is interrupted and carried into the next round with its partial output,
          and every weight update interrupts the running requests (their KV recomputed)
            └─ finished batches ─► SampleBuffer (graph/buffer.py) ─┐
      TrainSide "p0-w.train"  on its training devices: step n = reference + training of batch n
          may begin once the buffer holds batch n ─► trained(n): weight version n + 1 ────┘

Each side is an ordinary pipeline to the node: it registers (with its job's name), asks for its
pieces and reports them as a live worker of that side would, so every policy plans it with no
special case; the buffer is the only thing they share.  The rollout side's steps carry no
tokens (they are counted once, when trained); the trace records the weight version each
rollout batch generated under and the staleness of each trained one.
"""

from __future__ import annotations

import math

import numpy as np

from jigsaw.graph.buffer import SampleBuffer, train_side
from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.substage import SubStageKind
from jigsaw.sim.pipeline import DONE, REFERENCE, ROLLOUT, PipelineRun
from jigsaw.sim.request import Request
from jigsaw.sim.workload import reward_wall_s


class Coupling:
    """What the two sides of one job share: the buffer, and the generated samples it names."""

    def __init__(self, job: str, staleness: int):
        self.job = job
        self.buffer = SampleBuffer(staleness)
        self.samples: dict[int, list[Request]] = {}
        """Generated batch -> its samples, until trained."""
        self.born: dict[int, int] = {}
        """Batch -> the weight version its rollout began under."""

    def put(self, batch: int, reqs: list[Request]) -> None:
        self.buffer.put(batch, [(q.rid, self.born[batch]) for q in reqs])
        self.samples[batch] = reqs

    def take(self, step: int) -> list[Request]:
        self.buffer.take(step)
        return self.samples.pop(step)


class RolloutSide(PipelineRun):
    """The rollout workers of an asynchronous job (module docstring)."""

    keeps_aborted = True

    def __init__(self, index: int, spec, *, coupling: Coupling, **kw):
        super().__init__(index, spec, name=coupling.job, **kw)
        self.job, self.coupling = coupling.job, coupling
        self.carry: dict[int, list[Request]] = {}
        """Worker -> requests interrupted at a round's end, resumed in the next round."""
        self.rewards: dict[int, float] = {}
        """Sample id -> its reward call's seconds."""
        self.done: dict[int, list[Request]] = {}
        """Batch -> its samples finished so far."""
        self.seen: set[int] = set()
        self._round_open = False

    def may_begin(self) -> bool:
        return self.step + 1 >= self.steps_total or self.coupling.buffer.may_generate(self.step + 1)

    def begin_step(self, t: float, weights: tuple[float, ...] | None = None) -> None:
        super().begin_step(t, weights)
        if self.stage != ROLLOUT:
            return
        self.coupling.born[self.step] = self.coupling.buffer.weights_for(self.step, self.spec.mode == "fully-async")
        for r, reqs in sorted(self.carry.items()):
            self.workers[r].add(reqs, t)
        self.carry, self._round_open = {}, True

    def _requests(self) -> list[Request]:
        """The batch's prompts, numbered across the run (a carried request keeps its id)."""
        reqs = super()._requests()
        base = self.step * self.spec.samples
        for q in reqs:
            self.rewards[base + q.rid] = float(self._reward_s[q.rid])
            q.rid += base
        return reqs

    def on_completed(self, reqs: list[Request]) -> set[int]:
        for q in reqs:
            if q.rid in self.seen:
                raise AssertionError(f"{self.name}: sample {q.rid} finished twice")
            self.seen.add(q.rid)
            self.done.setdefault(q.rid // self.spec.samples, []).append(q)
        return self._round_end() if reqs else set()

    def _round_end(self) -> set[int]:
        """Fully async: once the carried batch is done and (1 - carry_frac) of this one, the rest of
        this one stops here (returned: to abort, then carried); the last round runs to the end."""
        B, tail = self.spec.samples, self.spec.carry_share
        if not self._round_open or tail == 0 or self.step + 1 >= self.steps_total:
            return set()
        if self.step > 0 and len(self.done.get(self.step - 1, ())) < B:
            return set()
        if len(self.done.get(self.step, ())) < math.ceil((1 - tail) * B):
            return set()
        self._round_open = False
        return {q.rid for wk in self.workers for q in wk._active()}

    def aborted(self, rank: int, reqs: list[Request]) -> None:
        self.carry.setdefault(rank, []).extend(reqs)

    def trained_samples(self) -> list[Request]:
        """The samples this round finished (what its reward scores)."""
        return [q for wk in self.workers for q in wk.finished]

    def _reward_time_s(self) -> float:
        r = self.spec.reward
        if r is not None and r.per_batch:
            return float(self._reward_s[0])
        return reward_wall_s(self.spec, np.array([self.rewards[q.rid] for q in self.trained_samples()]))

    def next_gang(self, t: float) -> None:
        """After its reward the round is over: every finished batch goes to the buffer."""
        self._stage_s[self.stage] = t - self.t_stage
        for batch in sorted(self.done):
            if len(self.done[batch]) == self.spec.samples:
                self.coupling.put(batch, sorted(self.done.pop(batch), key=lambda q: q.rid))
        self._end_step(t)

    def counted_samples(self) -> list[Request]:
        return []

    def step_facts(self) -> dict:
        return {"job": self.job, "weights_version": self.coupling.born[self.step],
                "carried": sum(len(v) for v in self.carry.values())}

    def cold_graph(self) -> SubStageGraph:
        nodes, deps, _ = self._cold_rollout()
        return SubStageGraph(nodes, deps)


class TrainSide(PipelineRun):
    """The training workers of an asynchronous job (module docstring)."""

    def __init__(self, index: int, spec, *, coupling: Coupling, rollout: RolloutSide, **kw):
        super().__init__(index, spec, name=train_side(coupling.job), **kw)
        self.job, self.coupling, self.rollout = coupling.job, coupling, rollout
        self.batch: list[Request] = []

    def may_begin(self) -> bool:
        return self.step + 1 >= self.steps_total or self.coupling.buffer.ready(self.step + 1)

    def begin_step(self, t: float, weights: tuple[float, ...] | None = None) -> None:
        """Its batch from the buffer, then straight to the reference stage."""
        self.step += 1
        if self.step >= self.steps_total:
            self.stage = DONE
            return
        self.batch = self.coupling.take(self.step)
        self._step_start, self._stage_s, self.records, self.workers = t, {}, [], []
        self.stage, self.t_stage = REFERENCE, t
        self.gang = self._make_gang(SubStageKind.REFERENCE)

    def trained_samples(self) -> list[Request]:
        return self.batch

    def _end_step(self, t: float) -> None:
        super()._end_step(t)
        self.coupling.buffer.trained(self.step)

    def new_weights(self) -> PipelineRun | None:
        r = self.rollout
        return r if self.spec.mode == "fully-async" and r.stage == ROLLOUT else None

    def step_facts(self) -> dict:
        born = self.coupling.buffer.ledger[-1].born_version if self.batch else self.step
        return {"job": self.job, "weights_version": self.step + 1, "staleness": self.step - born}

    def cold_graph(self) -> SubStageGraph:
        return self._cold_gangs([], {}, [])

