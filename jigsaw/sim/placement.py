"""Which placement a policy that runs on several is simulated on: each shape, tried for a few
steps on samples of its own, the fastest kept.

    SimConfig(placement="auto", policy=jigsaw)
        ─► for each shape of policy.shapes (graph/placement.py) that places the pipelines
           differently from an earlier one (and leaves a pipeline with an SLO every device):
               simulate(placement=shape, steps=placement_trial_steps, seed=trial seed)
               ─► makespan, or Infeasible and why
        ─► Choice(shape with the least makespan, every trial)        (ties: the earlier shape;
           a shape that shares devices must beat split, which shares none, by
           placement_min_gain_frac: a smaller gain is within the slowdown model's error)
        ─► a sharing shape ahead of split by less than placement_confirm_frac: both tried
           again on a second trial seed, kept by the least gain over the two trials' sum
        ─► jigsaw, on a kept shape that shares devices: each of `trial_windows` (W = 1:
           greedy) tried on the same trial samples, kept over the scheduler's own window
           if faster by `trial_window_min_gain_frac`
        ─► simulate() runs the whole run on that shape (and window) and reports the choice

A trial stops once its simulated time passes the best makespan so far (and the least gain):
it could no longer be chosen.  The trials draw their samples from a seed no run uses, so the
choice sees what the workloads describe (their length distributions, tools, models), as a
user choosing a placement before a run would, never the run's own draws.  The same
scheduler and cost model decide every trial: there is no second model of what a placement
costs.  Where no shape can hold the
pipelines, the run is Infeasible with each shape's reason.

The window is chosen like the shape (issue 32): the look-ahead's depth is the one setting of
the scheduler whose best value depends on the workload (a 32B SWE-agent pair, whose training
never runs beside a rollout, ends 2-5% later at W = 2 than at W = 1 on every seed tried), and
the trial that measures a shape measures a window as well, on the same samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from jigsaw.graph.placement import distinct
from jigsaw.graph.policies import make
from jigsaw.sim.node import Cut, Infeasible

TRIAL_SEED = 1_000_000
"""Added to the run's seed for the trials: pipeline seeds are seed × 1000 + i, so trial
samples never coincide with those of a run of any seed below it."""
CONFIRM_SEED = 2_000_000
"""Added to the run's seed for a close choice's second trial (placement_confirm_frac)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    shape: str
    makespan_s: float | None
    """Of the trial's steps; None where the shape could not run them or was cut."""
    why: str = ""
    """Why the shape could not run (Infeasible), else empty."""
    cut_s: float | None = None
    """The trial was stopped there: past the best trial's makespan (and the least gain),
    it could no longer be chosen."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    shape: str
    """The shape the run is simulated on."""
    trials: tuple[Trial, ...]
    confirm: tuple[Trial, ...] = ()
    """The second trials of a close choice (the sharing shape and split), if it was close."""
    window: int | None = None
    """The look-ahead window the run uses, where a trial chose another than the scheduler's."""
    window_trials: tuple[tuple[int, Trial], ...] = ()
    """(window, its trial on the kept shape) of each other window tried."""

    def summary(self) -> str:
        """One line: the shape kept and each trial's makespan."""
        tried = ", ".join(f"{t.shape} {t.makespan_s:,.1f} s" if t.makespan_s is not None else
                          f"{t.shape} > {t.cut_s:,.1f} s (cut)" if t.cut_s is not None else f"{t.shape} n/a"
                          for t in self.trials)
        again = ", ".join(f"{t.shape} {t.makespan_s:,.1f} s" for t in self.confirm if t.makespan_s is not None)
        windows = ", ".join(f"W = {w} {t.makespan_s:,.1f} s" if t.makespan_s is not None else
                            f"W = {w} > {t.cut_s:,.1f} s (cut)" for w, t in self.window_trials)
        return (f"placed {self.shape}" + (f", window {self.window}" if self.window else "") + f" (trials: {tried}"
                + (f"; again on other samples: {again}" if again else "")
                + (f"; {self.shape} at other windows: {windows}" if windows else "") + ")")


def choose(config: Any, *, pipelines: int, devices: int, simulate: Callable[..., Any],
           asynchronous: bool = False) -> Choice:
    """The fastest shape of `config.policy` (a sim.run.SimConfig) for its `pipelines` on
    `devices` scheduling devices, each tried with `simulate`, then the window on it (module
    docstring); `crossed` only where a pipeline is `asynchronous`."""
    choice = _shape(config, pipelines=pipelines, devices=devices, simulate=simulate, asynchronous=asynchronous)
    return _window(config, choice, simulate)


def _shape(config: Any, *, pipelines: int, devices: int, simulate: Callable[..., Any],
           asynchronous: bool) -> Choice:
    pol = make(config.policy, config.sched)
    trial_cfg = _trial_config(config)
    trials: list[Trial] = []
    shapes = tuple(s for s in pol.shapes if asynchronous or s != "crossed")
    for name, placed in distinct(shapes, pipelines, devices).items():
        if isinstance(placed, str):  # the shape cannot hold them on this node
            trials.append(Trial(shape=name, makespan_s=None, why=placed))
            continue
        if (why := _short_of_slo(config, placed, devices)) is not None:
            trials.append(Trial(shape=name, makespan_s=None, why=why))
            continue
        ran = [t.makespan_s for t in trials if t.makespan_s is not None]
        # split runs on where a close choice will want its whole trial
        margin = max(config.placement_min_gain_frac, config.placement_confirm_frac if name == "split" else 0.0)
        cut_s = min(ran) * (1.0 + margin) if ran else None
        try:
            res = simulate(replace(trial_cfg, placement=name), until_s=cut_s, measure_slo=False)
        except Infeasible as exc:
            trials.append(Trial(shape=name, makespan_s=None, why=str(exc)))
            continue
        except Cut:
            trials.append(Trial(shape=name, makespan_s=None, cut_s=cut_s))
            continue
        trials.append(Trial(shape=name, makespan_s=res.makespan_s))
    ran = [t for t in trials if t.makespan_s is not None]
    if not ran:
        raise Infeasible(f"{pol.name}: no placement holds these pipelines: "
                         + "; ".join(f"{t.shape}: {t.why}" for t in trials))
    first = _fastest(ran, config.placement_min_gain_frac)
    if not _close(ran, first, config.placement_confirm_frac):
        return Choice(shape=first, trials=tuple(trials))
    again = replace(trial_cfg, seed=CONFIRM_SEED + config.seed)
    try:
        confirm = tuple(Trial(shape=name, makespan_s=simulate(replace(again, placement=name),
                                                              measure_slo=False).makespan_s)
                        for name in (first, "split"))
    except Infeasible:  # other samples the shape cannot hold: the first trial decides
        return Choice(shape=first, trials=tuple(trials))
    return Choice(shape=_fastest(_summed(ran, confirm), config.placement_min_gain_frac), trials=tuple(trials),
                  confirm=confirm)


def _trial_config(config: Any) -> Any:
    """`config` as a trial runs it: its first steps, on the trial seed's samples, untraced."""
    return replace(config, steps=min(config.steps, config.placement_trial_steps), seed=TRIAL_SEED + config.seed,
                   trace=False)


def _window(config: Any, choice: Choice, simulate: Callable[..., Any]) -> Choice:
    """`choice` with the window of the fastest trial on its shape: each of
    `config.trial_windows` other than the scheduler's own, kept only if it beats the shape's
    trial (same samples) by `config.trial_window_min_gain_frac`.  jigsaw only: greedy is
    W = 1 by definition, the baselines have no window.  Not on split: with no device shared
    there is no co-location to look ahead to (W = 1 and W = 2 made the same run there on each
    of four workloads tried, multi-turn ones included)."""
    others = [w for w in dict.fromkeys(config.trial_windows) if w != config.sched.window]
    if make(config.policy, config.sched).name != "jigsaw" or not others or choice.shape == "split":
        return choice
    base = next(t.makespan_s for t in choice.trials if t.shape == choice.shape)
    trial_cfg = replace(_trial_config(config), placement=choice.shape)
    gain = 1.0 + config.trial_window_min_gain_frac
    best, best_s, tried = None, base, []
    for w in others:
        cut_s = best_s / gain  # past it, this window can no longer be kept
        try:
            res = simulate(replace(trial_cfg, sched=replace(config.sched, window=w)), until_s=cut_s,
                           measure_slo=False)
        except Cut:
            tried.append((w, Trial(shape=choice.shape, makespan_s=None, cut_s=cut_s)))
            continue
        tried.append((w, Trial(shape=choice.shape, makespan_s=res.makespan_s)))
        if res.makespan_s * gain <= best_s:
            best, best_s = w, res.makespan_s
    return replace(choice, window=best, window_trials=tuple(tried))


def _close(ran: list[Trial], first: str, confirm_frac: float) -> bool:
    """Is the shape chosen one that shares devices, ahead of split by less than `confirm_frac`?"""
    unshared = next((t for t in ran if t.shape == "split"), None)
    best = next(t for t in ran if t.shape == first)
    return unshared is not None and first != "split" and best.makespan_s * (1.0 + confirm_frac) > unshared.makespan_s


def _summed(ran: list[Trial], confirm: tuple[Trial, ...]) -> list[Trial]:
    """The confirmed shapes' trials, each the sum of its two."""
    first = {t.shape: t.makespan_s for t in ran}
    return [Trial(shape=t.shape, makespan_s=first[t.shape] + t.makespan_s) for t in confirm]


def _short_of_slo(config: Any, placed: list, devices: int) -> str | None:
    """Why a shape cannot hold a pipeline to its SLO: it gives it fewer devices than the node
    has.  Its SLO is against its step alone with the devices it would have (every device: a
    job keeps its GPUs), and the step clock measures against the devices it runs on, blind
    to a shape that halves them."""
    every = tuple(range(devices))
    short = [i for i, (roll, train) in enumerate(placed)
             if config.slo_of(i) is not None and (tuple(sorted(roll)) != every or tuple(sorted(train)) != every)]
    if not short:
        return None
    return f"gives pipeline(s) {short} with an SLO fewer than the node's {devices} devices"


def _fastest(ran: list[Trial], min_gain_frac: float) -> str:
    """The shape of the shortest trial (the first of equals, in shape order), unless split
    (nothing shared) ran and the shortest is not at least `min_gain_frac` shorter."""
    best = min(ran, key=lambda t: t.makespan_s)
    unshared = next((t for t in ran if t.shape == "split"), None)
    if unshared is not None and best.makespan_s * (1.0 + min_gain_frac) > unshared.makespan_s:
        return unshared.shape
    return best.shape
