"""gpu_check's `pipelines` step: two GRPO-shaped pipelines on the one GPU, several ways.

    jigsaw.recipes.demo.run_demo(framework="gpu"): the GPU recipe (jigsaw.recipes.gpu_grpo),
    two seeds, every mode interleaved per repeat, tokens/s over the measured steps
        without MPS   naive                         both at once: time-sliced
        under MPS     serial, naive, static, jigsaw  static: each capped at 50% of the SMs by MPS;
                                                     jigsaw: the daemon (policy jigsaw, green
                                                     partitioner) grants green-context sides
    ─► rows: per (MPS, mode) the median tokens/s, its range, and the ratio to serial and to static
       paired by repeat (same repeat, same MPS state)

--dry-run: static and jigsaw, two steps, on the CPU with the tiny model and a FAKE GPU
(jigsaw.mux.partition.fake_gpu, 132 SMs) behind the daemon's green partitioner; no MPS.  The
numbers then say nothing about a GPU.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

GPU_RECIPE = "--layers 4 --prompt-tokens 64"
DRY_RECIPE = "--device cpu --model tiny --layers 2 --prompt-tokens 8"


def run(ctx) -> tuple[str, list[dict], str]:
    from jigsaw.mux.partition import fake_gpu, mps
    from jigsaw.recipes.demo import DemoConfig

    out = Path(tempfile.mkdtemp(prefix="gpu-check-pipelines-"))  # logs and traces: more files than $OUT returns
    dry = ctx.dry_run
    base = DemoConfig(framework="gpu", steps=3, warmup_steps=1, repeats=1 if dry else 2, prompts=4 if dry else 8,
                      group=2 if dry else 4, max_new_tokens=16 if dry else 48,
                      recipe_args=DRY_RECIPE if ctx.dry_run else GPU_RECIPE)
    rows, notes = [], [f"daemon's grid: {base.profile or 'h100/qwen3-0.6b (prior)'}"]
    if dry:
        os.environ[fake_gpu.ENV_SMS] = "132"
        os.environ[fake_gpu.ENV_LOG] = str(out / "fake_gpu_launches.jsonl")
        # the modes' code paths: serial and naive run in tests/integration/test_demo.py already, and
        # four modes of three steps passed the step's budget on a loaded 2-core machine
        two = replace(base, steps=2, modes=("static", "jigsaw"), out_dir=out / "fake")
        rows += _modes(ctx, two, "fake GPU")
        return "ok", rows, "; ".join(notes + ["DRY RUN: CPU, tiny model, fake GPU: no GPU figure"])
    rows += _modes(ctx, replace(base, modes=("naive",), repeats=1, out_dir=out / "no-mps"), "off")
    started = mps.ensure_mps(start=True)
    notes.append(f"MPS: {started.state} ({started.reason})")
    try:
        label = "on" if started.running else f"off ({started.state})"
        rows += _modes(ctx, replace(base, modes=("serial", "naive", "static", "jigsaw"), out_dir=out / "mps"), label)
    finally:
        if started.started:
            notes.append(f"MPS afterwards: {mps.stop_mps()}")
        for trace in (out / "mps").glob("jigsaw-trace*.jsonl"):
            shutil.copyfile(trace, Path(ctx.out) / f"pipelines-{trace.name}")  # the last repeat's, for a timeline
            break
    return "ok", rows, "; ".join(notes)


def run_engines(ctx) -> tuple[str, list[dict], str]:
    """gpu_check's `engines` step: the GRPO recipe on jigsaw's own engines (jigsaw.recipes.grpo:
    CB rollout worker processes, an FSDP trainer rank on NCCL), two pipelines on the one GPU,
    serial and under the daemon's green partitioner; every worker and rank binds the green side
    its client posts for it (mux/partition/board.py).  Rows as `pipelines`, plus the green grants
    the engines' processes held.  --dry-run: on the CPU, a FAKE GPU, tiny shapes, jigsaw only."""
    from jigsaw.mux.partition import fake_gpu, mps
    from jigsaw.recipes.demo import GPU_PROFILE, DemoConfig

    out = Path(tempfile.mkdtemp(prefix="gpu-check-engines-"))
    dry = ctx.dry_run
    cfg = DemoConfig(framework="jigsaw", partitioner="green", steps=2 if dry else 3, warmup_steps=1, repeats=1,
                     prompts=2 if dry else 8, group=2 if dry else 4, max_new_tokens=16 if dry else 48,
                     profile=None if dry else GPU_PROFILE, recipe_args="" if dry else "--device cuda",
                     modes=("jigsaw",) if dry else ("serial", "jigsaw"), out_dir=out)
    if dry:
        os.environ[fake_gpu.ENV_SMS] = "132"
        os.environ[fake_gpu.ENV_LOG] = str(out / "fake_gpu_launches.jsonl")
        rows = _with_green_grants(_modes(ctx, cfg, "fake GPU"), out)
        launches = fake_gpu.read_log(out / "fake_gpu_launches.jsonl")
        return "ok", rows, f"DRY RUN: CPU, fake GPU: {len(launches)} launches logged by the engines' processes"
    started = mps.ensure_mps(start=True)
    try:
        rows = _with_green_grants(_modes(ctx, cfg, "on" if started.running else f"off ({started.state})"), out)
    finally:
        if started.started:
            mps.stop_mps()
    return "ok", rows, f"MPS: {started.state}; the tiny model (hidden 128): a check that the engines apply grants"


def _with_green_grants(rows: list[dict], out: Path) -> list[dict]:
    """Each row with the green grants of its last trace (sub-stages given a green side)."""
    import json

    for row in rows:
        trace = out / f"{row['mode']}-trace.jsonl"
        events = [json.loads(line) for line in trace.read_text().splitlines()] if trace.exists() else []
        row["green_grants"] = sum(1 for e in events if e["event"] == "grant"
                                  and (e["data"].get("partition") or {}).get("kind") == "green")
    return rows


def _modes(ctx, cfg, mps_label: str) -> list[dict]:
    from jigsaw.recipes.demo import run_demo

    try:
        runs = run_demo(cfg, say=ctx.say)
    except Exception as exc:  # the pipelines' logs stay on the machine: their tails go into the report
        logs = sorted((cfg.out_dir / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime)
        tail = "\n".join(logs[-1].read_text(errors="replace").splitlines()[-40:]) if logs else "(no log)"
        raise RuntimeError(f"{exc}\n--- {logs[-1].name if logs else ''} ---\n{tail}") from exc
    by = {}
    for r in runs:
        by.setdefault(r.mode, {})[r.repeat] = r
    rows = []
    for mode, reps in by.items():
        rate = [reps[k].tokens_per_s for k in sorted(reps)]
        row = {"mps": mps_label, "mode": mode, "tokens_per_s": round(statistics.median(rate), 1),
               "range": f"{min(rate):.0f}–{max(rate):.0f}", "tokens": sorted({r.tokens for r in reps.values()}),
               "fell_open": sum(r.fell_open for r in reps.values())}
        for ref in ("serial", "static"):
            if ref in by and ref != mode:
                ratios = [reps[k].tokens_per_s / by[ref][k].tokens_per_s for k in reps if k in by[ref]]
                row[f"x_{ref}"] = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"
        rows.append(row)
    return rows
