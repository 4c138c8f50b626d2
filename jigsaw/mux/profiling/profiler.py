"""Offline slowdown-grid measurement (`jigsaw profile`), independent of the device.

    ProfileConfig ─► Bench (device side: cuda_bench.py, cpu_bench.py)
        │   base[k]       = time per token of k alone, whole device, top memory level
        │   alone[k][σ,m] = bench.alone(k, σ, m) / base[k]
        │   pair(a,b,σ,m) = bench.pair(a, b, σ, m)  ─► a's and b's time per token side by side,
        │                   a on σ of the SMs and m of the memory, b on the rest
        │                   (σ = 1.0: no partition, both share every SM)
        ▼
    measure_grid() ─► SlowdownGrid in the core library's format (source "measured"),
                      both views of every point from one measurement (the file's symmetry rule)

Each unordered pair of kinds is measured once per (σ, m): the partner's view of the point
(b, a, 1−σ, 1−m) is the same run, so a file never disagrees with itself.  Measurements are
kept as measured: a slowdown under 1.0 (faster than alone on the whole device) can only be
noise, so such a point is measured again (`repeats` in all) and the median kept; the base
times are medians of `repeats` runs.  A repeat is paired: the base is measured again right
before it and the point divided by that, so a load spike that inflated the first base (and
made every point of its kind look faster) cancels instead of being kept.  The grid's source
says how many points were repeated, their relative spread (overall and per kind), and how
many stayed under 1.0; jigsaw.mux.model.validate reads it.
A point that stays under the noise floor even so was not measured but disturbed (a CPU
"device" shared with other jobs runs a one-core split many times faster than the whole,
whose threads wait for each other): `MeasurementError` says which and why, and no grid
is written.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from jigsaw.mux.model.slowdown import (
    DEFAULT_MEM_LEVELS,
    DEFAULT_SM_LEVELS,
    FORMAT,
    NOISE_FLOOR,
    VERSION,
    DeviceInfo,
    SlowdownGrid,
)
from jigsaw.mux.model.specs import PriorConfig

DEVICE_KINDS = ("rollout_prefill", "rollout_decode", "rollout_tail", "reference", "training")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileConfig:
    """What `jigsaw profile` measures."""

    device: str = "cuda"
    """cuda (green-context partitions on one GPU) | cpu (core sets of this machine, the recipe's
    model; writes <user profile dir>/cpu/)."""
    gpu: int = 0
    """CUDA device index."""
    cores: tuple[int, ...] | None = None
    """cpu: the cores that make the device (default: every core this process may use).  One
    core profiles a device per core (`jigsaw daemon --devices` = the cores), whose pairs
    time-share it."""
    model: str | None = None
    """cuda: a name in jigsaw.mux.model.specs.MODELS or the path of an HF config.json (default
    qwen3-0.6b); cpu: the recipe's model, tiny-qwen3 (default) or smollm2-135m."""
    out: Path | None = None
    """Output file; if unset, <user profile dir>/<sku>/<model>.json, never a shipped grid; see
    jigsaw.profiles.user_dir: $JIGSAW_PROFILE_DIR, else $XDG_DATA_HOME/jigsaw/profiles.  A
    shipped grid is overwritten only when named here."""
    check: str | None = None
    """Measure nothing: validate an existing grid (a file, or a name like cpu/tiny-qwen3) and
    exit 1 if it is degenerate, 0 otherwise (see jigsaw.mux.model.validate)."""
    calibrate: tuple[Path, ...] | None = None
    """Measure nothing: ALONE SHARED [ALONE SHARED ...], pairs of daemon traces of the same
    pipelines and seeds, one run under `--policy serial` (every sub-stage alone), one under
    `--policy static` or `jigsaw` (on partitions).  Scales the grid the shared runs used, per
    kind, to what the pipelines really did on a partition (jigsaw.sim.calibrate) and writes it
    like a measurement (`jigsaw demo --modes serial-live static-live` makes such traces)."""
    layers: int = 4
    """Decoder layers instantiated: slowdowns are ratios of time per token and every layer has
    the same shape, so a few stand for the model while bounding memory and time."""
    min_time_s: float = 0.3
    """Time each measurement runs for (after one warm-up iteration)."""
    repeats: int = 3
    """Runs of a base time, and of a point that came out faster than alone (noise); the
    median is kept and the spread recorded in the grid's source."""
    shapes: PriorConfig = field(default_factory=PriorConfig)
    """Batch shapes of the sub-stage kernels (the analytic prior's, so the two compare)."""


class Bench(Protocol):
    device_info: DeviceInfo

    def alone(self, kind: str, sm_frac: float, mem_frac: float) -> float:
        """Seconds per token of `kind` alone on σ of the device (and m of the memory)."""
        ...

    def pair(self, kind_a: str, kind_b: str, sm_frac_a: float, mem_frac_a: float) -> tuple[float, float]:
        """Seconds per token of a and of b while both run: a on (σ, m), b on the rest."""
        ...


def measure_grid(bench: Bench, model: str, *, sm_levels=DEFAULT_SM_LEVELS, mem_levels=DEFAULT_MEM_LEVELS,
                 kinds=DEVICE_KINDS, progress: Callable[[str], None] = lambda _: None, note: str = "",
                 repeats: int = 3) -> SlowdownGrid:
    """Every alone and pair point of the grid, normalised by each kind's exclusive time."""
    _check_levels(mem_levels)
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    top = mem_levels[-1]
    noise = _Noise(repeats, alone=lambda k: bench.alone(k, 1.0, top))
    noise.measure_bases(kinds)
    alone = {k: [[noise.ratio(lambda k=k, s=s, m=m: (bench.alone(k, s, m),), (k,), f"{k} alone at σ={s:g} mem={m:g}")[0]
                  if (s, m) != (1.0, top) else 1.0 for m in mem_levels] for s in sm_levels] for k in kinds}
    pairs = {a: {b: [[None] * len(mem_levels) for _ in sm_levels] for b in kinds} for a in kinds}
    points = [(a, b, i, j) for a, b in itertools.combinations_with_replacement(kinds, 2)
              for i in range(len(sm_levels)) for j in range(len(mem_levels))]
    for n, (a, b, i, j) in enumerate(points, 1):
        what = f"{a} + {b} at σ={sm_levels[i]:g} mem={mem_levels[j]:g}"
        progress(f"[{n}/{len(points)}] {what}")
        s_a, s_b = noise.ratio(lambda a=a, b=b, i=i, j=j: bench.pair(a, b, sm_levels[i], mem_levels[j]), (a, b), what)
        pairs[a][b][i][j] = round(s_a, 4)
        pairs[b][a][_partner_index(sm_levels, i)][len(mem_levels) - 1 - j] = round(s_b, 4)
    source = {"kind": "measured", "note": note or "jigsaw profile", "measured_at": time.strftime("%Y-%m-%d"),
              "noise": noise.summary()}
    doc = {"format": FORMAT, "version": VERSION, "device": _device_dict(bench.device_info), "model": model,
           "source": source, "sm_levels": list(sm_levels), "mem_levels": list(mem_levels), "kinds": list(kinds),
           "alone": {k: [[round(v, 4) for v in row] for row in t] for k, t in alone.items()}, "pairs": pairs}
    return SlowdownGrid.from_dict(doc)


class MeasurementError(ValueError):
    """A point came out below the noise floor after its paired repeats."""


@dataclass
class _Noise:
    """Repeats of noisy measurements and what they showed."""

    repeats: int
    alone: Callable[[str], float]
    """Time of a kind alone on the whole device (its base), measured now."""
    base: dict[str, float] = field(default_factory=dict)
    """Each kind's base time: the median of `repeats` runs."""
    spreads: list[float] = field(default_factory=list)
    """(max − min) / median of every repeated measurement."""
    kind_spread: dict[str, float] = field(default_factory=dict)
    """The largest of those spreads per kind (a pair's two values count for their own kinds)."""
    below_one: int = 0
    """Kept slowdowns still under 1.0 after the repeats."""

    def measure_bases(self, kinds) -> None:
        for k in kinds:
            self.base[k] = self._keep([(self.alone(k),) for _ in range(self.repeats)], (k,))[0]

    def ratio(self, run: Callable[[], tuple[float, ...]], kinds: tuple[str, ...], what: str) -> tuple[float, ...]:
        """Slowdowns of one measurement of `kinds` against their base times; when one is under
        1.0 (noise), `repeats` runs in all, each after a fresh measurement of the bases."""
        runs = [tuple(t / self.base[k] for t, k in zip(run(), kinds, strict=True))]
        if min(runs[0]) < 1.0:
            for _ in range(self.repeats - 1):
                fresh = [self.alone(k) for k in kinds]
                runs.append(tuple(t / b for t, b in zip(run(), fresh, strict=True)))
        kept = self._keep(runs, kinds)
        if min(kept) < NOISE_FLOOR:
            raise MeasurementError(
                f"{what}: {min(kept):.3g} of the time alone on the whole device after {len(runs)} paired "
                f"runs, below the noise floor {NOISE_FLOOR}: the machine was too busy to measure; stop other "
                "jobs and run `jigsaw profile` again")
        self.below_one += sum(v < 1.0 for v in kept)
        return kept

    def _keep(self, runs: list[tuple[float, ...]], kinds: tuple[str, ...]) -> tuple[float, ...]:
        kept = tuple(statistics.median(col) for col in zip(*runs, strict=True))
        if len(runs) > 1:
            for col, med, k in zip(zip(*runs, strict=True), kept, kinds, strict=True):
                spread = (max(col) - min(col)) / med
                self.spreads.append(spread)
                self.kind_spread[k] = max(spread, self.kind_spread.get(k, 0.0))
        return kept

    def summary(self) -> dict:
        return {"repeats": self.repeats, "repeated_values": len(self.spreads),
                "max_spread_frac": round(max(self.spreads, default=0.0), 4),
                "median_spread_frac": round(statistics.median(self.spreads), 4) if self.spreads else 0.0,
                "kept_below_1": self.below_one,
                "max_spread_frac_by_kind": {k: round(v, 4) for k, v in self.kind_spread.items()}}


def _partner_index(sm_levels, i: int) -> int:
    """σ_B = 1 − σ_A for a partition, 1.0 (shared) stays 1.0."""
    s = sm_levels[i]
    if s >= 1.0:
        return i
    return min(range(len(sm_levels)), key=lambda k: abs(sm_levels[k] - (1.0 - s)))


def _check_levels(mem_levels) -> None:
    flipped = sorted(round(1.0 - m, 9) for m in mem_levels)
    if flipped != sorted(round(m, 9) for m in mem_levels):
        raise ValueError(f"memory levels {mem_levels} must be symmetric (m and 1−m) so both views of a pair "
                         "come from one measurement")


def _device_dict(d: DeviceInfo) -> dict:
    return {"sku": d.sku, "num_sms": d.num_sms, "mem_bytes": d.mem_bytes, "peak_flops": d.peak_flops,
            "mem_bw_bytes_per_s": d.mem_bw_bytes_per_s}


def default_out(device_info: DeviceInfo, model: str) -> Path:
    """<user profile dir>/h100/<model>.json for an H100-..., .../cpu/<model>.json for a CPU: never
    a shipped grid, and the name "<sku>/<model>" finds it first afterwards."""
    from jigsaw.profiles import user_dir

    return user_dir() / device_info.sku.split("-")[0].lower() / f"{model}.json"
