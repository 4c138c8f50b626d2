"""Inputs and output of the scheduler: the only coupling to the runtime and the simulator.

    PipelineState × K  ─┐
    NodeSpec            ├─► schedule(...) ─► Plan ─► runtime grants / simulator events
    SlowdownGrid        │                     assignments  (sub-stage, device, SM, memory)
    SchedulerConfig    ─┘                     migrations, routing weights, micro-batches
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.merge import DecodeFit, MergeConfig
from jigsaw.graph.slo import Deadline, SloForecast


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """Look-ahead scheduler settings (paper §4.4)."""

    window: int = 2
    """W: decisions looked ahead before the leaf is valued (`bound_weight`); 1 is the greedy
    variant of paper Fig. 11.  2 by default: with the bound-blended leaf it is within 3% of
    the exact optimum on average, at half the decision time of W = 3, which gains a few
    tenths of a percent more (bench/scheduler_quality.py has the table)."""
    sm_budgets_frac: tuple[float, ...] | None = None
    """SM shares offered to a sub-stage that joins a running one (which gets the rest); None:
    every partition level of the slowdown grid (the grid owns them).  Must be grid levels."""
    min_pack_efficiency: float = 1.0
    """A sub-stage joins a running partner only if they pack at least this well (best
    1/s_a + 1/s_b in the grid, judged on what each mostly is: a rollout by its longest
    regime); urgent sub-stages are exempt.  1.0 offers every feasible pair and lets the
    look-ahead judge them: with the bound-blended leaf (`bound_weight`) it is 3× closer to
    the exact optimum (2.6% against 8.6% mean gap at W = 2, bench/scheduler_quality.py) than
    JigsawRL §4.2's static filter of complementary pairs at 1.25, which removes tail+tail,
    prefill+decode and reference+training before the search can see them.  In the
    simulator's Fig. 12 runs the filter is still 1–2% ahead (README, "How the scheduler
    decides")."""
    bound_weight: float = 0.3
    """How a leaf of the look-ahead is valued: this weight on the lower bound of the rest
    of the schedule (no piece faster than alone, no device clearing work faster than its
    best pair), the rest on the critical path (`actions.cost`: running work at its present
    pace, ready work queued behind it, no co-location ahead).  The critical path alone is
    blind to the co-locations a state leaves possible, the bound alone to the slowdown a
    partner suffers now (at 0.5 and W = 2 it defers the Fig. 10 decodes that should join
    the training); 0.0 is the paper's critical path.  0.3 is the best weight at W = 2 on
    bench/scheduler_quality.py's instances (0.25: 2.7%, 0.3: 2.6%, 0.5: 2.9% mean gap)."""
    end_game_tasks: int = 12
    """When at most this many device tasks are left, each option of a choice is valued by
    playing the rest of the run out with the look-ahead itself (the makespan it reaches),
    not by the window's leaf: the end game where a long training must hide under another
    pipeline's rollout is decided on the whole remaining schedule.  0: off."""
    end_game_windows: tuple[int, ...] | None = None
    """The look-ahead depths an end-game play-out is played with: an option is valued by the
    earliest makespan any of them reaches deciding every later choice; None: (W, W + 1).
    No depth is best everywhere (W + 1 pairs two first prefills W leaves queued; on three
    pipelines W + 1 is worse as often as better), and the end game is solved once per run
    (`end_game_follow`), so trying both costs one call, not every call."""
    end_game_follow: bool = True
    """A later end-game choice that lies on the line the last play-out chose (the same time
    and choice) takes that line's option instead of playing out again (schedule.EndGame): the
    end game is decided once while the run stays on it.  Off: every end-game choice is played
    out (the plan then depends on this call's inputs alone)."""
    merge: bool = True
    """Consider migrating long-tail rollout requests between DP workers."""
    balance: bool = True
    """Skew collective stages' micro-batches and rollout routing towards workers
    without interference (§2.7)."""
    merge_config: MergeConfig = field(default_factory=MergeConfig)
    """Migration cost parameters."""
    next_step: bool = True
    """Show the scheduler each pipeline's predicted next step behind its step barrier (each
    worker's rollout summarised), so the window can see past the barrier."""
    host_on_device: bool | None = None
    """The pipelines' own processes run on the device's cores (a CPU): a pipeline working
    outside every sub-stage (its Python between them, a host reward, start-up, exit) keeps its
    share of its devices, so a sub-stage alone beside it does not grow into cores in use (two
    threads where one core is busy wait on each other).  Host work that computes and a
    pipeline that sleeps look alike unless the sleep is a tool sub-stage (a running tool
    sub-stage frees the share); turn this off for CPU pipelines that mostly wait on the host
    without saying so.  None: yes when the daemon partitions
    CPU cores (`--partitioner cpu`), no in the simulator (a GPU's host work uses no SMs)."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        depths = self.end_game_windows
        if depths is not None and (not depths or min(depths) < 1):
            raise ValueError(f"end_game_windows must be depths >= 1 (or None: W and W + 1), got {depths}")
        if not 0.0 <= self.bound_weight <= 1.0:
            raise ValueError(f"bound_weight must be in [0, 1], got {self.bound_weight}")
        b = self.sm_budgets_frac
        if b is not None and (not b or any(not 0.0 < x < 1.0 for x in b)):
            raise ValueError(f"sm_budgets_frac must be partition shares in (0, 1), got {b}")

    @property
    def end_game_depths(self) -> tuple[int, ...]:
        """The depths the end game's play-outs are played with (`end_game_windows`), shallowest
        first: its makespan prunes the deeper plays, and its window value breaks ties."""
        given = self.end_game_windows
        return (self.window, self.window + 1) if given is None else tuple(sorted(set(given)))

    def budgets(self, grid) -> tuple[float, ...]:
        """The SM shares to offer under `grid`: the configured ones, or its partition levels."""
        levels = tuple(x for x in grid.sm_levels if x < 1.0)
        return levels if self.sm_budgets_frac is None else self.sm_budgets_frac


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSpec:
    """The devices the co-located pipelines share."""

    num_devices: int
    """Accelerators on the node (GPUs, or CPU partitions)."""
    mem_bytes: int
    """Schedulable memory per device."""

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.mem_bytes <= 0:
            raise ValueError(f"NodeSpec needs num_devices >= 1 and mem_bytes > 0, got {self}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Budget:
    """Share of one device granted to one sub-stage replica."""

    sm_frac: float
    """Fraction of the device's SMs (a green-context partition; 1.0 alone)."""
    mem_frac: float
    """Fraction of the device's schedulable memory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineState:
    """One co-located pipeline as the scheduler sees it at a scheduling point."""

    graph: SubStageGraph
    """Remaining work: the current step's graph (possibly chained with predicted steps)."""
    devices: tuple[int, ...]
    """Device of each DP rank: `devices[r]` hosts rank r."""
    done: frozenset[str] = frozenset()
    """Finished sub-stages."""
    running: Mapping[str, Budget] = field(default_factory=dict)
    """Started sub-stages and the budget each replica holds now."""
    remaining_s: Mapping[str, float] = field(default_factory=dict)
    """Exclusive time left of started sub-stages (default: their whole duration)."""
    urgent: frozenset[str] = frozenset()
    """Ready sub-stages that start now whatever the plan: a rollout worker entering its
    next regime cannot pause, so the scheduler only chooses their budget."""
    aged: frozenset[str] = frozenset()
    """The urgent ones that are urgent because they waited the node's max-wait: a policy
    with an order of its own (serial's turns) starts them too."""
    decode_fit: DecodeFit | None = None
    """The rollout engine's decode step latency against KV tokens, which prices merged
    tails (None: fitted from the graph's last step)."""
    multi_turn: bool = False
    """Its requests come back from tool calls for more turns (known from its history even
    when no tool wait is left in the graph): its tails are never merged."""
    prefill_work: tuple[float, float] | None = None
    """(FLOPs, exclusive seconds) of the pipeline's prefill sub-stages: their MFU prices a
    migration's KV recompute (None: read from the graph's prefill sub-stages)."""
    deadline: Deadline | None = None
    """When its current step must end to keep its slowdown SLO (graph/slo.py); the look-ahead
    keeps every deadline it can before it looks at throughput.  None: no SLO."""
    alone: frozenset[str] = frozenset()
    """Sub-stages that run with nothing beside them, to be measured there (a learning probe,
    node/learning.py).  One that is not urgent waits for its devices to empty; while one waits
    or runs, nothing but urgent pieces starts on its devices."""
    waits_for: tuple[tuple[str, str], ...] = ()
    """(another pipeline's sub-stage, one of this graph's) pairs: the second may not start
    before the first ends.  An asynchronous job's sides wait on each other through their
    sample buffer (graph/buffer.py `buffer_edges`), so the critical path crosses from one to
    the other.  An id missing from its graph (finished) is no wait."""


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a pipeline is in its step, besides its graph (whole-stage baselines order by it)."""

    stage: str
    """rollout | reward | reference | training: the latest stage that asked to run."""
    step: int
    rollout_done_frac: float
    """Share of this step's rollout done: samples when the pipeline reports them (RollMux's
    tail trigger), else exclusive rollout work done over done + left."""
    ready_since_s: float
    """When the current stage first asked to run (HRRS waiting time)."""
    job: str = ""
    """The job the pipeline belongs to ("": itself; else the asynchronous job it is one side of)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Assignment:
    """One sub-stage replica running on one device after the plan takes effect."""

    substage: str
    pipeline: str
    device: int
    sm_frac: float
    """SM partition; the assignments of a device sum to at most 1."""
    mem_bytes: int
    """Memory budget; the assignments of a device sum to at most its capacity."""
    slowdown: float
    """Predicted slowdown of this replica beside its partner (1.0 alone)."""
    micro_batch: int | None = None
    """Balanced per-worker batch for collective stages (None: unchanged)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Migration:
    """Abort the tail requests of `source` and resubmit them on `target` (KV recompute)."""

    pipeline: str
    source: str
    """Sub-stage whose requests leave (it ends when they are gone)."""
    target: str
    """Sub-stage that receives them."""
    source_rank: int
    target_rank: int
    delta_s: float
    """Predicted gain ΔT = T_origin − T_migr."""
    target_remaining_s: float
    """Target's exclusive time left after the merge (aggregated tail + recompute)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Routing:
    """Share of new rollout requests each DP worker of a pipeline should receive."""

    pipeline: str
    weights: tuple[float, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What runs where from `time_s` on; produced by `schedule`, consumed by executors."""

    time_s: float
    started: tuple[str, ...]
    """Sub-stages this plan starts."""
    assignments: tuple[Assignment, ...]
    """Every running replica on every device after the plan (running ones included)."""
    migrations: tuple[Migration, ...] = ()
    routing: tuple[Routing, ...] = ()
    cost_s: float = 0.0
    """Predicted completion of the slowest pipeline (critical path after the window)."""
    decisions: tuple[str, ...] = ()
    """Human-readable actions chosen at this point, for traces and debugging."""
    slo: tuple[SloForecast, ...] = ()
    """Per pipeline with a deadline: the step end this plan predicts, and whether it keeps it."""

    def on_device(self, device: int) -> tuple[Assignment, ...]:
        return tuple(a for a in self.assignments if a.device == device)
