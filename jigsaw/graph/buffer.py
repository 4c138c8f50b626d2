"""The sample buffer of an asynchronous pipeline: rollout and training joined by batches.

    rollout side                         SampleBuffer(staleness k)                 training side
    batch n may start ── may_generate(n) ◄── version (training steps done)
        generates under weights_for(n) ─► put(n, uids, born) ─► ready(n) ─► take(n)
                                                      trained(n) ◄── the update of step n
                                                          └─► version n + 1 ─► weights to rollout

Training step n trains exactly batch n (first in, first out), so no sample is used twice or
lost by construction, and a batch may only start generating once the weights are at most k
versions behind the step that will train it: `version >= n - k`.  k = 0 is a synchronous
pipeline (batch n waits for step n - 1), k = 1 one-step off-policy (StreamRL; verl's
one_step_off_policy), k >= 1 with interrupted, resumed rollouts fully asynchronous (AReaL).
A sample's staleness is the step that trains it less the version it was born under; the
buffer refuses a take that would pass k, and keeps one `Trained` entry per sample for the
invariant checks (tests) and the trace.

Pure bookkeeping: the simulator's async sides (sim/asynchronous.py) and a live recipe drive
the same object.  `buffer_edges` states the same gate as dependencies between the two sides'
graphs, for the scheduler (node/jobs.py links them in the view) and the graph executor:

    rollout round n's last pieces ─► training step n's first
    training step n's last pieces ─► rollout round n + k + 1's first
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from jigsaw.graph.graph import SubStageGraph

MODES = ("sync", "one-step-off", "fully-async")
"""How a pipeline's rollout and training meet: a step barrier, or a buffer."""

DEFAULT_STALENESS = {"sync": 0, "one-step-off": 1, "fully-async": 2}
"""The staleness bound of each mode when a workload does not state one: one-step off-policy
is one by definition; fully async's is an assumption (AReaL bounds it by a few versions)."""


TRAIN_SUFFIX = ".train"
"""An asynchronous job's training side is the pipeline `<job>.train`; its rollout side keeps
the job's own name (the one `jigsaw run` registers), so a job is never a third, idle pipeline."""


def train_side(job: str) -> str:
    return job + TRAIN_SUFFIX


class StaleSample(RuntimeError):
    """A batch would be trained more than the bound's versions after it was generated."""


@dataclass(frozen=True, slots=True)
class Trained:
    """One sample as trained: its id, the weights it was generated under, the step that took it."""

    uid: int
    born_version: int
    step: int

    @property
    def staleness(self) -> int:
        return self.step - self.born_version


@dataclass
class SampleBuffer:
    """Batches between an asynchronous pipeline's rollout and training (module docstring)."""

    staleness: int
    """Most versions a trained sample's weights may lag the step that trains it."""
    version: int = 0
    """Weight version: training steps finished (what rollouts generate under)."""
    _batches: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    _taken: set[int] = field(default_factory=set)
    _seen: set[int] = field(default_factory=set)
    ledger: list[Trained] = field(default_factory=list)
    """Every sample trained, in order."""
    oldest_weights: int = 0
    """The oldest version a batch may generate under: a run gone on from a checkpoint holds
    only the checkpoint's weights, so its first batches take those (fresher than the bound
    asks, never staler)."""

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise ValueError(f"staleness bound must be >= 0, got {self.staleness}")

    @classmethod
    def resumed(cls, staleness: int, ledger: Iterable[Trained]) -> SampleBuffer:
        """The buffer of a run going on after the steps `ledger` trained (a checkpoint's): at
        the version after the last, with their samples never to be put again.  Batches that
        were generated and not yet trained are not in it: they are generated again."""
        done = list(ledger)
        version = max((t.step for t in done), default=-1) + 1
        if sorted({t.step for t in done}) != list(range(version)):
            raise ValueError(f"a resumed ledger must hold steps 0..{version - 1}, each trained once")
        buf = cls(staleness, version=version, ledger=done, oldest_weights=version)
        buf._taken.update(range(version))
        buf._seen.update(t.uid for t in done)
        return buf

    def may_generate(self, batch: int) -> bool:
        """Whether batch `batch` may start under the current weights."""
        return self.version >= batch - self.staleness

    def weights_for(self, batch: int, newest: bool) -> int:
        """The weight version batch `batch` generates under, once it may start: the newest
        (fully async), or exactly the oldest the bound allows (one-step off-policy: batch n
        under the weights of step n - k, as verl's one_step_off_policy launches batch n + 1
        beside step n's training), so the same run generates under the same weights however
        fast its sides are."""
        if not self.may_generate(batch):
            raise ValueError(f"batch {batch} may not start at weight version {self.version} (bound {self.staleness})")
        return self.version if newest else max(self.oldest_weights, batch - self.staleness)

    def put(self, batch: int, samples: Iterable[tuple[int, int]]) -> None:
        """Batch `batch` is generated: (uid, version it was born under) per sample."""
        got = tuple(samples)
        if batch in self._batches or batch in self._taken:
            raise ValueError(f"batch {batch} was put twice")
        uids = [u for u, _ in got]
        again = self._seen.intersection(uids)
        if again or len(set(uids)) != len(uids):
            raise ValueError(f"batch {batch}: samples {sorted(again)[:5] or uids[:5]} were put before")
        self._seen.update(uids)
        self._batches[batch] = got

    def ready(self, step: int) -> bool:
        return step in self._batches

    def take(self, step: int) -> tuple[tuple[int, int], ...]:
        """Batch `step` for training step `step`; StaleSample if one of its samples is too old."""
        if step != self.version:
            raise ValueError(f"training step {step} taken at weight version {self.version}: steps run in order")
        got = self._batches.pop(step)
        worst = max((step - born for _, born in got), default=0)
        if worst > self.staleness:
            raise StaleSample(f"batch {step} is {worst} versions stale, the bound is {self.staleness}")
        self._taken.add(step)
        self.ledger.extend(Trained(uid, born, step) for uid, born in got)
        return got

    def trained(self, step: int) -> int:
        """Training step `step` finished: the new weight version (what rollouts pick up)."""
        if step != self.version or step not in self._taken:
            raise ValueError(f"training step {step} finished at version {self.version} without taking its batch")
        self.version = step + 1
        return self.version


def buffer_edges(rollout: SubStageGraph, train: SubStageGraph, staleness: int) -> tuple[tuple[str, str], ...]:
    """The buffer as dependencies between an asynchronous job's two graphs: (before, after) ids.

        rollout round n's last pieces ─► training step n's first  (step n trains batch n)
        training step n's last pieces ─► rollout round n + k + 1's first  (its weights: version n + 1)

    Both hold in every mode, so the scheduler never expects a piece before it can run; a
    fully-async round that carries part of its batch into the next completes it a round later
    than the first edge says (graph/buffer.py's SampleBuffer is what enforces it).  Only steps
    both graphs hold are joined: one finished already waits on nothing."""
    roll, trained = _step_ends(rollout), _step_ends(train)
    edges = []
    for n, (firsts, _) in trained.items():
        if n in roll:
            edges.extend((a, b) for a in roll[n][1] for b in firsts)
    for n, (firsts, _) in roll.items():
        if (m := n - staleness - 1) in trained:
            edges.extend((a, b) for a in trained[m][1] for b in firsts)
    return tuple(edges)


def _step_ends(graph: SubStageGraph) -> dict[int, tuple[list[str], list[str]]]:
    """Per step in the graph: (its first sub-stages, its last): none of the step before / after
    them in the graph."""
    out: dict[int, tuple[list[str], list[str]]] = {}
    for s in graph:
        firsts, lasts = out.setdefault(s.step, ([], []))
        if not any(graph[d].step == s.step for d in graph.deps[s.id]):
            firsts.append(s.id)
        if not any(graph[n].step == s.step for n in graph.successors(s.id)):
            lasts.append(s.id)
    return out
