"""gpu_check's steps that run a model's kernels: `graphs` (CUDA graphs per SM budget) and
`profile` (a measured slowdown grid against the shipped prior).

    Ctx ─► step_graphs: BudgetGraphs over GreenPartitions.by_budget() ─► capture, replay vs eager,
                        memory per budget; an SM-id census graph replayed on two streams
        ─► step_profile: measure_grid(CudaBench) ─► <out>/h200-qwen3-0.6b.json ─► compare_grids
                         against profiles/h100/qwen3-0.6b.prior.json, per kind
    a dry run: eager on the CPU (graphs), the CPU bench and the tiny model (profile)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from _gpu_check_steps import LEVELS, MODEL, Ctx, StepResult, Timer, _partitions, _torch, on_stream, settle

# ------------------------------------------------------------------ graphs


def step_graphs(ctx: Ctx) -> StepResult:
    torch = _torch(ctx)
    decode = _decode_steps(ctx)
    sizes = sorted(decode)
    iters = 3 if ctx.dry_run else 10
    rows, census = [], []
    with _partitions(ctx) as parts:
        budgets = parts.by_budget()
        eager = {(b, n): per_call_s(torch, decode[n], p.stream, iters) for b, p in budgets.items() for n in sizes}
        if ctx.dry_run:
            rows = [{"budget": b, "num_sms": p.num_sms, "batch": n, "captured": "dry run",
                     "eager_ms": 1e3 * eager[b, n]} for b, p in budgets.items() for n in sizes]
        else:
            rows = _graph_rows(torch, ctx, budgets, decode, eager, iters)
            census = _census_in_graph(torch, ctx, parts)
    rows += census
    ok = all(r.get("captured") in (True, "dry run") for r in rows if "batch" in r)
    # cudagraphs.py replays on the capture stream: there the census must run whole and stay within its SMs;
    # the whole-device replay only tells whether the partition travels with the graph.
    ok = ok and all(r["within"] and not r["blocks_missing"] for r in census if r.get("replayed on") == "capture stream")
    note = ("dry run: eager only, on the CPU, FakeGreenPartitions; qwen3-0.6b shapes, 1 layer, tiny batch"
            if ctx.dry_run else
            "decode step of qwen3-0.6b, 4 layers; memory: what the budget's captures added (BudgetGraphs)")
    return StepResult(name="graphs", status="ok" if ok else "fail", rows=rows, note=note)


def _decode_steps(ctx: Ctx) -> dict[int, Callable[[], object]]:
    """{batch: one decode step over a static KV cache}: rollout_decode kernels at two memory shares."""
    from jigsaw.mux.model.specs import PriorConfig
    from jigsaw.mux.profiling.kernels import build_kernels, model_spec

    shapes = PriorConfig(decode_max_batch=8, decode_context_tokens=32) if ctx.dry_run else PriorConfig()
    dev = "cpu" if ctx.dry_run else f"cuda:{ctx.device}"
    out = {}
    for mem_frac in (0.2, 0.4):
        k = build_kernels(model_spec(MODEL)[1], shapes, mem_frac, top_mem_frac=0.8, layers=1 if ctx.dry_run else 4,
                          device=dev, kinds=("rollout_decode",))["rollout_decode"]
        out[k.tokens] = k.step
    return out


def per_call_s(torch, call: Callable[[], object], stream, iters: int, warmup: int = 2) -> float:
    """Seconds per call of `call` on `stream`, `iters` calls back to back after `warmup` untimed ones."""
    settle(torch, stream)
    with on_stream(torch, stream):
        for _ in range(warmup):
            call()
        settle(torch, stream)
        timer = Timer(torch, stream)
        for _ in range(iters):
            call()
        return timer.stop() / iters


def _graph_rows(torch, ctx: Ctx, budgets: dict, decode: dict, eager: dict, iters: int) -> list[dict]:
    from jigsaw.mux.partition.cudagraphs import BudgetGraphs

    rows = []
    with BudgetGraphs(budgets, device=ctx.device) as graphs:
        for budget, part in budgets.items():
            ctx.say(f"graphs: capture budget {budget:g} ({part.num_sms} SMs), batches {sorted(decode)}")
            try:
                graphs.capture(lambda n: decode[n](), sorted(decode), budgets=[budget])
                failed = ""
            except Exception as exc:  # one budget's capture failing is a finding, the others still run
                failed = f"{type(exc).__name__}: {exc}"
            mem = graphs.memory_by_budget()[budget]
            for n in sorted(decode):
                captured = (budget, n) in graphs.captured
                row = {"budget": budget, "num_sms": part.num_sms, "batch": n, "captured": captured,
                       "eager_ms": 1e3 * eager[budget, n]}
                if not captured:
                    rows.append(row | {"error": failed})
                    continue
                replay = per_call_s(torch, lambda b=budget, n=n: graphs.replay(b, n, join=False), part.stream, iters)
                rows.append(row | {"replay_ms": 1e3 * replay, "replay_vs_eager": replay / eager[budget, n],
                                   "budget_pool_mib": mem.pool_bytes / 2**20, "budget_live_mib": mem.live_bytes / 2**20,
                                   "budget_device_mib": mem.device_bytes / 2**20})
    return rows


def _census_in_graph(torch, ctx: Ctx, parts) -> list[dict]:
    """An SM-id census captured on σ=0.25's green stream, replayed there and on the whole device's
    stream: does a replay keep the partition it was captured in (cudagraphs.py's caveat)?"""
    from jigsaw.mux.partition import smid

    side = parts.pair(LEVELS[0])[0]
    try:
        op = smid.load_op()
        num_blocks = smid.BLOCKS_PER_SM * torch.cuda.get_device_properties(ctx.device).multi_processor_count
        out = torch.full((num_blocks,), -1, dtype=torch.int32, device=f"cuda:{ctx.device}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side.stream):
            op(out, smid.DEFAULT_SPIN_NS)
        rows = []
        for where, stream in (("capture stream", side.stream), ("whole-device stream", parts.full.stream)):
            out.fill_(-1)
            torch.cuda.synchronize()
            with torch.cuda.stream(stream):
                graph.replay()
            stream.synchronize()
            ids = out.cpu().tolist()
            seen = len(set(ids) - {-1})
            rows.append({"census graph of budget": side.frac, "replayed on": where, "num_sms": side.num_sms,
                         "sm_ids": seen, "blocks_missing": ids.count(-1), "within": seen <= side.num_sms})
        graph.reset()
        return rows
    except Exception as exc:  # optional part: say why it did not run
        return [{"census graph of budget": side.frac, "error": f"{type(exc).__name__}: {exc}"}]


# ------------------------------------------------------------------ profile


PROFILE_TARGET_S = 90.0
"""What the GPU grid may take; min_time_s is sized from the point count to fit it."""
PROFILE_OVERHEAD_S = 0.03
"""Assumed cost per measurement beyond min_time_s (warm-up step, threads): sizing only."""


def step_profile(ctx: Ctx) -> StepResult:
    from jigsaw.mux.model.slowdown import SlowdownGrid
    from jigsaw.mux.model.validate import check_grid, is_degenerate
    from jigsaw.mux.profiling.profiler import measure_grid
    from jigsaw.profiles import SHIPPED_DIR

    bench, model, levels, kinds, min_time_s = _profile_bench(ctx)
    seen = [0]

    def progress(line: str) -> None:
        seen[0] += 1
        if seen[0] % 40 == 1:
            ctx.say(f"profile: {line}")

    try:
        grid = measure_grid(bench, model, sm_levels=levels, mem_levels=bench.mem_levels, kinds=kinds, repeats=2,
                            progress=progress, note=f"bench/gpu_check.py, {min_time_s:g} s per point")
    finally:
        bench.close()
    path = ctx.out / f"{'dryrun-' if ctx.dry_run else ''}{grid.device.sku.split('-')[0].lower()}-{model}.json"
    grid.save(path)
    prior = SlowdownGrid.load(SHIPPED_DIR / "h100" / f"{MODEL}.prior.json")
    findings = check_grid(grid)
    note = (f"{path.name}: {len(levels)} SM x {len(bench.mem_levels)} memory levels, {min_time_s:g} s per point; "
            f"vs {prior.path}: rel = |measured - prior| / prior; {len(findings)} finding(s) "
            f"({'DEGENERATE' if is_degenerate(findings) else 'usable'})" + "".join(f"; {f.message}" for f in findings))
    failed = is_degenerate(findings) and not ctx.dry_run
    if ctx.dry_run:
        note = "dry run: CpuBench on one core, tiny-qwen3, two kinds (numbers meaningless, code path real); " + note
    return StepResult(name="profile", status="fail" if failed else "ok", rows=compare_grids(grid, prior), note=note)


def _profile_bench(ctx: Ctx):
    """(bench, model, SM levels, kinds, min_time_s): CudaBench sized to PROFILE_TARGET_S, or the CPU bench."""
    from jigsaw.mux.model.slowdown import DEFAULT_MEM_LEVELS, DEFAULT_SM_LEVELS
    from jigsaw.mux.profiling.profiler import DEVICE_KINDS, ProfileConfig

    if ctx.dry_run:
        import functools

        from jigsaw.cli.profile import cpu_model
        from jigsaw.mux.partition.cpu import cpu_levels, usable_cores
        from jigsaw.mux.profiling.cpu_bench import CpuBench

        # One core: a split of two cores on a loaded CI machine measures the load, not the split.
        bench = CpuBench(functools.partial(cpu_model, "tiny-qwen3"), 0.03, cores=usable_cores()[:1])
        return bench, "tiny-qwen3", cpu_levels(1), ("rollout_decode", "training"), 0.03
    from jigsaw.mux.profiling.cuda_bench import CudaBench

    k, s, m, repeats = len(DEVICE_KINDS), len(DEFAULT_SM_LEVELS), len(DEFAULT_MEM_LEVELS), 2
    points = k * repeats + k * (s * m - 1) + k * (k + 1) // 2 * s * m
    target_s = min(PROFILE_TARGET_S, 0.6 * ctx.budget_s)
    min_time_s = round(min(0.1, max(0.02, target_s / (1.25 * points) - PROFILE_OVERHEAD_S)), 3)
    ctx.say(f"profile: {points} measurements at {min_time_s:g} s each (aiming at {target_s:.0f} s)")
    bench = CudaBench(ProfileConfig(device="cuda", gpu=ctx.device, model=MODEL, layers=4, min_time_s=min_time_s,
                                    repeats=repeats))
    return bench, MODEL, DEFAULT_SM_LEVELS, DEVICE_KINDS, min_time_s


def compare_grids(measured, prior) -> list[dict]:
    """Per kind, |measured - prior| / prior over every measured point, the prior read with its own
    lookup there: its table where it has the levels (counted), interpolated elsewhere."""
    doc, rows = measured.to_dict(), []
    kinds = [k for k in measured.kinds if k in prior.kinds]
    top = (1.0, measured.mem_levels[-1])
    for kind in kinds:
        pair, alone = [], []
        for i, sm in enumerate(measured.sm_levels):
            for j, mem in enumerate(measured.mem_levels):
                on_levels = _has_level(prior.sm_levels, sm) and _has_level(prior.mem_levels, mem)
                if (sm, mem) != top:  # 1.0 there by definition in both
                    alone.append(_rel(doc["alone"][kind][i][j], prior.alone, kind, sm, mem))
                pair += [(_rel(doc["pairs"][kind][other][i][j], prior.slowdown, kind, other, sm, mem), on_levels)
                         for other in kinds]
        compared = [(d, on) for d, on in pair if d is not None]
        diffs, alone = [d for d, _ in compared], [d for d in alone if d is not None]
        rows.append({"kind": kind, "pair_points": len(diffs), "at_prior_levels": sum(on for _, on in compared),
                     "not_comparable": len(pair) - len(diffs), "pair_median_rel": _med(diffs),
                     "pair_max_rel": max(diffs, default=None), "alone_points": len(alone),
                     "alone_median_rel": _med(alone), "alone_max_rel": max(alone, default=None)})
    return rows


def _rel(measured: float | None, lookup: Callable[..., float], *point) -> float | None:
    """|measured - prior| / prior with the prior's lookup(*point); None where either has no finite value."""
    try:
        value = lookup(*point)
    except ValueError:  # a level the prior has no partition for
        return None
    if measured is None or not math.isfinite(value) or value <= 0:
        return None
    return abs(measured - value) / value


def _has_level(levels, x: float) -> bool:
    return any(abs(level - x) <= 1e-9 for level in levels)


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


