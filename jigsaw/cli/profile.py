"""`jigsaw profile --device cuda|cpu --model CONFIG`: measure a device's slowdown grid.

    ProfileConfig ─► CudaBench (green-context pairs, kernels from the model config)
                   | CpuBench (core-set pairs, the recipe's model and sub-stage kinds)
                  ─► measure_grid() with a progress line per point ─► <user profile dir>/<sku>/<model>.json
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import tyro

from jigsaw.mux.profiler import ProfileConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Measure the slowdown grid of this machine's device for a model: every sub-stage kind
    alone under each SM (or core) and memory budget, and every pair side by side on disjoint
    partitions.  Writes the core library's grid format (see `jigsaw inspect`)."""

    profile: Annotated[ProfileConfig, tyro.conf.OmitArgPrefixes] = ProfileConfig()


def run(args: Args) -> int:
    from rich.console import Console

    from jigsaw.mux.profiler import default_out, measure_grid

    cfg = args.profile
    console = Console(stderr=True)
    bench, name, levels, note = _bench(cfg)
    try:
        with console.status("profiling ...") as status:
            def progress(line: str) -> None:
                status.update(line)
                if not console.is_terminal:  # logs and CI see the progress too
                    console.print(line)

            grid = measure_grid(bench, name, sm_levels=levels, progress=progress, note=note, repeats=cfg.repeats)
    finally:
        bench.close()
    out = cfg.out or default_out(grid.device, name)
    out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out)
    low = grid.sm_levels[0]
    slow = grid.alone("training", low, grid.mem_levels[-1])
    noise = grid.source["noise"]
    console.print(f"wrote {out}: training at {low:.0%} of the device x{slow:.2f}, "
                  f"best packing {grid.max_pack_efficiency():.2f}; {noise['repeated_values']} noisy values "
                  f"measured {noise['repeats']}x (spread up to {noise['max_spread_frac']:.0%}), "
                  f"{noise['kept_below_1']} still under 1.0")
    return 0


def _bench(cfg: ProfileConfig):
    from jigsaw.mux.slowdown import DEFAULT_SM_LEVELS

    if cfg.device == "cpu":
        from jigsaw.mux.cpu import cpu_levels
        from jigsaw.mux.profile_cpu import CpuBench

        name = cfg.model or "tiny-qwen3"
        bench = CpuBench(name, cfg.min_time_s)
        note = f"jigsaw profile --device cpu, {name}, {cfg.min_time_s:g} s per point"
        return bench, name, cpu_levels(len(bench.cores)), note
    if cfg.device != "cuda":
        raise ValueError(f"--device {cfg.device!r}: use cuda or cpu")
    from jigsaw.mux.green import GreenContextError
    from jigsaw.mux.profile_cuda import CudaBench

    try:
        bench = CudaBench(cfg)
    except GreenContextError as exc:
        raise ValueError(f"cannot profile on CUDA: {exc}") from None
    note = (f"jigsaw profile, {cfg.layers} layers of {bench.name}, {cfg.min_time_s:g} s per point, green contexts via "
            f"{bench.support.backend}")
    return bench, bench.name, DEFAULT_SM_LEVELS, note
