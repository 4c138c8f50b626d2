"""Offline slowdown-grid measurement (`jigsaw profile`), independent of the device.

    ProfileConfig ─► Bench (device side: mux/profile_cuda.py; the CPU one comes with the CPU engines)
        │   base[k]       = time per token of k alone, whole device, top memory level
        │   alone[k][σ,m] = bench.alone(k, σ, m) / base[k]
        │   pair(a,b,σ,m) = bench.pair(a, b, σ, m)  ─► a's and b's time per token side by side,
        │                   a on σ of the SMs and m of the memory, b on the rest
        │                   (σ = 1.0: no partition, both share every SM)
        ▼
    measure_grid() ─► SlowdownGrid in the core library's format (source "measured"),
                      both views of every point from one measurement (the file's symmetry rule)

Each unordered pair of kinds is measured once per (σ, m): the partner's view of the point
(b, a, 1−σ, 1−m) is the same run, so a file never disagrees with itself.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from jigsaw.mux.prior import PriorConfig
from jigsaw.mux.slowdown import DEFAULT_MEM_LEVELS, DEFAULT_SM_LEVELS, FORMAT, VERSION, DeviceInfo, SlowdownGrid

DEVICE_KINDS = ("rollout_prefill", "rollout_decode", "rollout_tail", "reference", "training")


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileConfig:
    """What `jigsaw profile` measures."""

    device: str = "cuda"
    """cuda (green-context partitions on one GPU) | cpu (core sets of this machine, the recipe's
    model; writes profiles/cpu/)."""
    gpu: int = 0
    """CUDA device index."""
    model: str | None = None
    """cuda: a name in jigsaw.mux.prior.MODELS or the path of an HF config.json (default
    qwen3-0.6b); cpu: the recipe's model, tiny-qwen3 (default) or smollm2-135m."""
    out: Path | None = None
    """Output file (default: profiles/<sku>/<model>.json)."""
    layers: int = 4
    """Decoder layers instantiated: slowdowns are ratios of time per token and every layer has
    the same shape, so a few stand for the model while bounding memory and time."""
    min_time_s: float = 0.3
    """Time each measurement runs for (after one warm-up iteration)."""
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
                 kinds=DEVICE_KINDS, progress: Callable[[str], None] = lambda _: None, note: str = "") -> SlowdownGrid:
    """Every alone and pair point of the grid, normalised by each kind's exclusive time."""
    _check_levels(mem_levels)
    top = mem_levels[-1]
    base = {k: bench.alone(k, 1.0, top) for k in kinds}
    alone = {k: [[bench.alone(k, s, m) / base[k] if (s, m) != (1.0, top) else 1.0 for m in mem_levels]
                 for s in sm_levels] for k in kinds}
    pairs = {a: {b: [[None] * len(mem_levels) for _ in sm_levels] for b in kinds} for a in kinds}
    points = [(a, b, i, j) for a, b in itertools.combinations_with_replacement(kinds, 2)
              for i in range(len(sm_levels)) for j in range(len(mem_levels))]
    for n, (a, b, i, j) in enumerate(points, 1):
        progress(f"[{n}/{len(points)}] {a} + {b} at σ={sm_levels[i]:g} mem={mem_levels[j]:g}")
        t_a, t_b = bench.pair(a, b, sm_levels[i], mem_levels[j])
        i_b, j_b = _partner_index(sm_levels, i), len(mem_levels) - 1 - j
        pairs[a][b][i][j] = round(max(t_a / base[a], 1.0), 4)
        pairs[b][a][i_b][j_b] = round(max(t_b / base[b], 1.0), 4)
    source = {"kind": "measured", "note": note or "jigsaw profile", "measured_at": time.strftime("%Y-%m-%d")}
    doc = {"format": FORMAT, "version": VERSION, "device": _device_dict(bench.device_info), "model": model,
           "source": source, "sm_levels": list(sm_levels), "mem_levels": list(mem_levels), "kinds": list(kinds),
           "alone": {k: [[round(max(v, 1.0), 4) for v in row] for row in t] for k, t in alone.items()},
           "pairs": pairs}
    return SlowdownGrid.from_dict(doc)


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


def default_out(root: Path, device_info: DeviceInfo, model: str) -> Path:
    """profiles/h100/<model>.json for an H100-..., profiles/cpu/<model>.json for a CPU."""
    return root / "profiles" / device_info.sku.split("-")[0].lower() / f"{model}.json"
