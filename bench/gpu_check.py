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

    the steps (bench/_gpu_check_steps.py, _gpu_check_models.py), in this order:
    env        python, torch, CUDA, the device, driver, cuda-bindings, MPS binary, nvidia-smi -L
    doctor     jigsaw.cli.doctor.diagnose in-process: SM-id kernel build, single-process confinement
    smid2      smid.two_process_census without MPS, then under MPS (started and stopped here)
    green      bf16 GEMM and a copy alone on pair(σ)[0] per budget, then both sides of pair(0.5) at once
    profile    profiler.measure_grid(CudaBench) of qwen3-0.6b, compared with profiles/h100's prior
    pipelines  bench/_gpu_pipelines.py's run(ctx) ─► (status, rows, note)
    engines    bench/_gpu_pipelines.py's run_engines(ctx): the recipe on jigsaw's own engines (CB
               rollout workers, FSDP trainer on NCCL), serial and under green grants they bind
    graphs     BudgetGraphs of a qwen3-0.6b decode step per budget (capture, replay vs eager, memory);
               an SM-id census captured on a green stream, replayed there and on the whole device's

--dry-run runs every step on this CPU, CUDA_VISIBLE_DEVICES emptied: the GPU is fake
(FakeGreenPartitions, FakeCensus) or the CPU bench stands in, and each step's note says so.
Every number in the results was measured in that run; what could not be measured is said, not
guessed.  <out> gets five files at most (the device tool returns eight): the report's three, the
measured grid, and the pipelines' last jigsaw trace.
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
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _path in (str(BENCH), str(ROOT)):  # jigsaw from the clone without an install; _gpu_pipelines
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _gpu_check_models import step_graphs, step_profile  # noqa: E402
from _gpu_check_steps import (  # noqa: E402 - bench/ is put on sys.path above
    MPS_MARKER,
    Ctx,
    StepResult,
    step_doctor,
    step_engines,
    step_env,
    step_green,
    step_pipelines,
    step_smid2,
)

CACHE_DIR = "/tmp/jigsaw-gpu-check-cache"
"""JIGSAW_CACHE_DIR of the steps unless set: the SM-id kernel is built once per machine."""
MAX_S = {False: 560.0, True: 240.0}
"""Whole-check limit by dry_run: a GPU command may run 600 s, and the report must be written by then."""
KILL_GRACE_S = 5.0
"""A step's process is killed this long after its budget (its stacks were dumped at the budget)."""
MIN_STEP_S = 15.0
"""A step is not started with less time than this left."""


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    run: Callable[[Ctx], StepResult]
    budget_s: float
    dry_budget_s: float


STEPS = (
    Step("env", step_env, budget_s=60, dry_budget_s=30),
    Step("doctor", step_doctor, budget_s=240, dry_budget_s=45),
    Step("smid2", step_smid2, budget_s=180, dry_budget_s=45),
    Step("green", step_green, budget_s=90, dry_budget_s=30),
    Step("profile", step_profile, budget_s=150, dry_budget_s=60),
    Step("pipelines", step_pipelines, budget_s=240, dry_budget_s=120),  # dry: 2 CPU modes, 20-45 s each under load
    Step("engines", step_engines, budget_s=150, dry_budget_s=60),
    Step("graphs", step_graphs, budget_s=120, dry_budget_s=30),
)
STEP_NAMES = tuple(s.name for s in STEPS)


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
        from jigsaw.mux.partition import mps

        stopped = mps.stop_mps((work / MPS_MARKER).read_text())
        (work / MPS_MARKER).unlink(missing_ok=True)
        result.note += f"; the MPS daemon this step started was left running: {stopped}"
    ctx.say(f"{step.name}: {result.status} in {result.seconds:.1f} s{': ' + result.note[:200] if result.note else ''}")
    return result


if __name__ == "__main__":
    sys.exit(main())
