"""`jigsaw profile --device cuda --model CONFIG`: measure a device's slowdown grid.

    ProfileConfig ─► CudaBench (green-context pairs, kernels from the model config)
                  ─► measure_grid() with a progress line per point ─► profiles/<sku>/<model>.json
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from jigsaw.mux.profiler import ProfileConfig

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Measure the slowdown grid of this machine's device for a model: every sub-stage kind
    alone under each SM and memory budget, and every pair side by side on green-context
    partitions.  Writes the core library's grid format (see `jigsaw inspect`)."""

    profile: Annotated[ProfileConfig, tyro.conf.OmitArgPrefixes] = ProfileConfig()


def run(args: Args) -> int:
    cfg = args.profile
    if cfg.device != "cuda":
        raise ValueError(f"--device {cfg.device!r}: only 'cuda' is measured so far (the CPU bench comes with "
                         "the CPU engines)")
    from rich.console import Console

    from jigsaw.mux.green import GreenContextError
    from jigsaw.mux.profile_cuda import CudaBench
    from jigsaw.mux.profiler import default_out, measure_grid

    console = Console(stderr=True)
    try:
        bench = CudaBench(cfg)
    except GreenContextError as exc:
        raise ValueError(f"cannot profile on CUDA: {exc}") from None
    try:
        with console.status("profiling ...") as status:
            grid = measure_grid(bench, bench.name, progress=status.update,
                                note=f"jigsaw profile, {cfg.layers} layers of {cfg.model}, {cfg.min_time_s:g} s per point, "
                                     f"green contexts via {bench.support.backend}")
    finally:
        bench.close()
    out = cfg.out or default_out(ROOT, grid.device, bench.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    grid.save(out)
    console.print(f"wrote {out}: training at 25% SMs x{grid.alone('training', 0.25, grid.mem_levels[-1]):.2f}, "
                  f"best packing {grid.max_pack_efficiency():.2f}")
    return 0
