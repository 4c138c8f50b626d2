"""Overhead of `jigsaw run`: one pipeline alone, with and without the daemon, side by side.

    python bench/runtime_overhead.py [--reps 5] [--steps 4] [--work-ms 100]

The pipeline is tests/workers/toy_pipeline.py: 5 sub-stages per step, each `--work-ms` of
numpy work, every one admitted through the client API.  Runs alternate (bare, wrapped,
bare, ...) so drift hits both alike.  Two numbers per run: the steps' own time (what the
admissions cost the pipeline) and the whole command (adds `jigsaw run`'s start and exit).
The daemon is started once beforehand, as on a node where it is already up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from jigsaw.runtime.client import wait_for_daemon

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "tests" / "workers" / "toy_pipeline.py"


def once(wrapped: bool, env: dict, tmp: Path, args) -> tuple[float, float]:
    out, el = tmp / "out", tmp / "elapsed"
    out.unlink(missing_ok=True)
    toy = [sys.executable, str(TOY), "--out", str(out), "--steps", str(args.steps), "--work-ms", str(args.work_ms),
           "--elapsed-out", str(el)]
    cmd = [sys.executable, "-m", "jigsaw.cli.main", "run", "--name", "bench", "--", *toy] if wrapped else toy
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    exclusive = {ln.split()[-1] for ln in out.read_text().splitlines()}
    assert exclusive == ({"0"} if wrapped else {"1"}), f"wrapped={wrapped}: grants {exclusive}"
    return float(el.read_text()), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--work-ms", type=float, default=100.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="jigsaw-bench-"))
    rt = tmp / "rt"
    rt.mkdir(mode=0o700)
    env = dict(os.environ, JIGSAW_RUNTIME_DIR=str(rt))
    env.pop("JIGSAW_ENDPOINT", None)
    daemon = subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "daemon", "--no-trace"], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not wait_for_daemon(f"ipc://{rt / 'daemon.sock'}", 30.0):
            raise RuntimeError("the daemon did not start")
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.reps):
            for wrapped in (False, True):
                runs[wrapped].append(once(wrapped, env, tmp, args))
    finally:
        daemon.terminate()
        daemon.wait(10)
    report(runs, args)


def report(runs, args) -> None:
    t = Table(title=f"one pipeline alone, {args.steps} steps × 5 sub-stages × {args.work_ms:g} ms, "
                    f"median of {args.reps}")
    for col in ("", "bare", "under jigsaw run", "overhead"):
        t.add_column(col, justify="right")
    for i, label in ((0, "steps' time s"), (1, "whole command s")):
        bare = statistics.median(r[i] for r in runs[False])
        wrapped = statistics.median(r[i] for r in runs[True])
        t.add_row(label, f"{bare:.3f}", f"{wrapped:.3f}", f"{wrapped / bare - 1:+.1%}")
    Console().print(t)


if __name__ == "__main__":
    main()
