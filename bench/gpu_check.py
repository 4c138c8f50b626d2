"""One command that runs jigsaw's GPU code on a real GPU and reports exactly what happened.

    python bench/gpu_check.py [--dry-run] [--out DIR] [--only a,b] [--skip a,b] [--device N] [--max-s S]

    main ─► for each step of STEPS, in order (--only / --skip):
        its own process, `gpu_check.py --step-child NAME` (its own CUDA context: a hang or a crash
        in a driver call ends that step only), killed after the step's budget_s (faulthandler
        dumps its stacks just before)
            step_<name>(Ctx) ─► StepResult(status, seconds, rows, note, error) ─► JSON ─► parent
        ─► <out>/gpu_check.json (every result so far) and <out>/gpu_check.md, rewritten after each step;
           <out>/gpu_check.log: every line printed, the steps' own included
    at the end: the markdown printed; exit 1 if a step failed, else 0

    env        python, torch, CUDA, the device, driver, cuda-bindings, MPS binary, nvidia-smi -L
    doctor     jigsaw.cli.doctor.diagnose in-process: SM-id kernel build, single-process confinement
    smid2      smid.two_process_census without MPS, then under MPS (started and stopped here)
    green      bf16 GEMM and a copy alone on pair(σ)[0] per budget, then both sides of pair(0.5) at once
    graphs     BudgetGraphs of a qwen3-0.6b decode step per budget (capture, replay vs eager, memory);
               an SM-id census captured on a green stream, replayed there and on the whole device's
    profile    profiler.measure_grid(CudaBench) of qwen3-0.6b, compared with profiles/h100's prior
    pipelines  bench/_gpu_pipelines.py's run(ctx) ─► (status, rows, note)

--dry-run runs every step on this CPU, CUDA_VISIBLE_DEVICES emptied: the GPU is fake
(FakeGreenPartitions, FakeCensus) or the CPU bench stands in, and each step's note says so.
Every number in the results was measured in that run; what could not be measured is said, not
guessed.  <out> gets four files at most from this script (the device tool returns eight).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(BENCH), str(ROOT)):  # jigsaw from the clone without an install; _gpu_pipelines
    if _path not in sys.path:
        sys.path.insert(0, _path)

LEVELS = (0.25, 0.5, 0.75)
"""SM budgets below the whole device that every step uses (the shipped grids' levels)."""
MODEL = "qwen3-0.6b"
FAKE_NUM_SMS = 132
"""SMs of the fake GPU of a dry run (an H100/H200's count)."""
CACHE_DIR = "/tmp/jigsaw-gpu-check-cache"
"""JIGSAW_CACHE_DIR of the steps unless set: the SM-id kernel is built once per machine."""
MAX_S = {False: 560.0, True: 240.0}
"""Whole-check limit by dry_run: a GPU command may run 600 s, and the report must be written by then."""
KILL_GRACE_S = 5.0
"""A step's process is killed this long after its budget (its stacks were dumped at the budget)."""
MIN_STEP_S = 15.0
"""A step is not started with less time than this left."""
MPS_MARKER = "mps_started"
"""Left in the work dir while a step has an MPS daemon of its own running; the parent stops it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ctx:
    """What a step knows: how to run, where to write, and how to say where it is."""

    dry_run: bool
    out: Path
    device: int
    t0_s: float
    """time.time() when the whole check started (progress lines count from it)."""
    budget_s: float
    """This step's time limit: its process is killed past it."""

    def say(self, msg: str) -> None:
        print(f"[gpu_check +{time.time() - self.t0_s:.1f}s] {msg}", flush=True)


@dataclass(kw_only=True)
class StepResult:
    name: str
    status: str = "ok"
    """ok | fail | unavailable (a prerequisite is missing here) | skipped (not run)."""
    seconds: float = 0.0
    rows: list[dict] = field(default_factory=list)
    """The step's table: plain JSON data, one dict per row."""
    note: str = ""
    error: str = ""
    """Traceback (or the stacks of a killed step), if any."""


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    run: Callable[[Ctx], StepResult]
    budget_s: float
    dry_budget_s: float


# ------------------------------------------------------------------ env


def step_env(ctx: Ctx) -> StepResult:
    from jigsaw.mux.partition import mps

    facts: dict[str, object] = {"python": f"{platform.python_version()} ({sys.executable})",
                                "kernel": platform.release(),
                                "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")}
    facts |= _torch_facts(ctx.device)
    facts |= _driver_facts()
    facts |= {"packages": ", ".join(f"{name} {_version_of(name)}" for name in (
        "cuda-bindings", "nvidia-ml-py", "numpy", "scipy", "transformers", "msgspec", "tyro", "rich", "psutil"))}
    status = mps.status()
    facts |= {mps.CONTROL_BIN: mps.find_control() or "not on PATH", "MPS": f"{status.state}: {status.reason}",
              "nvidia-smi -L": _output_of(["nvidia-smi", "-L"]), "nvcc": _output_of(["nvcc", "--version"], last=True),
              "ninja": shutil.which("ninja") or "not on PATH"}
    rows = [{"fact": name, "value": value} for name, value in facts.items()]
    if ctx.dry_run:
        return StepResult(name="env", rows=rows, note="dry run: what this machine has; CUDA is hidden from the steps")
    if facts.get("torch.cuda.is_available()") is not True:
        return StepResult(name="env", status="fail", rows=rows, note="torch sees no CUDA device on the GPU machine")
    return StepResult(name="env", rows=rows)


def _torch_facts(device: int) -> dict[str, object]:
    import torch

    facts: dict[str, object] = {"torch": torch.__version__, "torch.version.cuda": str(torch.version.cuda),
                                "torch.cuda.is_available()": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(device)
        facts |= {"device": f"{device}: {p.name}, cc {p.major}.{p.minor}", "SMs": p.multi_processor_count,
                  "memory GiB": round(p.total_memory / 2**30, 1), "devices visible": torch.cuda.device_count()}
    return facts


def _driver_facts() -> dict[str, object]:
    from jigsaw.cli.doctor import cuda_version
    from jigsaw.mux import telemetry

    try:
        nv = telemetry.info()
        facts: dict[str, object] = {
            "driver (NVML)": f"{nv.driver_version}, CUDA {cuda_version(nv.cuda_driver_version)}"}
    except telemetry.TelemetryError as exc:
        facts = {"driver (NVML)": f"unavailable: {exc}"}
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        err, version = driver.cuDriverGetVersion() if int(err) == 0 else (err, None)
        facts["cuDriverGetVersion"] = cuda_version(int(version)) if int(err) == 0 else f"failed: {err!r}"
    except Exception as exc:  # no libcuda, no bindings: a fact, not a failure
        facts["cuDriverGetVersion"] = f"unavailable: {type(exc).__name__}: {exc}"
    return facts


def _version_of(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _output_of(cmd: list[str], *, last: bool = False) -> str:
    if shutil.which(cmd[0]) is None:
        return f"{cmd[0]} not on PATH"
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"
    lines = (res.stdout + res.stderr).strip().splitlines() or ["(no output)"]
    return lines[-1] if last else " / ".join(lines)


# ------------------------------------------------------------------ doctor


def step_doctor(ctx: Ctx) -> StepResult:
    from jigsaw.cli import doctor

    ctx.say("doctor: diagnose (the SM-id kernel is built on first use: about a minute)")
    checks = doctor.diagnose(doctor.Args(device=ctx.device))
    rows = [{"check": c.name, "status": c.status, "gpu": c.gpu, "detail": c.detail, "items": "; ".join(c.items)}
            for c in checks]
    if ctx.dry_run:
        ok, note = all(c.status != "fail" for c in checks), "dry run: no check may fail; GPU checks are unavailable"
    else:
        ok = doctor.passes(checks)
        note = "GPU checks not ok: " + (", ".join(c.name for c in checks if c.gpu and c.status != "ok") or "none")
    return StepResult(name="doctor", status="ok" if ok else "fail", rows=rows, note=note)


# ------------------------------------------------------------------ smid2


class FakeCensus:
    """Stands for smid.GreenCensus without a GPU (dry runs, tests): a fake device of FAKE_NUM_SMS
    SMs split as smsplit.split_sms does; side 0 of pair(σ) "runs" on SM ids 0..n0-1, side 1 on
    the next n1, and a grid takes its waves x spin_ns of host sleep.  `overlap_sms` moves side 1
    down onto side 0's last SMs (a broken split, for tests that the comparison catches it)."""

    def __init__(self, device: int, fracs: tuple[float, ...], *, overlap_sms: int = 0):
        self.device_sms = FAKE_NUM_SMS
        self.overlap_sms = overlap_sms

    def num_sms(self, frac: float, side: int) -> int:
        from jigsaw.mux.partition.smsplit import split_sms

        return split_sms(_fake_resource(), frac)[side]

    def run(self, frac: float, side: int, num_blocks: int, spin_ns: int) -> tuple[set[int], float]:
        first = 0 if side == 0 else self.num_sms(frac, 0) - self.overlap_sms
        n = self.num_sms(frac, side)
        waves = -(-num_blocks // (2 * n))  # two 1024-thread blocks fit on an SM, as in smid.cu
        time.sleep(waves * spin_ns / 1e9)
        return set(range(first, first + n)), waves * spin_ns / 1e9

    def close(self) -> None:
        pass


def step_smid2(ctx: Ctx) -> StepResult:
    from jigsaw.mux.partition import mps, smid

    before = mps.status()
    census = FakeCensus if ctx.dry_run else smid.GreenCensus
    if not ctx.dry_run:
        ctx.say("smid2: loading the SM-id kernel here first, so the workers only load it")
        smid.load_op()
    rows = census_rows(ctx, "MPS (already running)" if before.running else "no MPS", census)
    notes, error = [f"MPS before: {before.state} ({before.reason})"], ""
    if ctx.dry_run:
        notes.append("dry run: FakeCensus, a fake GPU (the spawn, barrier, gather and comparison are real); "
                     "MPS not started")
    elif before.running:
        notes.append("MPS was already running: every run above was under it; it is left as it was")
    else:
        more, note, error = _census_under_mps(ctx, census)
        rows += more
        notes.append(note)
    ok = all(row["ok"] for row in rows) and not error
    return StepResult(name="smid2", status="ok" if ok else "fail", rows=rows, note="; ".join(notes), error=error)


def census_rows(ctx: Ctx, mode: str, census) -> list[dict]:
    """Rows of one two_process_census run (the σ side in process 0, the 1-σ side in process 1)."""
    from jigsaw.mux.partition import smid

    ctx.say(f"smid2 [{mode}]: two processes, side 0 and side 1 of pair(σ) for σ in {LEVELS}")
    report = smid.two_process_census(LEVELS, ctx.device, census=census, timeout_s=min(90.0, ctx.budget_s / 3))
    expected = "fake GPU" if ctx.dry_run else "concurrent" if mode.startswith("MPS") else "time-sliced"
    return [{"mode": mode, "sigma": b.frac, "side0_ids": len(b.census.sides[0].sm_ids),
             "side0_sms": b.census.sides[0].num_sms, "side1_ids": len(b.census.sides[1].sm_ids),
             "side1_sms": b.census.sides[1].num_sms, "shared_sms": len(b.census.overlap),
             "alone0_ms": 1e3 * b.alone_s[0], "alone1_ms": 1e3 * b.alone_s[1], "together_ms": 1e3 * b.together_s,
             "gpu_together_ms": f"{1e3 * b.gpu_together_s[0]:.2f} / {1e3 * b.gpu_together_s[1]:.2f}",
             "serial_frac": b.serial_frac, "concurrent": b.concurrent, "expected": expected, "ok": b.ok}
            for b in report.budgets]


def _census_under_mps(ctx: Ctx, census) -> tuple[list[dict], str, str]:
    """(rows, what happened to MPS, error) of a census under an MPS daemon started here and stopped after."""
    from jigsaw.mux.partition import mps, smid

    control = mps.find_control()
    if control is None:
        return [], f"MPS: {mps.CONTROL_BIN} not on PATH, so no run under MPS", ""
    started = mps.ensure_mps(start=True)
    if not started.running:
        return [], f"MPS: start failed ({started.state}): {started.reason}", ""
    marker = Path(os.environ.get("GPU_CHECK_WORK", tempfile.gettempdir())) / MPS_MARKER
    marker.write_text(control)
    ctx.say(f"smid2: MPS started: {started.reason}")
    rows, error = [], ""
    try:
        rows = census_rows(ctx, "MPS", census)
    except smid.CensusError as exc:
        error = str(exc)
    finally:
        stopped = stop_mps(control)
        if stopped == "stopped":
            marker.unlink(missing_ok=True)
    return rows, f"MPS: started ({started.reason}), then {stopped}", error


def stop_mps(control: str, timeout_s: float = 15.0) -> str:
    """`echo quit | nvidia-cuda-mps-control`, then wait until no daemon answers; what happened."""
    from jigsaw.mux.partition import mps

    try:
        subprocess.run([control], input="quit\n", capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"quit failed: {exc}"
    deadline = time.monotonic() + timeout_s
    while (state := mps.status().state) == "running" and time.monotonic() < deadline:
        time.sleep(0.2)
    return "stopped" if state != "running" else f"still running {timeout_s:g}s after quit"


# ------------------------------------------------------------------ green


@dataclass(frozen=True, slots=True)
class GreenSizes:
    gemm_n: int
    copy_bytes: int
    alone_s: float
    pair_s: float


GREEN_GPU = GreenSizes(gemm_n=8192, copy_bytes=1 << 30, alone_s=0.4, pair_s=0.6)
GREEN_DRY = GreenSizes(gemm_n=192, copy_bytes=4 << 20, alone_s=0.05, pair_s=0.05)
CALLS_PER_SYNC = 4
"""Calls enqueued between two waits for the stream: the queue stays short and the host keeps up."""


def step_green(ctx: Ctx) -> StepResult:
    torch = _torch(ctx)
    sizes = GREEN_DRY if ctx.dry_run else GREEN_GPU
    rows = []
    with _partitions(ctx) as parts:
        for op, unit, work, make in _green_ops(torch, ctx, sizes):
            ctx.say(f"green: {op} alone per budget, then both sides of pair(0.5)")
            alone = _alone_rows(torch, parts, op, unit, work, make, sizes.alone_s)
            rows += alone + _pair_rows(torch, parts, op, unit, work, make, sizes.pair_s, whole=alone[0]["value"])
    torch_sync(torch, ctx)
    note = ("dry run: CPU with a FAKE GPU (fake_gpu.FakeGreenPartitions, no SM split): the code path, no GPU numbers"
            if ctx.dry_run else "vs_whole: throughput over the whole device's (budget 1.0, an ordinary stream)")
    return StepResult(name="green", rows=rows, note=note)


def _green_ops(torch, ctx: Ctx, sizes: GreenSizes):
    """(op, unit, work per call, make() -> a call with its own tensors) for a GEMM and a copy."""
    dev = "cpu" if ctx.dry_run else f"cuda:{ctx.device}"
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16
    n, elems = sizes.gemm_n, sizes.copy_bytes // 2

    def gemm():
        a, b, c = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(3))
        return lambda: torch.matmul(a, b, out=c)

    def copy():
        src, dst = torch.ones(elems, device=dev, dtype=torch.bfloat16), torch.empty(elems, device=dev,
                                                                                    dtype=torch.bfloat16)
        return lambda: dst.copy_(src)

    return [(f"gemm {str(dtype).removeprefix('torch.')} {n}^3", "TFLOP/s", 2 * n**3 / 1e12, gemm),
            (f"copy {sizes.copy_bytes >> 20} MiB", "GB/s", 2 * sizes.copy_bytes / 1e9, copy)]


def _alone_rows(torch, parts, op, unit, work, make, seconds) -> list[dict]:
    """One row per budget, the whole device's (1.0) first: each on its partition's side 0, alone."""
    rows, whole = [], None
    for budget in (1.0, *LEVELS):
        part = parts.full if budget == 1.0 else parts.pair(budget)[0]
        value = work * calls_per_s(torch, [(make(), part.stream)], seconds)[0]
        whole = whole or value
        rows.append({"op": op, "budget": budget, "side": 0, "num_sms": part.num_sms, "value": value, "unit": unit,
                     "vs_whole": value / whole})
    return rows


def _pair_rows(torch, parts, op, unit, work, make, seconds, *, whole: float) -> list[dict]:
    sides = parts.pair(0.5)
    values = [work * r for r in calls_per_s(torch, [(make(), s.stream) for s in sides], seconds)]
    rows = [{"op": op, "budget": "pair(0.5)", "side": k, "num_sms": s.num_sms, "value": v, "unit": unit,
             "vs_whole": v / whole} for k, (s, v) in enumerate(zip(sides, values))]
    return rows + [{"op": op, "budget": "pair(0.5)", "side": "sum", "num_sms": sum(s.num_sms for s in sides),
                    "value": sum(values), "unit": unit, "vs_whole": sum(values) / whole}]


def calls_per_s(torch, jobs: list[tuple[Callable[[], object], object]], seconds: float) -> list[float]:
    """Calls per second of each (call, stream) job, all at once, one host thread each (the pattern
    of cuda_bench.CudaBench._timed): CUDA events on a stream, the host clock for a None stream."""
    for call, stream in jobs:  # warm-up (cuBLAS heuristics, allocator) outside the window
        settle(torch, stream)
        with on_stream(torch, stream):
            call()
        settle(torch, stream)
    start, out, errors = threading.Barrier(len(jobs)), [0.0] * len(jobs), []

    def loop(i: int, call, stream) -> None:
        try:
            with on_stream(torch, stream):
                start.wait()
                timer, calls, deadline = Timer(torch, stream), 0, time.perf_counter() + seconds
                while time.perf_counter() < deadline:
                    for _ in range(CALLS_PER_SYNC):
                        call()
                    calls += CALLS_PER_SYNC
                    if is_cuda(stream):
                        stream.synchronize()
                out[i] = calls / timer.stop()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=loop, args=(i, *job)) for i, job in enumerate(jobs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return out


class Timer:
    """Seconds of the work enqueued on `stream` since construction: CUDA events; host clock if None."""

    def __init__(self, torch, stream):
        self.torch, self.stream, self.t0 = torch, stream, time.perf_counter()
        if is_cuda(stream):
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record(stream)

    def stop(self) -> float:
        if not is_cuda(self.stream):
            return time.perf_counter() - self.t0
        end = self.torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        end.synchronize()
        return self.begin.elapsed_time(end) / 1e3


def settle(torch, stream) -> None:
    """Wait for the default stream (where inputs were made: a green stream is non-blocking and does
    not wait for it) and for `stream`; nothing on the CPU of a dry run."""
    if is_cuda(stream):
        torch.cuda.synchronize()
        stream.synchronize()


def on_stream(torch, stream):
    """torch.cuda.stream(stream); a fake GPU's stream (CPU work) only records the launch."""
    from jigsaw.mux.partition.bind import on_stream as launch_on

    return launch_on(stream) if not is_cuda(stream) else torch.cuda.stream(stream)


def is_cuda(stream) -> bool:
    """A real CUDA stream (not None, not a fake GPU's FakeStream)."""
    return stream is not None and not hasattr(stream, "launching")


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


# ------------------------------------------------------------------ pipelines


def step_pipelines(ctx: Ctx) -> StepResult:
    try:
        from _gpu_pipelines import run as run_pipelines
    except ModuleNotFoundError as exc:
        if exc.name != "_gpu_pipelines":
            raise
        return StepResult(name="pipelines", status="unavailable", note=f"bench/_gpu_pipelines.py is absent ({exc})")
    status, rows, note = run_pipelines(ctx)
    if status not in ("ok", "fail", "unavailable", "skipped"):
        return StepResult(name="pipelines", status="fail", rows=list(rows), note=f"unknown status {status!r}: {note}")
    return StepResult(name="pipelines", status=status, rows=list(rows), note=note)


STEPS = (
    Step("env", step_env, budget_s=60, dry_budget_s=30),
    Step("doctor", step_doctor, budget_s=240, dry_budget_s=45),
    Step("smid2", step_smid2, budget_s=180, dry_budget_s=45),
    Step("green", step_green, budget_s=90, dry_budget_s=30),
    Step("profile", step_profile, budget_s=150, dry_budget_s=60),
    Step("pipelines", step_pipelines, budget_s=240, dry_budget_s=60),
    Step("graphs", step_graphs, budget_s=120, dry_budget_s=30),
)
STEP_NAMES = tuple(s.name for s in STEPS)


# ------------------------------------------------------------------ shared helpers


def _torch(ctx: Ctx):
    import torch

    torch.manual_seed(0)
    if not ctx.dry_run:
        torch.cuda.set_device(ctx.device)
    return torch


def torch_sync(torch, ctx: Ctx) -> None:
    if not ctx.dry_run:
        torch.cuda.synchronize(ctx.device)


def _partitions(ctx: Ctx):
    if ctx.dry_run:
        from jigsaw.mux.partition.fake_gpu import FakeGreenPartitions

        return FakeGreenPartitions(LEVELS, _fake_resource())
    from jigsaw.mux.partition.green import GreenPartitions

    return GreenPartitions(ctx.device, LEVELS)


def _fake_resource():
    from jigsaw.mux.partition.smsplit import SmResource

    return SmResource(num_sms=FAKE_NUM_SMS, min_partition_sms=8, alignment_sms=8)  # Hopper's granularity


# ------------------------------------------------------------------ running the steps


def run_step(step: Step, ctx: Ctx, work: Path) -> StepResult:
    """The step in its own process group, killed past its budget; its result, or why there is none."""
    result_path = work / f"{step.name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--step-child", step.name, "--result", str(result_path),
           "--out", str(ctx.out), "--device", str(ctx.device), "--t0", repr(ctx.t0_s), "--budget-s", str(ctx.budget_s),
           *(["--dry-run"] if ctx.dry_run else [])]
    env = dict(os.environ, PYTHONUNBUFFERED="1", GPU_CHECK_WORK=str(work))
    env.setdefault("JIGSAW_CACHE_DIR", CACHE_DIR)
    if ctx.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # a dry run never touches a GPU, even where there is one
    started, tail = time.monotonic(), deque(maxlen=40)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8",
                            errors="replace", env=env, cwd=ROOT, start_new_session=True)
    echo = threading.Thread(target=_echo, args=(proc.stdout, tail), daemon=True)
    echo.start()
    killed = False
    try:
        rc = proc.wait(timeout=ctx.budget_s + KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        killed = True
        rc = None
    finally:  # the step's process and whatever it started (spawned workers), also on ^C
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait() if rc is None else rc
        echo.join(5)
    result = _read_result(step.name, result_path, killed, rc, ctx.budget_s, tail)
    result.seconds = round(time.monotonic() - started, 1)
    return result


def _echo(stream, tail: deque) -> None:
    for line in stream:
        print(line, end="", flush=True)
        tail.append(line)


def _read_result(name: str, path: Path, killed: bool, rc: int | None, budget_s: float, tail: deque) -> StepResult:
    if path.is_file():
        return StepResult(**json.loads(path.read_text()))
    stacks = path.with_suffix(".stacks")
    dumped = stacks.read_text(errors="replace") if stacks.is_file() else ""
    if killed:
        why = f"killed: still running after its budget of {budget_s:.0f} s (stacks below, dumped at the budget)"
    else:
        why = f"its process ended with {_exit_text(rc)} and wrote no result"
    return StepResult(name=name, status="fail", note=why,
                      error=f"{dumped.strip()}\n--- the step's last output ---\n{''.join(tail).rstrip()}".strip())


def _exit_text(rc: int | None) -> str:
    if rc is not None and rc < 0:
        return f"signal {signal.Signals(-rc).name}"
    return f"exit code {rc}"


def child_main(args: argparse.Namespace) -> int:
    """Inside a step's process: run it, guarded, and leave its result as JSON for the parent."""
    ctx = Ctx(dry_run=args.dry_run, out=args.out, device=args.device, t0_s=args.t0, budget_s=args.budget_s)
    step = STEPS[STEP_NAMES.index(args.step_child)]
    with open(args.result.with_suffix(".stacks"), "w") as stacks:
        faulthandler.enable(file=stacks, all_threads=True)  # a crash in a driver call leaves its stack
        faulthandler.dump_traceback_later(max(1.0, ctx.budget_s), file=stacks)
        try:
            result = step.run(ctx)
        except Exception:
            result = StepResult(name=step.name, status="fail", error=traceback.format_exc())
        faulthandler.cancel_dump_traceback_later()
    result.name = step.name
    args.result.write_text(json.dumps(_plain(asdict(result))))
    return 0


def _plain(value):
    """JSON data: non-finite floats and unknown objects as text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# ------------------------------------------------------------------ reports


def write_reports(out: Path, meta: dict, results: list[StepResult]) -> str:
    doc = meta | {"ok": not any(r.status == "fail" for r in results), "steps": [_plain(asdict(r)) for r in results]}
    markdown = render_markdown(meta, results)
    for name, text in (("gpu_check.json", json.dumps(doc, indent=2)), ("gpu_check.md", markdown)):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text + "\n")
        os.replace(tmp, out / name)
    return markdown


def render_markdown(meta: dict, results: list[StepResult]) -> str:
    title = "gpu_check (dry run: CPU, fake GPU)" if meta["dry_run"] else "gpu_check"
    lines = [f"# {title}", "", f"{meta['started']}, {meta['host']}, device {meta['device']}", ""]
    for r in results:
        lines += [f"## {r.name}: {r.status} ({r.seconds:.1f} s)", ""]
        if r.rows:
            lines += [*markdown_table(r.rows), ""]
        if r.note:
            lines += [r.note, ""]
        if r.error:
            lines += ["```", r.error.rstrip(), "```", ""]
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return out + ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


class _Tee:
    """stdout that also goes to the log file."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every step on this CPU with a fake GPU (for CI)")
    ap.add_argument("--out", type=Path, help="results directory (default: $OUT, else ./gpu_check_out)")
    ap.add_argument("--only", type=_step_list, help=f"run only these steps, comma-separated: {','.join(STEP_NAMES)}")
    ap.add_argument("--skip", type=_step_list, default=(), help="skip these steps, comma-separated")
    ap.add_argument("--device", type=int, default=0, help="CUDA device index")
    ap.add_argument("--max-s", type=float,
                    help=f"whole-check limit (default {MAX_S[False]:g} s, dry {MAX_S[True]:g} s)")
    ap.add_argument("--step-child", choices=STEP_NAMES, help=argparse.SUPPRESS)  # inside a step's process
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _step_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in STEP_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEP_NAMES)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step_child:
        return child_main(args)
    out = (args.out or Path(os.environ.get("OUT") or "gpu_check_out")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "gpu_check.log", "w", encoding="utf-8")  # noqa: SIM115 - open for the whole run
    sys.stdout = _Tee(sys.__stdout__, log)
    t0 = time.time()
    deadline = time.monotonic() + (args.max_s or MAX_S[args.dry_run])
    meta = {"tool": "bench/gpu_check.py", "dry_run": args.dry_run, "device": args.device, "host": platform.node(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t0))}
    chosen = [n for n in (args.only or STEP_NAMES) if n not in args.skip]
    results: list[StepResult] = []
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    try:
        for step in STEPS:
            results.append(_one(step, chosen, args, out, t0, deadline, work))
            write_reports(out, meta, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(write_reports(out, meta | {"seconds": round(time.time() - t0, 1)}, results), flush=True)
    log.close()
    sys.stdout = sys.__stdout__
    return 1 if any(r.status == "fail" for r in results) else 0


def _one(step: Step, chosen: list[str], args, out: Path, t0: float, deadline: float, work: Path) -> StepResult:
    left = deadline - time.monotonic()
    if step.name not in chosen:
        return StepResult(name=step.name, status="skipped", note="not selected (--only / --skip)")
    if left < MIN_STEP_S:
        return StepResult(name=step.name, status="skipped", note=f"not started: {left:.0f} s left of the whole check")
    budget = min(step.dry_budget_s if args.dry_run else step.budget_s, left)
    ctx = Ctx(dry_run=args.dry_run, out=out, device=args.device, t0_s=t0, budget_s=budget)
    ctx.say(f"{step.name}: start (budget {budget:.0f} s)")
    result = run_step(step, ctx, work)
    if (work / MPS_MARKER).is_file():  # the step died with its own MPS daemon still up
        stopped = stop_mps((work / MPS_MARKER).read_text())
        (work / MPS_MARKER).unlink(missing_ok=True)
        result.note += f"; the MPS daemon this step started was left running: {stopped}"
    ctx.say(f"{step.name}: {result.status} in {result.seconds:.1f} s{': ' + result.note[:200] if result.note else ''}")
    return result


if __name__ == "__main__":
    sys.exit(main())
