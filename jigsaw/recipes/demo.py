"""`jigsaw demo`: two real GRPO pipelines on this CPU, several ways, side by side, repeated.

    DemoConfig ─► for repeat r: for mode in --modes rotated by r (interleaved, so drift of the
                  machine hits every mode alike):
        serial      pipeline 1 to the end, then pipeline 2      (verl: one job owns the node)
        naive       both at once, no control: every worker uses every core (oversubscribed;
                    only when asked)
        naive-fair  both at once, each worker with cores / pipelines threads (no pinning)
        static      both at once, each pipeline pinned to its own equal share of the cores
                    (every process it starts inherits it): a fixed split, the free baseline;
                    more pipelines than cores: an equal cap of CPU time each instead (cgroups,
                    mux/partition/cpuquota.py), on whichever cores the OS picks
        static-live the daemon's `static` policy: the same split, through jigsaw's runtime
                    (admission, grants, partitions): static against it is what the runtime costs
        serial-live serial through jigsaw's runtime (daemon policy `serial`, one pipeline after
                    the other): its trace times every sub-stage alone on every core, what
                    calibrating a grid needs (jigsaw.sim.calibrate)
        jigsaw      a daemon (CPU partitions, the CPU slowdown grid) and both under `jigsaw run`
        each pipeline: python -m jigsaw.recipes.grpo --seed S ... --result R.json  (log to a file);
                    those started at once begin their first measured step together
                    (recipes/start_gate.py)
        between runs: how busy the machine is without us (psutil, a short sample)
    ─► Run per (mode, repeat): tokens/s over the measured steps (warm-up steps left out),
       appended to --out-dir/runs.jsonl as it ends
    ─► demo_report: median and spread per mode, ratios to serial paired by repeat, sub-stages
       that fell open, and whether the comparison can be trusted (spread, machine load, work)

Every mode runs the same seeds, so the pipelines do the same work in each; the report
checks that the token counts agree.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from jigsaw import profiles
from jigsaw.recipes.start_gate import gate_env

ROOT = Path(__file__).resolve().parents[2]
MODES = ("serial", "naive", "naive-fair", "static", "serial-live", "static-live", "jigsaw")
DAEMON_POLICY = {"serial-live": "serial", "static-live": "static", "jigsaw": "jigsaw"}
"""Modes run under a daemon, and its policy."""
SEQUENTIAL = ("serial", "serial-live")
"""Modes that run one pipeline to the end, then the next."""
DEFAULT_MODES = ("serial", "naive-fair", "static", "jigsaw")
VERL_MODES = ("serial", "naive", "static", "static-live", "jigsaw")
GPU_MODES = ("serial", "naive", "static", "jigsaw")
AGENTIC_TURNS = 3
"""Turns of the agentic pipeline of `--workload agentic` (two tool calls per sample and step)."""
GPU_PROFILE = "h100/qwen3-0.6b"
"""The GPU recipe's grid unless --profile names one (a measured one, where there is)."""
"""--framework verl: verl's jobs have no thread knob (no naive-fair); naive is the user's
default (both jobs at once, nothing else), and static-live is a baseline policy run live."""
"""naive is opt-in: oversubscribed, its tokens/s swings by 2× from run to run (551 to 1,746 over
nine runs on a quiet 2-core VM), so it cannot anchor a comparison; naive-fair and static are
the strong ones."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """The demo run."""

    steps: int = 5
    """GRPO steps per pipeline, warm-up steps included."""
    warmup_steps: int = 1
    """Leading steps of each pipeline left out of the measurement (lazy initialisation, first
    allocation, a daemon with no history yet)."""
    repeats: int = 3
    """Runs of every mode, interleaved; the table gives the median and the spread."""
    seeds: tuple[int, ...] = (1, 2)
    """One pipeline per seed: `--seeds 1 2 3` runs three side by side (static then splits the
    machine's CPU time three ways where it has fewer cores than pipelines)."""
    modes: tuple[str, ...] = DEFAULT_MODES
    """Which of serial, naive, naive-fair, static, serial-live, static-live, jigsaw to run
    (naive, oversubscribed and erratic, and the -live twins, the runtime's own cost and
    calibration traces, only when asked)."""
    out_dir: Path = Path("jigsaw-demo")
    """Trace, timeline, logs and per-pipeline results go here."""
    profile: str | None = None
    """CPU slowdown grid for the daemon, a file or a name; if unset, cpu/tiny-qwen3: the one
    `jigsaw profile --device cpu` measured here, else the shipped one."""
    prompts: int = 8
    """Prompts per step of each pipeline."""
    group: int = 4
    """Responses per prompt."""
    max_new_tokens: int = 256
    """Response budget."""
    long_tail: bool = True
    """Cap each request's length from the recipe's long-tail distribution (and say so)."""
    workload: str = "math"
    """math: every pipeline is one-turn GRPO on reasoning-gym arithmetic.  agentic: the first
    pipeline (first seed) runs 3 turns with a sandboxed Python tool call between two
    (--tool-turns 3, recipes/agentic.py), beside math pipelines.  async: the first pipeline is
    one-step off-policy (--mode one-step-off, recipes/async_grpo.py: its rollout and training
    side by side, joined by a sample buffer), beside synchronous math pipelines.  agentic and
    async: jigsaw's own recipe only."""
    framework: str = "jigsaw"
    """jigsaw: the GRPO recipe on jigsaw's own engines.  verl: unmodified verl 0.9.1 GRPO jobs
    (`python -m verl.trainer.main_ppo`, 2 rollout replicas each; needs the [verl] extra), modes
    serial, naive, static, static-live and jigsaw unless --modes says otherwise.  gpu: the GPU
    recipe (jigsaw.recipes.gpu_grpo) on GPU 0: naive is both at once (concurrent under MPS,
    time-sliced without), static caps each pipeline at an equal MPS thread percentage, jigsaw's
    daemon hands out green-context partitions; modes serial, naive, static and jigsaw."""
    recipe_args: str = ""
    """More flags for every pipeline of the recipe, one string written with `=`
    (`--recipe-args="--layers 2 --device cpu"`): the GPU recipe's --layers, --device, --model ..."""
    devices: int | None = None
    """Devices of the demo's daemons (CPU partitions of this machine's cores).  None: one for
    the recipe; for verl, one per rollout replica (2), as verl's GPUs are, each a core with
    its own grid (cpu/tiny-qwen3-1c), so every replica and trainer rank is a DP worker."""
    partitioner: str | None = None
    """The daemon's partitioner in the live modes: cpu (cores; the default of the CPU recipes) or
    green (SMs; the default of --framework gpu).  green on a CPU recipe needs a FAKE GPU
    (JIGSAW_FAKE_GPU=<num_sms>, mux/partition/fake_gpu.py): the recipe's workers then log the
    side each forward and micro-batch ran on, and run on all cores."""
    learn_grid: bool = False
    """The live modes' daemons refine their grid from every finished grant (`jigsaw daemon
    --learn-grid`), each run from the profile's grid (a fresh profile directory per run, so no
    run starts from what an earlier one learned); each grant the learner took carries the
    plan's error for it in the trace (a release event's `learned`)."""
    watch_grid: bool = False
    """The live modes' daemons measure the grid's error as --learn-grid does, and move no entry
    (`jigsaw daemon --watch-grid`): the error of the profile itself."""
    verl_poll_s: float | None = None
    """--framework verl: poll verl's replay buffer this often (s) in every mode instead of
    verl's 2 s, which makes `gen` last a multiple of 2 s whatever the rollout takes.
    None: verl's own."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One mode, once: both pipelines to the end."""

    mode: str
    repeat: int
    wall_s: float
    """The whole run, process start-up included."""
    steps_s: float
    """Time in the measured steps: serial, the sum over pipelines of first measured step start
    to last step end; concurrent, the union (earliest start to latest end).  Start-up and
    warm-up steps are left out."""
    tokens: int
    """Response tokens of the measured steps."""
    step_tokens: tuple[tuple[int, ...], ...] = ()
    """Response tokens of every step (warm-up included), per pipeline: the work done."""
    step_latency_s: dict[str, float] = field(default_factory=dict)
    """Mean latency of a measured step, per pipeline."""
    fell_open: int = 0
    """Sub-stages that ran without the daemon's control (jigsaw mode; 0 elsewhere, where no
    daemon runs and every sub-stage is uncontrolled by design)."""
    idle_busy_frac: float = 0.0
    """Share of the machine's CPU that other processes used just before this run."""
    stages_s: dict[str, float] = field(default_factory=dict)
    """Mean time of each of the framework's own stages in a measured step, both pipelines
    (verl's `timing_s/*`; empty for the recipe, whose sub-stages are in the daemon's trace)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.steps_s if self.steps_s > 0 else 0.0


def run_demo(cfg: DemoConfig, say=print) -> list[Run]:
    """Every mode `cfg.repeats` times, interleaved; `say` gets a progress line per run."""
    if cfg.framework in ("verl", "gpu") and cfg.modes == DEFAULT_MODES:
        cfg = replace(cfg, modes=VERL_MODES if cfg.framework == "verl" else GPU_MODES)
    _check_config(cfg)
    cfg = replace(cfg, out_dir=cfg.out_dir.resolve())  # the pipelines run from the package root
    (cfg.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    total = cfg.repeats * len(cfg.modes)
    for rep in range(cfg.repeats):
        order = cfg.modes[rep % len(cfg.modes):] + cfg.modes[:rep % len(cfg.modes)]
        for mode in order:
            busy = machine_busy_frac()
            say(f"[{len(runs) + 1}/{total}] {mode} (repeat {rep + 1}/{cfg.repeats}): "
                f"{len(cfg.seeds)} pipelines × {cfg.steps} steps ...")
            runs.append(replace(_run_mode(mode, rep, cfg), idle_busy_frac=busy))
            r = runs[-1]
            with open(cfg.out_dir / "runs.jsonl", "a" if len(runs) > 1 else "w") as f:
                f.write(json.dumps(asdict(r)) + "\n")
            say(f"    {r.tokens_per_s:,.0f} tokens/s over {r.steps_s:.1f} s of steps "
                f"(whole run {r.wall_s:.1f} s{f', {r.fell_open} fell open' if r.fell_open else ''})")
    return runs


def _check_config(cfg: DemoConfig) -> None:
    if cfg.framework not in ("jigsaw", "verl", "gpu"):
        raise ValueError(f"--framework {cfg.framework!r}: jigsaw, verl or gpu")
    if cfg.workload not in ("math", "agentic", "async"):
        raise ValueError(f"--workload {cfg.workload!r}: math, agentic or async")
    if cfg.workload != "math" and cfg.framework != "jigsaw":
        raise ValueError(f"--workload {cfg.workload} is jigsaw's own recipe (--framework jigsaw)")
    if cfg.partitioner not in (None, "cpu", "green"):
        raise ValueError(f"--partitioner {cfg.partitioner!r}: cpu or green")
    if cfg.framework != "jigsaw" and "naive-fair" in cfg.modes:
        raise ValueError(f"naive-fair sets the recipe's threads; a {cfg.framework} job has no such knob (use naive)")
    if bad := set(cfg.modes) - set(MODES):
        raise ValueError(f"unknown demo modes {sorted(bad)}; use {', '.join(MODES)}")
    if not 0 <= cfg.warmup_steps < cfg.steps:
        raise ValueError(f"--warmup-steps {cfg.warmup_steps} must leave a measured step of --steps {cfg.steps}")
    if cfg.repeats < 1 or not cfg.seeds:
        raise ValueError("the demo needs --repeats ≥ 1 and at least one seed")


def machine_busy_frac(sample_s: float = 0.5) -> float:
    """Share of all cores busy over a short sample; taken between runs, it is other processes'."""
    import psutil

    return psutil.cpu_percent(interval=sample_s) / 100.0


def _pipeline_cmd(cfg: DemoConfig, seed: int, result: Path, threads: int | None = None) -> list[str]:
    if cfg.framework == "verl":
        from jigsaw.recipes.verl_jobs import verl_pipeline_cmd

        return verl_pipeline_cmd(cfg, seed, result)
    common = ["--seed", str(seed), "--steps", str(cfg.steps), "--prompts", str(cfg.prompts), "--group",
              str(cfg.group), "--max-new-tokens", str(cfg.max_new_tokens), "--result", str(result),
              *shlex.split(cfg.recipe_args)]
    if cfg.framework == "gpu":
        return [sys.executable, "-m", "jigsaw.recipes.gpu_grpo", *common]
    first = seed == cfg.seeds[0]
    agentic = ["--tool-turns", str(AGENTIC_TURNS)] if cfg.workload == "agentic" and first else []
    agentic += ["--mode", "one-step-off"] if cfg.workload == "async" and first else []
    return [sys.executable, "-m", "jigsaw.recipes.grpo", *common, "--long-tail" if cfg.long_tail else "--no-long-tail",
            *(["--threads", str(threads)] if threads else []), *agentic]


def _run_mode(mode: str, rep: int, cfg: DemoConfig) -> Run:
    results = [cfg.out_dir / f"{mode}-seed{s}.json" for s in cfg.seeds]
    for r in results:
        r.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("JIGSAW_ENDPOINT", "JIGSAW_PIPELINE")}
    if cfg.framework == "verl":
        env["VERL_PLATFORM"] = "cpu"  # the CPU platform jigsaw's verl plugin registers
        if cfg.verl_poll_s is not None:  # every mode alike (integrations/verl/poll.py)
            env["JIGSAW_VERL_POLL_S"] = str(cfg.verl_poll_s)
    gate = Path(tempfile.mkdtemp(prefix="jigsaw-demo-gate-"))
    if mode not in SEQUENTIAL and cfg.framework != "verl":  # the recipes meet before step 0
        env.update(gate_env(gate, len(cfg.seeds), step=cfg.warmup_steps))
    log_path = cfg.out_dir / "logs" / f"{mode}-r{rep + 1}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log, _removed(gate):
        run = _Launcher(cfg, env, log, log_path)
        if mode == "serial":
            for s, r in zip(cfg.seeds, results):
                run.wait([run.pipeline(s, r)], mode)
        elif mode in ("naive", "naive-fair"):
            threads = max(1, len(os.sched_getaffinity(0)) // len(cfg.seeds)) if mode == "naive-fair" else None
            run.wait([run.pipeline(s, r, threads) for s, r in zip(cfg.seeds, results)], mode)
        elif mode == "static" and cfg.framework == "gpu":
            run.wait([run.pipeline(s, r, env=mps_share(len(cfg.seeds))) for s, r in zip(cfg.seeds, results)], mode)
        elif mode == "static":
            cores = tuple(sorted(os.sched_getaffinity(0)))
            if len(cfg.seeds) <= len(cores):
                shares = static_cores(cores, len(cfg.seeds))
                run.wait([run.pipeline(s, r, pin=c) for s, r, c in zip(cfg.seeds, results, shares)], mode)
            else:  # fewer cores than pipelines: an equal share of CPU time each, not of cores
                with static_quotas(len(cores), len(cfg.seeds)) as quotas:
                    run.wait([run.pipeline(s, r, quota=q) for s, r, q in zip(cfg.seeds, results, quotas)], mode)
        else:
            _run_daemon(cfg, results, run, rep, mode)
    return _summarise(mode, rep, time.perf_counter() - t0, results, cfg.warmup_steps)


@contextlib.contextmanager
def _removed(path: Path):
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class _Launcher:
    """Starts the pipelines of one run with their output in the run's log."""

    cfg: DemoConfig
    env: dict
    log: object
    log_path: Path

    def pipeline(self, seed: int, result: Path, threads: int | None = None, wrap=(),
                 pin: tuple[int, ...] | None = None, env: dict | None = None, quota=None) -> subprocess.Popen:
        start = pinned(pin) if pin else quota.join if quota is not None else None
        return subprocess.Popen([*wrap, *_pipeline_cmd(self.cfg, seed, result, threads)],
                                env={**self.env, **(env or {})}, cwd=ROOT,
                                stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=start)

    def wait(self, procs: list[subprocess.Popen], mode: str) -> None:
        codes = [p.wait() for p in procs]
        if any(codes):
            raise RuntimeError(f"a pipeline of the {mode} run exited with {max(codes, key=abs)}; "
                               f"its output is in {self.log_path}")


def static_cores(cores: tuple[int, ...], k: int) -> list[tuple[int, ...]]:
    """`k` disjoint, contiguous, equal shares of `cores` (the first ones get one more if they do
    not divide): a static split needs a core per pipeline."""
    if k > len(cores):
        raise ValueError(f"the static mode pins each of {k} pipelines to its own cores; this machine has {len(cores)}")
    size, extra = divmod(len(cores), k)
    bounds = [i * size + min(i, extra) for i in range(k + 1)]
    return [cores[bounds[i]:bounds[i + 1]] for i in range(k)]


@contextlib.contextmanager
def static_quotas(num_cores: int, k: int):
    """`k` CPU-time caps of num_cores / k CPUs each (mux/partition/cpuquota.py), removed after the
    run: a static split of a machine with fewer cores than pipelines (the CPU analogue of an
    equal MPS thread percentage)."""
    from jigsaw.mux.partition.cpuquota import CpuQuota, QuotaUnavailable

    try:
        quotas = [CpuQuota.create(f"jigsaw-demo-{os.getpid()}-{i}", num_cores / k) for i in range(k)]
    except QuotaUnavailable as exc:
        raise RuntimeError(f"the static mode splits {num_cores} cores among {k} pipelines by CPU time, and {exc}; "
                           "leave static out (--modes) or run as root") from exc
    try:
        yield quotas
    finally:
        for q in quotas:
            if not q.remove():
                print(f"warning: {q.path} still holds a process of the static run; left in place", file=sys.stderr)


def mps_share(k: int) -> dict[str, str]:
    """The environment that caps a process at 1/k of the SMs under MPS (ignored without MPS)."""
    from jigsaw.mux.partition.mps import THREAD_PCT_ENV

    return {THREAD_PCT_ENV: str(100 // k)}


def pinned(cores: tuple[int, ...]):
    """A preexec_fn putting the child (and all it starts) on `cores`; its threads follow them."""
    return lambda: os.sched_setaffinity(0, cores)


def daemon_layout(cfg: DemoConfig) -> tuple[int, Path]:
    """(devices, grid file) of the demo's daemons."""
    from jigsaw.integrations.verl.job import JobConfig

    if cfg.framework == "gpu":
        return cfg.devices or 1, profiles.resolve(cfg.profile or GPU_PROFILE)
    per_replica = cfg.framework == "verl" and cfg.devices is None
    devices = JobConfig().replicas if per_replica else (cfg.devices or 1)
    default = profiles.CPU_PER_CORE if len(os.sched_getaffinity(0)) // devices == 1 else profiles.CPU_DEFAULT
    return devices, profiles.resolve(cfg.profile or default)


def _run_daemon(cfg: DemoConfig, results: list[Path], run: _Launcher, rep: int, mode: str) -> None:
    rt = Path(tempfile.mkdtemp(prefix="jigsaw-demo-"))
    (rt / "rt").mkdir(mode=0o700)
    run.env = dict(run.env, JIGSAW_RUNTIME_DIR=str(rt / "rt"))
    if cfg.learn_grid or cfg.watch_grid:  # what this run learns stays in this run
        run.env["JIGSAW_PROFILE_DIR"] = str(rt / "profiles")
    trace = cfg.out_dir / f"{mode}-trace-r{rep + 1}.jsonl"  # every repeat's: a slow one can be looked at
    trace.unlink(missing_ok=True)
    devices, grid = daemon_layout(cfg)
    from jigsaw.runtime.client import wait_for_daemon

    with open(cfg.out_dir / "daemon.log", "w") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "daemon", "--profile", str(grid),
                                   "--devices", str(devices), "--policy", DAEMON_POLICY[mode],
                                   "--partitioner", cfg.partitioner or ("green" if cfg.framework == "gpu" else "cpu"),
                                   "--trace", str(trace), *(["--learn-grid"] if cfg.learn_grid else []),
                                   *(["--watch-grid"] if cfg.watch_grid else [])],
                                  env=run.env, cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=log)
    try:
        if not wait_for_daemon(f"ipc://{rt / 'rt' / 'daemon.sock'}", 30.0):
            raise RuntimeError(f"the demo's daemon did not start; see {cfg.out_dir / 'daemon.log'}")
        wrap = (sys.executable, "-m", "jigsaw.cli.main", "run", "--name")
        start = [lambda s=s, r=r: run.pipeline(s, r, wrap=(*wrap, f"grpo-seed{s}", "--"))
                 for s, r in zip(cfg.seeds, results)]
        if mode in SEQUENTIAL:
            for one in start:
                run.wait([one()], mode)
        else:
            run.wait([one() for one in start], mode)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(10)
        shutil.rmtree(rt, ignore_errors=True)
        if trace.exists():
            shutil.copyfile(trace, cfg.out_dir / f"{mode}-trace.jsonl")  # the latest, for the timeline


def _summarise(mode: str, rep: int, wall_s: float, results: list[Path], warmup_steps: int) -> Run:
    docs = [json.loads(r.read_text()) for r in results]
    measured = [d["steps"][warmup_steps:] for d in docs]
    spans = [(m[0]["start_s"], m[-1]["end_s"]) for m in measured]
    if mode in SEQUENTIAL:
        steps_s = sum(end - start for start, end in spans)
    else:
        steps_s = max(end for _, end in spans) - min(start for start, _ in spans)
    return Run(mode=mode, repeat=rep, wall_s=wall_s, steps_s=steps_s,
               tokens=sum(s["tokens"] for m in measured for s in m),
               step_tokens=tuple(tuple(s["tokens"] for s in d["steps"]) for d in docs),
               step_latency_s={d["name"]: sum(s["latency_s"] for s in m) / len(m) for d, m in zip(docs, measured)},
               fell_open=sum(len(d.get("fell_open", ())) for d in docs) if mode in DAEMON_POLICY else 0,
               stages_s=_stage_means([s for m in measured for s in m]))


def _stage_means(steps: list[dict]) -> dict[str, float]:
    names = sorted({k for s in steps for k in s.get("stages_s", {})})
    return {k: sum(s.get("stages_s", {}).get(k, 0.0) for s in steps) / len(steps) for k in names} if steps else {}
