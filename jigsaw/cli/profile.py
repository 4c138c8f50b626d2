"""`jigsaw profile --device cuda|cpu --model CONFIG`: measure a device's slowdown grid.

    ProfileConfig ─► CudaBench (green-context pairs, kernels from the model config)
                   | CpuBench (core-set pairs, the recipe's model from cpu_model, sub-stage kinds)
                  ─► out = --out or <user profile dir>/<sku>/<model>.json
                     (inside the shipped grids only when --out names it, else refused before measuring)
                  ─► measure_grid() with a progress line per point
                  ─► jigsaw.mux.model.validate.check_grid() ─► findings and spread printed
                        degenerate ─► <out stem>.rejected.json, exit 1 (the name keeps its old grid)
                        otherwise  ─► out, exit 0: the name <sku>/<model> now resolves to it
    --check FILE_OR_NAME ─► check_grid() on an existing grid, nothing measured: exit 1 if degenerate
    --calibrate ALONE SHARED [...] ─► daemon traces of the same pipelines (serial; static or jigsaw)
                  ─► jigsaw.sim.calibrate scales the grid the shared runs used, per kind
                  ─► the same checks, the same out
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import tyro

from jigsaw.mux.profiling.profiler import ProfileConfig

if TYPE_CHECKING:
    from rich.console import Console

    from jigsaw.mux.model.slowdown import DeviceInfo, SlowdownGrid
    from jigsaw.mux.model.validate import Finding


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Measure the slowdown grid of this machine's device for a model: every sub-stage kind
    alone under each SM (or core) and memory budget, and every pair side by side on disjoint
    partitions.  Writes the core library's grid format (see `jigsaw inspect`) after checking
    that it describes the device rather than the load on it (`--check` checks an existing grid)."""

    profile: Annotated[ProfileConfig, tyro.conf.OmitArgPrefixes] = ProfileConfig()


def run(args: Args) -> int:
    from rich.console import Console

    from jigsaw.extras import require

    cfg = args.profile
    if cfg.check is not None:
        return _check(Console(soft_wrap=True), cfg.check)
    if cfg.calibrate is not None:
        return _calibrate(Console(soft_wrap=True), cfg)
    if cfg.device in ("cpu", "cuda"):  # measuring runs the engines (cpu) or green contexts (cuda)
        require("cpu" if cfg.device == "cpu" else "gpu", f"jigsaw profile --device {cfg.device}")
    return _measure(Console(stderr=True, soft_wrap=True), cfg)


def _check(console: Console, ref: str) -> int:
    from jigsaw.mux.model.slowdown import SlowdownGrid
    from jigsaw.mux.model.validate import check_grid, is_degenerate

    grid = SlowdownGrid.load(ref)
    findings = check_grid(grid)
    _report(console, grid, findings)
    if is_degenerate(findings):
        console.print(f"{grid.path} is degenerate: it describes the load on the machine it was measured on, "
                      "not the device; measure it again on an idle machine", markup=False)
        return 1
    console.print(f"ok: {grid.path} is usable ({len(findings)} warning{'s' * (len(findings) != 1)})", markup=False)
    return 0


def _calibrate(console: Console, cfg: ProfileConfig) -> int:
    from jigsaw.mux.model.grids import node_grid
    from jigsaw.mux.model.validate import check_grid
    from jigsaw.sim.calibrate import calibrate
    from jigsaw.trace import Trace

    paths = cfg.calibrate
    if not paths or len(paths) % 2:
        raise ValueError(f"--calibrate takes pairs of traces, ALONE SHARED [ALONE SHARED ...], got {len(paths)}")
    runs = [Trace.read(p) for p in paths]
    profiles = {str(next((e.data for e in t.events if e.event == "node"), {}).get("profile", "?")) for t in runs[1::2]}
    if "?" in profiles or len(profiles) != 1:
        raise ValueError("the shared traces must be daemon traces (jigsaw daemon --trace) decided with one grid, "
                         f"got {sorted(profiles)}")
    cal = calibrate(node_grid(profiles.pop()), runs[0::2], runs[1::2], sources=tuple(str(p) for p in paths))
    say = _printer(console)
    say(f"  {'kind':<16} {'matched':>7} {'alone s':>8} {'shared s':>8} {'measured x':>10} {'grid said x':>11}  factor")
    for f in cal.fits:
        say(f"  {f.kind:<16} {f.matched:>7} {f.alone_s:>8.2f} {f.shared_s:>8.2f} {f.measured_x:>10.2f} "
            f"{f.grid_x:>11.2f}  {f'{f.factor:.2f}' if f.applied else 'kept (too little time)'}")
    out, ref = _target(cfg, cal.grid.device, cal.grid.model)
    findings = check_grid(cal.grid)
    _report(console, cal.grid, findings)
    return _save(console, cal.grid, findings, out, ref)


def _measure(console: Console, cfg: ProfileConfig) -> int:
    from jigsaw.mux.model.validate import check_grid

    bench, name, levels, note = _bench(cfg)
    try:
        out, ref = _target(cfg, bench.device_info, name)
        grid = _measure_grid(console, bench, name, levels, note, cfg.repeats)
    finally:
        bench.close()
    findings = check_grid(grid)
    _report(console, grid, findings)
    return _save(console, grid, findings, out, ref)


def _target(cfg: ProfileConfig, device_info: DeviceInfo, model: str) -> tuple[Path, str]:
    """Where the grid goes and the name ("cpu/tiny-qwen3") that finds it; refuses a shipped file
    that --out did not name."""
    from jigsaw.mux.profiling.profiler import default_out
    from jigsaw.profiles import SHIPPED_DIR, is_shipped, user_dir

    default = default_out(device_info, model)
    out = cfg.out or default
    if cfg.out is None and is_shipped(out):
        raise ValueError(f"refusing to write {out}: it is inside the grids installed with jigsaw ({SHIPPED_DIR}) "
                         f"because the user profile dir {user_dir()} is; point JIGSAW_PROFILE_DIR elsewhere, or pass "
                         f"--out {out} to overwrite the shipped grid on purpose")
    return out, f"{default.parent.name}/{default.stem}"


def _measure_grid(console: Console, bench, model: str, levels, note: str, repeats: int) -> SlowdownGrid:
    from jigsaw.mux.profiling.profiler import measure_grid

    with console.status("profiling ...") as status:
        def progress(line: str) -> None:
            status.update(line)
            if not console.is_terminal:  # logs and CI see the progress too
                console.print(line, markup=False)

        return measure_grid(bench, model, sm_levels=levels, mem_levels=bench.mem_levels, progress=progress, note=note,
                            repeats=repeats)


def _report(console: Console, grid: SlowdownGrid, findings: list[Finding]) -> None:
    """The grid's spread per kind, its noise and packing, then every finding."""
    from jigsaw.mux.model.validate import kind_spreads, packing

    low = grid.sm_levels[0]
    say = _printer(console)
    say(f"{grid.path or 'this measurement'}: {grid.source['kind']} grid of {grid.model} on {grid.device.sku}")
    say(f"  {'kind':<16} {'repeat spread':>13}   alone at σ={low:g}, min-max over memory")
    for row in kind_spreads(grid):
        spread = f"{row.repeat_spread_frac:.0%}" if row.repeat_spread_frac is not None else \
            "not recorded" if grid.source["kind"] == "measured" else "(a prior)"
        say(f"  {row.kind:<16} {spread:>13}   {row.low_share_min:.2f}-{row.low_share_max:.2f}")
    if noise := grid.source.get("noise"):
        say(f"  noise: {noise['repeated_values']} values measured {noise['repeats']}x, spread median "
            f"{noise['median_spread_frac']:.0%}, max {noise['max_spread_frac']:.0%}; "
            f"{noise['kept_below_1']} kept under 1.0")
    if best := packing(grid):
        (a, b), top = max(best.items(), key=lambda item: item[1])
        (c, d), bottom = min(best.items(), key=lambda item: item[1])
        say(f"  packing (1/s_a + 1/s_b, 2.00 if pairs cost nothing): best {top:.2f} ({a} + {b}), "
            f"least packable pair {bottom:.2f} ({c} + {d})")
    for f in findings:
        say(f"{'warning' if f.severity == 'warning' else 'DEGENERATE'} ({f.rule}): {f.message}")


def _save(console: Console, grid: SlowdownGrid, findings: list[Finding], out: Path, ref: str) -> int:
    """Write a usable grid to `out`; a degenerate one next to it, where its name does not find it."""
    from jigsaw.mux.model.validate import is_degenerate
    from jigsaw.profiles import is_shipped

    say = _printer(console)
    if is_degenerate(findings):
        rejected = out.with_name(f"{out.stem}.rejected.json")
        grid.save(rejected)
        say(f"NOT written to {out}: the measured grid is degenerate (above); {_name_note(ref, None)}. "
            f"It is at {rejected} for inspection; stop other jobs and run `jigsaw profile` again.")
        return 1
    shipped = is_shipped(out)
    grid.save(out)
    say(f"wrote {out}{' over the shipped grid (asked with --out)' if shipped else ''}; {_name_note(ref, out)}")
    return 0


def _printer(console: Console):
    """Plain lines: no rich markup (a message may hold brackets) and no wrapping (soft_wrap)."""
    return lambda text: console.print(text, markup=False, highlight=False)


def _name_note(ref: str, out: Path | None) -> str:
    """What the name `ref` finds now, said against the grid just written to `out` (None: none was)."""
    from jigsaw.profiles import SHIPPED_DIR, resolve

    try:
        found = resolve(ref)
    except FileNotFoundError:
        return f"the name {ref} finds no grid" + ("; load this one by its path" if out else "")
    if out is None:
        return f"the name {ref} still resolves to {found}"
    if found.resolve() != out.resolve():
        return f"the name {ref} resolves to {found}, not to this grid: load it by its path"
    shipped = [p for p in (SHIPPED_DIR / f"{ref}.json", SHIPPED_DIR / f"{ref}.prior.json")
               if p.is_file() and p.resolve() != out.resolve()]
    return f"the name {ref} now resolves to it" + (f" (it shadows the shipped {shipped[0]})" if shipped else "")


def cpu_model(name: str):
    """The recipe's CPU model `name` (jigsaw.engines.model), loaded in each CpuBench worker:
    handed in from here so that mux never imports the engines (which import mux)."""
    from jigsaw.engines.model import ModelConfig, load

    return load(ModelConfig(name=name))[0]


def _bench(cfg: ProfileConfig):
    from jigsaw.mux.model.slowdown import DEFAULT_SM_LEVELS

    if cfg.device == "cpu":
        from jigsaw.mux.partition.cpu import cpu_levels
        from jigsaw.mux.profiling.cpu_bench import CpuBench

        name = cfg.model or "tiny-qwen3"
        bench = CpuBench(functools.partial(cpu_model, name), cfg.min_time_s, cores=cfg.cores)
        note = f"jigsaw profile --device cpu, {name}, {cfg.min_time_s:g} s per point"
        return bench, name, cpu_levels(len(bench.cores)), note
    if cfg.device != "cuda":
        raise ValueError(f"--device {cfg.device!r}: use cuda or cpu")
    from jigsaw.mux.partition.green_probe import GreenContextError
    from jigsaw.mux.profiling.cuda_bench import CudaBench

    try:
        bench = CudaBench(cfg)
    except GreenContextError as exc:
        raise ValueError(f"cannot profile on CUDA: {exc}") from None
    note = (f"jigsaw profile, {cfg.layers} layers of {bench.name}, {cfg.min_time_s:g} s per point, green contexts via "
            f"{bench.support.backend}")
    return bench, bench.name, DEFAULT_SM_LEVELS, note
