"""The steps of bench/gpu_check.py: what each measures on a GPU, and what stands in on a dry run.

    Ctx (dry_run, out, device, budget) ─► step_<name>(ctx) ─► StepResult(status, rows, note, error)
    env  doctor  smid2  green  pipelines (bench/_gpu_pipelines.py) here; profile and graphs,
    the steps that run a model's kernels, in bench/_gpu_check_models.py
    a dry run: the CPU, a FAKE GPU (jigsaw.mux.partition.fake_gpu, FakeCensus) or the CPU bench

gpu_check.py runs each in its own process and time box and writes the report; nothing here
decides when or whether a step runs.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
    """Stands for smid.GreenCensus without a GPU (dry runs, tests): each side "runs" on the SM ids
    the fake GPU gives it (jigsaw.mux.partition.fake_gpu, a FAKE_NUM_SMS-SM device), and a grid
    takes its waves x spin_ns of host sleep.  `overlap_sms` puts side 1's last that many SMs on
    side 0's first ones (a broken split, for tests that the comparison catches it)."""

    def __init__(self, device: int, fracs: tuple[float, ...], *, overlap_sms: int = 0):
        from jigsaw.mux.partition.fake_gpu import FakeGreenPartitions

        self.parts = FakeGreenPartitions(fracs, _fake_resource())
        self.device_sms = FAKE_NUM_SMS
        self.overlap_sms = overlap_sms

    def num_sms(self, frac: float, side: int) -> int:
        return self.parts.pair(frac)[side].num_sms

    def run(self, frac: float, side: int, num_blocks: int, spin_ns: int) -> tuple[set[int], float]:
        pair = self.parts.pair(frac)
        mine, other = pair[side].stream, pair[1 - side].stream
        moved = self.overlap_sms if side == 1 else 0
        ids = set(range(mine.first_sm, mine.first_sm + mine.num_sms - moved))
        ids |= set(range(other.first_sm, other.first_sm + moved))
        waves = -(-num_blocks // (2 * mine.num_sms))  # two 1024-thread blocks fit on an SM, as in smid.cu
        time.sleep(waves * spin_ns / 1e9)
        return ids, waves * spin_ns / 1e9

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
        stopped = mps.stop_mps(control)
        if stopped == "stopped":
            marker.unlink(missing_ok=True)
    return rows, f"MPS: started ({started.reason}), then {stopped}", error


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


# ------------------------------------------------------------------ pipelines


def step_pipelines(ctx: Ctx) -> StepResult:
    return _from_pipelines(ctx, "pipelines", "run")


def step_engines(ctx: Ctx) -> StepResult:
    return _from_pipelines(ctx, "engines", "run_engines")


def _from_pipelines(ctx: Ctx, name: str, function: str) -> StepResult:
    try:
        import _gpu_pipelines
    except ModuleNotFoundError as exc:
        if exc.name != "_gpu_pipelines":
            raise
        return StepResult(name=name, status="unavailable", note=f"bench/_gpu_pipelines.py is absent ({exc})")
    status, rows, note = getattr(_gpu_pipelines, function)(ctx)
    if status not in ("ok", "fail", "unavailable", "skipped"):
        return StepResult(name=name, status="fail", rows=list(rows), note=f"unknown status {status!r}: {note}")
    return StepResult(name=name, status=status, rows=list(rows), note=note)


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
    from jigsaw.mux.partition.fake_gpu import hopper

    return hopper(FAKE_NUM_SMS)


