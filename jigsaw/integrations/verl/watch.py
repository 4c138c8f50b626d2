"""Time a verl job's steps from its own console log (the demo's and the bench's harness).

    python -m jigsaw.integrations.verl.watch --result R.json --rows 32 -- python -m verl.trainer.main_ppo ...
        CMD's output ─► echoed unchanged, each line stamped on arrival
        "step:N - k:v - k:v ..."  (verl's console logger, one line per step)
            end   = when the line arrived;  start = end - timing_s/step
            tokens = response_length/mean × rows;  stages = every timing_s/<stage>
        ─► R.json in the GRPO recipe's result layout (name, steps, tokens, start_s, end_s), so
           the demo's summary and report read a verl job like one of its own pipelines

Nothing is added to CMD: the numbers are verl's.  A step line reaches the driver through Ray's
log forwarding, so its end is late by that delay (the same in every mode).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

STEP_LINE = re.compile(r"step:(\d+) - (.*)")
METRIC = re.compile(r"([\w/@.\-]+):(np\.\w+\()?(-?[\d.eE+\-]+|nan|inf)\)?")


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Run CMD (after `--`), echo its output, and write its per-step timings as JSON."""

    result: Path
    """Where the per-step JSON goes."""
    rows: int
    """Responses per step (prompts × group): response tokens = response_length/mean × rows."""
    name: str = "verl"
    """The job's name in the result."""
    cmd: Annotated[tuple[str, ...], tyro.conf.Suppress] = ()


def parse_step(line: str) -> tuple[int, dict[str, float]] | None:
    """verl's console line of one step: (step, metrics), or None for any other line."""
    m = STEP_LINE.search(line)
    if m is None:
        return None
    metrics = {}
    for key, _, value in METRIC.findall(m.group(2)):
        try:
            metrics[key] = float(value)
        except ValueError:
            continue
    return int(m.group(1)), metrics


def step_record(step: int, metrics: dict[str, float], arrived_s: float, rows: int) -> dict:
    latency = metrics.get("timing_s/step", 0.0)
    return {"step": step, "latency_s": latency, "start_s": arrived_s - latency, "end_s": arrived_s,
            "tokens": round(metrics.get("response_length/mean", 0.0) * rows),
            "stages_s": {k.removeprefix("timing_s/"): v for k, v in metrics.items()
                         if k.startswith("timing_s/") and k != "timing_s/step"}}


def watch(args: Args) -> int:
    if not args.cmd:
        raise ValueError("jigsaw.integrations.verl.watch needs the verl command after `--`")
    proc = subprocess.Popen(list(args.cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", bufsize=1)
    steps = []
    for line in proc.stdout:
        arrived = time.time()
        sys.stdout.write(line)
        if (parsed := parse_step(line)) is not None:
            steps.append(step_record(*parsed, arrived, args.rows))
    rc = proc.wait()
    doc = {"name": args.name, "steps": steps, "tokens": sum(s["tokens"] for s in steps),
           "start_s": steps[0]["start_s"] if steps else 0.0, "end_s": steps[-1]["end_s"] if steps else 0.0,
           "returncode": rc}
    args.result.write_text(json.dumps(doc, indent=1))
    sys.stdout.flush()
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = tyro.cli(Args, args=argv[:cut])
    return watch(Args(result=args.result, rows=args.rows, name=args.name, cmd=tuple(argv[cut + 1:])))


if __name__ == "__main__":
    sys.exit(main())
