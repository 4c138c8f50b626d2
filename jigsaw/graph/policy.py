"""One policy protocol for every scheduler, live and simulated.

    the node's facts (jigsaw/node/: ledger ─► view) ─► View(time, PipelineStates, Progress,
        node, model) ─► policy.plan(view) ─► Plan ─► the node's applier (node/state.py)

    jigsaw   the windowed look-ahead scheduler with merging and balancing (JigsawRL §4)
    greedy   the same with W = 1 (JigsawRL Fig. 11)
    serial, split, static, muxserve, rollmux, hrrs   the baselines (baselines.py)

`policies.make(name, config)` builds a fresh one: the daemon holds one (`jigsaw daemon
--policy`), every simulation its own.  Policies may keep state between calls (a baseline's
turn, jigsaw's caches); the Plan they return depends only on the views they were given.

Before a run, where the node knows what its pipelines need (the simulator, from its cost
model), it may ask:

    Needs(device memory, per pipeline: devices, bytes per sub-stage kind)
        ─► refusal(policy, needs) ─► policy.refusal(needs) if it has one ─► None: run it
                                                                          └► str: why it cannot
A policy without `refusal` accepts everything (it fails at a plan, if ever, with the reason).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from jigsaw.graph.model import PairModels, SlowdownModel
from jigsaw.graph.placement import SHAPES, Placement, colocated
from jigsaw.graph.plan import NodeSpec, PipelineState, Plan, Progress, SchedulerConfig
from jigsaw.graph.problem import SchedulerCache


@dataclass(frozen=True, slots=True)
class View:
    """Everything a policy decides from."""

    time_s: float
    pipelines: tuple[PipelineState, ...]
    progress: tuple[Progress, ...]
    """Per pipeline, in the same order: where it is in its step (whole-stage baselines)."""
    node: NodeSpec
    model: SlowdownModel
    """The node's slowdown grid (jigsaw.mux.model.slowdown.SlowdownGrid)."""
    pairs: PairModels | None = None
    """Where the pipelines run different models: the exact grid of each ordered pair
    (jigsaw.mux.model.pairing.PairGrids, by pipeline name); None: `model` prices every pair."""
    host_frac: Mapping[int, float] = field(default_factory=dict)
    """Per device, the share of the pipelines placed there that work on the host, outside
    every sub-stage (view.host_frac; what SchedulerConfig.host_on_device keeps free)."""
    waiting: tuple[PipelineState, ...] = ()
    """Sides of asynchronous jobs that ask for nothing yet, each first piece of them waiting
    on a piece of `pipelines` through the job's buffer (PipelineState.waits_for;
    node/jobs.py): what comes once that piece ends, for a policy that looks ahead to count on.
    None of their pieces may be started now; a policy that does not look ahead ignores them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineNeeds:
    """What one pipeline needs of the devices it is placed on."""

    name: str
    rollout_devices: tuple[int, ...]
    train_devices: tuple[int, ...]
    mem_bytes: Mapping[str, int]
    """The least memory of one device each sub-stage kind (a SubStageKind value) must hold
    to run: reference and training their sharded state and micro-batch, a rollout engine its
    weights, its reserve and the KV of one response at the cap."""
    mode: str = "sync"
    """How its rollout and training meet (graph/buffer.py MODES); an asynchronous job's two
    sides each say its mode."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Needs:
    """What a node's pipelines need, known before a run (module docstring)."""

    device_mem_bytes: int
    pipelines: tuple[PipelineNeeds, ...]


class Policy(Protocol):
    """A scheduling policy: the daemon and the simulator call it at every decision point."""

    name: str
    separable: bool
    """Its plan for pipelines that share no device is the plans of each group on its own
    (a pure function of the view): the node then plans each group apart, in less time, and
    a failure of one group's plan leaves the others' alone.  False for policies that keep
    node-wide turns (serial) or order whole stages across the node."""

    def plan(self, view: View) -> Plan: ...

    def placement(self, k: int, devices: int) -> list[Placement]:
        """Where k pipelines go on a node of `devices` (the simulator's placement)."""
        ...

    # Optional, not declared here so that a policy without them still is a Policy:
    #     def refusal(self, needs: Needs) -> str | None
    # why this policy cannot run pipelines that need `needs` (None: it can); see `refusal`.
    #     shapes: tuple[str, ...]
    # the placement shapes (graph/placement.py) it runs on, its own `placement` first: the
    # simulator may try each and keep the fastest (sim/placement.py); a baseline has none,
    # its placement is part of what it is.


def refusal(policy: Policy, needs: Needs) -> str | None:
    """Why `policy` cannot run pipelines with these needs, or None; a policy without a
    `refusal` method accepts everything."""
    ask = getattr(policy, "refusal", None)
    return None if ask is None else ask(needs)


@dataclass
class Jigsaw:
    """The look-ahead scheduler (W = 2 by default, merging, balancing); W = 1 is `greedy`."""

    name: str = "jigsaw"
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    separable: bool = True
    cache: SchedulerCache | None = None
    """The scheduler's tables for this node, made on first use and owned by this policy
    instance."""
    end_game: Any = None
    """The line its last end-game play-out chose (schedule.EndGame), made on first use."""
    shapes: tuple[str, ...] = tuple(SHAPES)
    """The placements it runs on (graph/placement.py), colocated first: what it does when the
    simulator is not asked to choose (and where live pipelines share every device)."""

    def placement(self, k: int, devices: int) -> list[Placement]:
        return colocated(k, devices)

    def plan(self, view: View) -> Plan:
        from jigsaw.graph.schedule import EndGame, schedule

        if self.cache is None:
            self.cache = SchedulerCache()
        if self.end_game is None and self.config.end_game_follow:
            self.end_game = EndGame()
        return schedule(view.pipelines + view.waiting, view.node, view.model, self.config, view.time_s,
                        cache=self.cache, pairs=view.pairs, host_frac=view.host_frac, end_game=self.end_game)
