"""`jigsaw demo`: two real GRPO pipelines on this CPU, four ways, side by side.

    DemoConfig ─► for mode in (serial, naive, naive-fair, jigsaw):
        serial      pipeline 1 to the end, then pipeline 2      (verl: one job owns the node)
        naive       both at once, no control: every worker uses every core (oversubscribed)
        naive-fair  both at once, each worker with cores / pipelines threads (no pinning), so
                    "above naive" is not a thread-count artefact
        jigsaw      a daemon (CPU partitions, the CPU slowdown grid) and both under `jigsaw run`
        each pipeline: python -m jigsaw.recipes.grpo --seed S ... --result R.json
    ─► table: wall time, aggregated tokens/s, mean step latency per pipeline, ratio to serial,
       sub-stages that fell open (ran without the daemon)
    ─► jigsaw mode's trace and its timeline PNG in --out-dir

Every mode runs the same two seeds, so the pipelines do the same work in each.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from jigsaw import profiles

ROOT = Path(__file__).resolve().parents[2]
MODES = ("serial", "naive", "naive-fair", "jigsaw")


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """The demo run."""

    steps: int = 5
    """GRPO steps per pipeline."""
    seeds: tuple[int, ...] = (1, 2)
    """One pipeline per seed."""
    modes: tuple[str, ...] = MODES
    """Which of serial, naive, naive-fair, jigsaw to run."""
    out_dir: Path = Path("jigsaw-demo")
    """Trace, timeline PNG and per-pipeline results go here."""
    profile: str | None = None
    """CPU slowdown grid for the daemon, a file or a name (default: cpu/tiny-qwen3, measured by
    `jigsaw profile --device cpu` if you ran it, else the shipped one)."""
    prompts: int = 8
    """Prompts per step of each pipeline."""
    group: int = 4
    """Responses per prompt."""
    max_new_tokens: int = 256
    """Response budget."""
    long_tail: bool = True
    """Cap each request's length from the recipe's long-tail distribution (and say so)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModeResult:
    mode: str
    wall_s: float
    """The whole run, process start-up included."""
    steps_s: float
    """Time the pipelines spent in their steps: serial, the sum of each one's first-step start
    to last-step end; concurrent, the union (earliest start to latest end).  Start-up (imports,
    spawning workers) is the same in every mode and is left out."""
    tokens: int
    step_latency_s: dict[str, float] = field(default_factory=dict)
    """Mean step latency per pipeline."""
    fell_open: int = 0
    """Sub-stages that ran without the daemon's control (jigsaw mode; 0 elsewhere)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.steps_s


def run_demo(cfg: DemoConfig, say=print) -> list[ModeResult]:
    bad = set(cfg.modes) - set(MODES)
    if bad:
        raise ValueError(f"unknown demo modes {sorted(bad)}; use {', '.join(MODES)}")
    # the pipelines and the daemon run from the package root: paths they are given are absolute
    cfg = replace(cfg, out_dir=cfg.out_dir.resolve())
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for mode in cfg.modes:
        say(f"running {mode}: {len(cfg.seeds)} pipelines × {cfg.steps} steps ...")
        results.append(_run_mode(mode, cfg))
        r = results[-1]
        say(f"  {mode}: steps {r.steps_s:.1f} s (whole run {r.wall_s:.1f} s), {r.tokens_per_s:,.0f} tokens/s")
    return results


def _pipeline_cmd(cfg: DemoConfig, seed: int, result: Path, threads: int | None = None) -> list[str]:
    return [sys.executable, "-m", "jigsaw.recipes.grpo", "--seed", str(seed), "--steps", str(cfg.steps),
            "--prompts", str(cfg.prompts), "--group", str(cfg.group), "--max-new-tokens", str(cfg.max_new_tokens),
            "--long-tail" if cfg.long_tail else "--no-long-tail", "--result", str(result),
            *(["--threads", str(threads)] if threads else [])]


def _run_mode(mode: str, cfg: DemoConfig) -> ModeResult:
    results = [cfg.out_dir / f"{mode}-seed{s}.json" for s in cfg.seeds]
    env = {k: v for k, v in os.environ.items() if k not in ("JIGSAW_ENDPOINT", "JIGSAW_PIPELINE")}
    t0 = time.perf_counter()
    if mode == "serial":
        for s, r in zip(cfg.seeds, results):
            _check(subprocess.run(_pipeline_cmd(cfg, s, r), env=env, cwd=ROOT).returncode, mode)
    elif mode in ("naive", "naive-fair"):
        threads = max(1, len(os.sched_getaffinity(0)) // len(cfg.seeds)) if mode == "naive-fair" else None
        procs = [subprocess.Popen(_pipeline_cmd(cfg, s, r, threads), env=env, cwd=ROOT)
                 for s, r in zip(cfg.seeds, results)]
        for p in procs:
            _check(p.wait(), mode)
    else:
        _run_jigsaw(cfg, results, env)
    wall = time.perf_counter() - t0
    return _summarise(mode, wall, results)


def _run_jigsaw(cfg: DemoConfig, results: list[Path], env: dict) -> None:
    rt = Path(tempfile.mkdtemp(prefix="jigsaw-demo-"))
    (rt / "rt").mkdir(mode=0o700)
    env = dict(env, JIGSAW_RUNTIME_DIR=str(rt / "rt"))
    trace = cfg.out_dir / "jigsaw-trace.jsonl"
    trace.unlink(missing_ok=True)
    grid = profiles.resolve(cfg.profile or profiles.CPU_DEFAULT)
    from jigsaw.runtime.client import wait_for_daemon

    with open(cfg.out_dir / "daemon.log", "w") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "daemon", "--profile", str(grid),
                                   "--partitioner", "cpu", "--trace", str(trace)], env=env, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=log)
    try:
        if not wait_for_daemon(f"ipc://{rt / 'rt' / 'daemon.sock'}", 30.0):
            raise RuntimeError(f"the demo's daemon did not start; see {cfg.out_dir / 'daemon.log'}")
        procs = [subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "run", "--name", f"grpo-seed{s}", "--",
                                   *_pipeline_cmd(cfg, s, r)], env=env, cwd=ROOT) for s, r in zip(cfg.seeds, results)]
        for p in procs:
            _check(p.wait(), "jigsaw")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(10)
        shutil.rmtree(rt, ignore_errors=True)


def _check(rc: int, mode: str) -> None:
    if rc != 0:
        raise RuntimeError(f"a pipeline of the {mode} run exited with {rc}")


def _summarise(mode: str, wall: float, results: list[Path]) -> ModeResult:
    docs = [json.loads(r.read_text()) for r in results]
    lat = {d["name"]: sum(s["latency_s"] for s in d["steps"]) / max(1, len(d["steps"])) for d in docs}
    if mode == "serial":
        steps_s = sum(d["end_s"] - d["start_s"] for d in docs)
    else:
        steps_s = max(d["end_s"] for d in docs) - min(d["start_s"] for d in docs)
    return ModeResult(mode=mode, wall_s=wall, steps_s=steps_s, tokens=sum(d["tokens"] for d in docs),
                      step_latency_s=lat, fell_open=sum(len(d.get("fell_open", ())) for d in docs))


def table(results: list[ModeResult]):
    from rich.table import Table

    serial = next((r for r in results if r.mode == "serial"), None)
    t = Table(title="two GRPO pipelines on this CPU")
    for col in ("mode", "steps s", "wall s", "tokens/s", "× serial", "step latency s (per pipeline)", "fell open"):
        t.add_column(col, justify="right")
    for r in results:
        ratio = f"{r.tokens_per_s / serial.tokens_per_s:.2f}" if serial else "-"
        lat = "  ".join(f"{v:.2f}" for v in r.step_latency_s.values())
        t.add_row(r.mode, f"{r.steps_s:.1f}", f"{r.wall_s:.1f}", f"{r.tokens_per_s:,.0f}", ratio, lat,
                  str(r.fell_open) if r.mode == "jigsaw" else "-")
    return t
