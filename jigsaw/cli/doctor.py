"""`jigsaw doctor`: what this machine offers jigsaw's GPU backend, and whether SM splits hold.

    python, torch (CUDA build?) ─┐
    driver (NVML, else cuda-python cuDriverGetVersion), CUDA versions, GPUs, NVML sample
    MPS daemon (jigsaw.mux.partition.mps; --start-mps starts it with no thread percentage)
    green contexts (jigsaw.mux.partition.green_probe.probe), nvcc
    SM-id kernel (jigsaw.mux.partition.smid: build jigsaw/csrc/smid.cu, run one census grid)
    confinement: per budget of GreenPartitions(--fracs), both streams of the pair at once;
                 each side's SM ids <= its num_sms and disjoint ─► OK/FAIL per budget
    two-process (--two-process): the same per budget, side 0 and side 1 held by two processes
                 (smid.two_process_census), and whether their grids ran at the same time (MPS)
        ─► one Check per line ("<name>  ok|unavailable|warn|fail: <why>"), or --json

Doctor reports; it does not fail: exit 0 whatever it finds, unless --strict, where a GPU
check that is not ok (or any failed check) exits 1.  torch, cuda-python and pynvml are
imported inside the checks, never by `jigsaw --help`; a check that raises unexpectedly is
reported as `fail` with the exception instead of a traceback.  What of the [gpu] extra is not
installed is said last (and in --json as `missing`).
"""

from __future__ import annotations

import importlib
import json as jsonlib
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jigsaw.mux.partition.smsplit import PARTITION_LEVELS

STATUSES = ("ok", "warn", "unavailable", "fail")


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Check torch/CUDA, driver, GPUs, MPS and green contexts, and verify SM confinement per budget."""

    device: int = 0
    """CUDA device to probe (green contexts, SM-id kernel, confinement, NVML sample)."""
    fracs: tuple[float, ...] = PARTITION_LEVELS
    """SM budgets whose green-partition pairs the confinement check runs; if unset, the levels
    of the shipped grids."""
    strict: bool = False
    """Exit 1 when a GPU check is not ok or any check failed; if unset, report only, exit 0."""
    json: bool = False
    """Print the report as one JSON object instead of lines."""
    start_mps: bool = False
    """Start the MPS control daemon (active thread percentage left unset) if none is running."""
    two_process: bool = False
    """Also run the confinement check across two processes, each holding one side of every budget
    pair (as two pipelines' workers do), and time whether their kernels overlap (they do only under
    MPS); if unset, only the single-process check runs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    name: str
    status: str
    """ok | warn (works, with a caveat) | unavailable (a prerequisite is absent) | fail."""
    detail: str
    gpu: bool = True
    """Part of what --strict requires (MPS, python, torch and nvcc are not)."""
    items: tuple[str, ...] = ()
    """Sub-lines: one per GPU, per budget, per warning."""
    data: dict = field(default_factory=dict)


def run(args: Args) -> int:
    if args.device < 0:
        raise ValueError(f"--device must be >= 0, got {args.device}")
    if not args.fracs or not all(0.0 < f < 1.0 for f in args.fracs):
        raise ValueError(f"--fracs must be in (0, 1), got {args.fracs}")
    from jigsaw.extras import DISTRIBUTIONS, missing

    checks = diagnose(args)
    ok = passes(checks)
    absent = [DISTRIBUTIONS.get(m, m) for m in missing("gpu")]
    if args.json:
        print(jsonlib.dumps({"ok": ok, "strict": args.strict, "device": args.device, "missing": absent,
                             "checks": {c.name: _as_json(c) for c in checks}}, indent=2, default=str))
    else:
        print(render(checks, args.device, ok))
        if absent:
            print(f"not installed: {', '.join(absent)}; install them with pip install 'jigsaw[gpu]'")
    return 1 if args.strict and not ok else 0


def passes(checks: list[Check]) -> bool:
    """What --strict asks: every GPU check ok, nothing failed."""
    return all(c.status != "fail" and (c.status == "ok" or not c.gpu) for c in checks)


def diagnose(args: Args) -> list[Check]:
    steps: list[tuple[str, bool, Callable[[], Check]]] = [
        ("python", False, check_python),
        ("torch", False, check_torch),
        ("driver", True, check_driver),
        ("cuda", True, check_cuda),
        ("gpus", True, check_gpus),
        ("telemetry", True, lambda: check_telemetry(args.device)),
        ("mps", False, lambda: check_mps(args.start_mps)),
        ("green", True, lambda: check_green(args.device)),
        ("nvcc", False, check_nvcc),
        ("smid", True, lambda: check_smid(args.device)),
        ("confinement", True, lambda: check_confinement(args.device, args.fracs)),
    ]
    if args.two_process:
        steps.append(("two-process", True, lambda: check_two_process(args.device, args.fracs)))
    return [_guarded(name, gpu, fn) for name, gpu, fn in steps]


def _guarded(name: str, gpu: bool, fn: Callable[[], Check]) -> Check:
    try:
        return fn()
    except Exception as exc:  # a bug or a broken install: report it, keep checking the rest
        return Check(name=name, status="fail", detail=f"{type(exc).__name__}: {exc}", gpu=gpu)


# ------------------------------------------------------------------ output


def render(checks: list[Check], device: int, ok: bool) -> str:
    lines = [f"jigsaw doctor (device {device})"]
    for c in checks:
        lines.append(f"  {c.name:<12} {c.status}: {c.detail}")
        lines.extend(f"  {'':<12}   {item}" for item in c.items)
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    verdict = "GPU backend ready" if ok else "GPU backend not verified here (--strict would exit 1)"
    lines.append(f"summary: {summary}; {verdict}")
    return "\n".join(lines)


def _as_json(c: Check) -> dict:
    out = asdict(c)
    del out["name"]
    return out


# ------------------------------------------------------------------ checks


def check_python() -> Check:
    return Check(name="python", status="ok", gpu=False, detail=f"{platform.python_version()} ({sys.executable})",
                 data={"version": platform.python_version(), "executable": sys.executable})


def _torch():
    """torch, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def check_torch() -> Check:
    torch = _torch()
    if torch is None:
        return Check(name="torch", status="unavailable", gpu=False, detail="torch is not installed")
    data = {"version": torch.__version__, "cuda_build": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count()}
    if torch.version.cuda is None:
        detail = f"{torch.__version__}: CPU build (no CUDA; install a CUDA build of torch for the GPU backend)"
    else:
        detail = (f"{torch.__version__}: CUDA {torch.version.cuda} build, "
                  f"{data['device_count']} device(s) visible")
    return Check(name="torch", status="ok", gpu=False, detail=detail, data=data)


def _cuda_python_driver() -> tuple[int | None, str]:
    """(cuDriverGetVersion, '') or (None, why not) through cuda-python."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return None, f"cuda-python is not installed ({exc})"
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None, f"cuda-python: cuInit: {err.name}"
        err, version = driver.cuDriverGetVersion()
    except Exception as exc:  # no libcuda: cuda.pathfinder raises DynamicLibNotFoundError, not a CUresult
        if type(exc).__name__ == "DynamicLibNotFoundError":
            return None, "cuda-python cannot load libcuda.so (no NVIDIA driver)"
        return None, f"cuda-python: {type(exc).__name__}: {exc}"
    if err != driver.CUresult.CUDA_SUCCESS:
        return None, f"cuda-python: cuDriverGetVersion: {err.name}"
    return int(version), ""


def _cuda_python_runtime() -> int | None:
    try:
        from cuda.bindings import runtime

        err, version = runtime.cudaRuntimeGetVersion()
    except Exception:  # informational only: a missing cudart must not hide the other versions
        return None
    return int(version) if err == runtime.cudaError_t.cudaSuccess else None


def cuda_version(v: int | None) -> str:
    """13040 -> '13.4' (the encoding of cuDriverGetVersion and cudaRuntimeGetVersion)."""
    return "?" if v is None else f"{v // 1000}.{v % 1000 // 10}"


def check_driver() -> Check:
    from jigsaw.mux import telemetry

    try:
        nv = telemetry.info()
    except telemetry.TelemetryError as exc:
        version, why = _cuda_python_driver()
        if version is None:
            return Check(name="driver", status="unavailable", detail=f"{exc}; {why}")
        return Check(name="driver", status="ok", detail=f"CUDA driver API {cuda_version(version)} (cuda-python; {exc})",
                     data={"cuda_driver_version": version})
    return Check(name="driver", status="ok",
                 detail=f"NVIDIA driver {nv.driver_version}, CUDA driver API {cuda_version(nv.cuda_driver_version)}",
                 data={"driver_version": nv.driver_version, "cuda_driver_version": nv.cuda_driver_version})


def check_cuda() -> Check:
    torch = _torch()
    torch_cuda = None if torch is None else torch.version.cuda
    driver_v, why = _cuda_python_driver()
    runtime_v = _cuda_python_runtime()
    data = {"torch_cuda": torch_cuda, "cuda_python_runtime": runtime_v, "driver_api": driver_v}
    known = (f"torch built with CUDA {torch_cuda or 'none (CPU build)'}, cuda-python runtime "
             f"{cuda_version(runtime_v)}, driver API {cuda_version(driver_v) if driver_v else 'none'}")
    if driver_v is None:
        return Check(name="cuda", status="unavailable", detail=f"no CUDA driver API: {why}; {known}", data=data)
    if torch_cuda is None:
        return Check(name="cuda", status="unavailable", detail=f"torch has no CUDA; {known}", data=data)
    if driver_v // 1000 < int(torch_cuda.split(".")[0]):
        return Check(name="cuda", status="fail", data=data,
                     detail=f"driver supports CUDA {cuda_version(driver_v)}, older than torch's CUDA {torch_cuda}")
    return Check(name="cuda", status="ok", detail=known, data=data)


def check_gpus() -> Check:
    torch = _torch()
    if torch is not None and torch.cuda.is_available():
        gpus = [_torch_gpu(torch, i) for i in range(torch.cuda.device_count())]
        return Check(name="gpus", status="ok", detail=f"{len(gpus)} visible to torch",
                     items=tuple(_gpu_line(g) for g in gpus), data={"devices": gpus})
    from jigsaw.mux import telemetry

    torch_why = ("torch is not installed" if torch is None else
                 f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None else
                 f"torch {torch.__version__} sees no CUDA device")
    try:
        nv = telemetry.info()
    except telemetry.TelemetryError as exc:
        return Check(name="gpus", status="unavailable", detail=f"{torch_why}; {exc}")
    gpus = [{"index": d.device, "name": d.name, "compute_capability": d.compute_capability, "num_sms": None,
             "mem_total_bytes": d.mem_total_bytes} for d in nv.devices]
    seen = f"so it cannot use the {len(gpus)} GPU(s) NVML lists" if gpus else "and NVML lists no GPU"
    return Check(name="gpus", status="unavailable", detail=f"{torch_why}, {seen}",
                 items=tuple(_gpu_line(g) for g in gpus), data={"devices": gpus})


def _torch_gpu(torch, index: int) -> dict:
    p = torch.cuda.get_device_properties(index)
    return {"index": index, "name": p.name, "compute_capability": (p.major, p.minor),
            "num_sms": p.multi_processor_count, "mem_total_bytes": p.total_memory}


def _gpu_line(g: dict) -> str:
    cc = "{}.{}".format(*g["compute_capability"]) if g["compute_capability"] else "?"
    sms = f"{g['num_sms']} SMs" if g["num_sms"] is not None else "SMs unknown"
    return (f"gpu {g['index']}: {g['name']}, cc {cc}, {sms}, "
            f"{g['mem_total_bytes'] / 2**30:.1f} GiB")


def check_telemetry(device: int) -> Check:
    from jigsaw.mux import telemetry

    try:
        (s,) = telemetry.sample([device])
    except telemetry.TelemetryError as exc:
        return Check(name="telemetry", status="unavailable", detail=str(exc))
    return Check(name="telemetry", status="ok", data=s.data(),
                 detail=f"device {device}: kernel-busy {s.sm_util_frac:.0%}, "
                        f"{s.mem_used_bytes / 2**30:.1f} of {s.mem_total_bytes / 2**30:.1f} GiB used, "
                        f"{len(s.processes)} compute process(es)")


def check_mps(start: bool) -> Check:
    from jigsaw.mux.partition import mps

    s = mps.ensure_mps(start)
    status = {"running": "fail" if s.thread_pct_capped else "ok", "stopped": "warn", "no-binary": "unavailable",
              "no-gpu": "unavailable", "error": "fail"}[s.state]
    detail = ("started: " if s.started else "") + s.reason
    return Check(name="mps", status=status, gpu=False, detail=detail, items=s.warnings,
                 data={"state": s.state, "pipe_dir": s.pipe_dir, "control_bin": s.control_bin,
                       "server_pids": list(s.server_pids), "default_thread_pct": s.default_thread_pct,
                       "env_thread_pct": s.env_thread_pct, "started": s.started})


def check_green(device: int) -> Check:
    try:
        green_probe = importlib.import_module("jigsaw.mux.partition.green_probe")
    except ImportError as exc:
        return Check(name="green", status="unavailable",
                     detail=f"jigsaw.mux.partition.green_probe cannot be imported: {exc}")
    try:
        g = green_probe.probe(device)
    except green_probe.GreenContextError as exc:
        return Check(name="green", status="unavailable", detail=str(exc))
    r = g.resource
    return Check(name="green", status="ok",
                 detail=(f"{g.backend} backend, {g.name} (cc {g.compute_capability[0]}.{g.compute_capability[1]}), "
                         f"driver {cuda_version(g.driver_version)}: {r.num_sms} SMs, partitions of >= "
                         f"{r.min_partition_sms} SMs in steps of {r.alignment_sms}"),
                 data={"backend": g.backend, "driver_version": g.driver_version, "num_sms": r.num_sms,
                       "min_partition_sms": r.min_partition_sms, "alignment_sms": r.alignment_sms})


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME or /usr/local/cuda (where torch's extension build looks)."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return shutil.which("nvcc") or next((str(Path(h) / "bin" / "nvcc") for h in homes
                                         if h and (Path(h) / "bin" / "nvcc").is_file()), None)


def check_nvcc() -> Check:
    path = find_nvcc()
    if path is None:
        return Check(name="nvcc", status="unavailable", gpu=False,
                     detail="nvcc not on PATH nor in $CUDA_HOME or /usr/local/cuda (needed to build the SM-id kernel)")
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(name="nvcc", status="fail", gpu=False, detail=f"{path} --version: {exc}")
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    version = m.group(2) if m else "unknown version"
    return Check(name="nvcc", status="ok", gpu=False, detail=f"{path} ({version})",
                 data={"path": path, "version": m.group(2) if m else None})


def check_smid(device: int) -> Check:
    from jigsaw.mux.partition import smid

    try:
        torch = smid.require_cuda(device)
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        ids = smid.sm_ids(smid.BLOCKS_PER_SM * num_sms, device=device)
    except smid.SmIdError as exc:
        return Check(name="smid", status="unavailable", detail=str(exc))
    status = "ok" if len(ids) <= num_sms else "fail"  # more ids than SMs: the census itself is broken
    return Check(name="smid", status=status, data={"num_sms": num_sms, "sm_ids": sorted(ids)},
                 detail=(f"kernel built ({smid.build_directory(torch)}); {smid.BLOCKS_PER_SM * num_sms} blocks "
                         f"ran on {len(ids)} distinct SMs of {num_sms} (ids {min(ids)}..{max(ids)})"))


def check_confinement(device: int, fracs: tuple[float, ...]) -> Check:
    from jigsaw.mux.partition import smid

    try:
        smid.require_cuda(device)
        green = importlib.import_module("jigsaw.mux.partition.green")
        green_probe = importlib.import_module("jigsaw.mux.partition.green_probe")
    except (smid.SmIdError, ImportError) as exc:
        return Check(name="confinement", status="unavailable", detail=str(exc))
    try:
        with green.GreenPartitions(device=device, fracs=fracs) as parts:
            report = smid.confinement(parts, fracs)
    except (green_probe.GreenContextError, smid.SmIdError) as exc:
        return Check(name="confinement", status="unavailable", detail=str(exc))
    items = tuple(f"budget {b.frac:g}: {b.describe()}" for b in report.budgets)
    passed = sum(b.ok for b in report.budgets)
    return Check(name="confinement", status="ok" if report.ok else "fail", items=items,
                 detail=f"{passed}/{len(report.budgets)} budget pairs stayed on their own SMs",
                 data={"device_sms": report.device_sms, "budgets": [
                     {"frac": b.frac, "ok": b.ok, "shared_sms": sorted(b.overlap),
                      "sides": [{"frac": s.frac, "num_sms": s.num_sms, "sm_ids": sorted(s.sm_ids)} for s in b.sides]}
                     for b in report.budgets]})


def check_two_process(device: int, fracs: tuple[float, ...]) -> Check:
    from jigsaw.mux.partition import mps, smid

    try:
        smid.require_cuda(device)
        green_probe = importlib.import_module("jigsaw.mux.partition.green_probe")
    except (smid.SmIdError, ImportError) as exc:
        return Check(name="two-process", status="unavailable", detail=str(exc))
    try:
        green_probe.probe(device)  # in this process: the workers would fail the same way, less clearly
    except green_probe.GreenContextError as exc:
        return Check(name="two-process", status="unavailable", detail=str(exc))
    report = smid.two_process_census(fracs, device)
    mps_state = mps.status().state
    passed = sum(b.ok for b in report.budgets)
    timing = "ran at the same time" if report.concurrent else "did not all run at the same time"
    return Check(name="two-process", status="ok" if report.ok else "fail",
                 items=tuple(f"budget {b.frac:g}: {b.describe()}" for b in report.budgets),
                 detail=(f"{passed}/{len(report.budgets)} budget pairs stayed on their own SMs with the sides in two "
                         f"processes; their kernels {timing} (MPS {mps_state})"),
                 data={"device_sms": report.device_sms, "mps": mps_state, "budgets": [
                     {"frac": b.frac, "ok": b.ok, "shared_sms": sorted(b.census.overlap),
                      "num_sms": [s.num_sms for s in b.census.sides],
                      "sm_ids": [sorted(s.sm_ids) for s in b.census.sides],
                      "alone_s": list(b.alone_s), "together_s": b.together_s, "serial_frac": b.serial_frac,
                      "concurrent": b.concurrent} for b in report.budgets]})
