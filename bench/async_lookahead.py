"""The look-ahead with and without the sample buffer of an asynchronous job in view (not a test).

    family × --count instances (drawn from --seed): an asynchronous job J (rollout side "J",
        training side "J.train", its staleness bound) beside a synchronous pipeline B, on 2 GPUs
        of the shipped H100 / Qwen3-4B prior, durations drawn per round
      ├─ told:  J's sides say their mode: the node links them through the buffer
      │         (node/jobs.py), the look-ahead sees training wait for its batch and a round
      │         for its weights, and counts on an idle side's next step
      ├─ blind: the same sides, their mode unsaid (what the look-ahead saw before)
      └─ static: each pipeline pinned to its own share of every device (the free baseline)
    the graph executor (sim/execute.py) holds the buffer in every run; per family: blind's
    makespan over told's (mean, min, max; told wins / ties / loses) and static's over told's

Usage:  python bench/async_lookahead.py [--count 32] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from factories import GIB, rollout, training  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from jigsaw.graph.plan import NodeSpec, PipelineState  # noqa: E402
from jigsaw.graph.policies import make  # noqa: E402
from jigsaw.mux.model.slowdown import load_grid  # noqa: E402
from jigsaw.sim.execute import execute  # noqa: E402

GRID = load_grid("h100/qwen3-4b")
NODE = NodeSpec(num_devices=2, mem_bytes=80 * GIB)
TIE = 1e-6


@dataclass(frozen=True)
class Family:
    name: str
    staleness: int
    roll_devices: tuple[int, ...]
    train_devices: tuple[int, ...]
    """Where J's sides run; B runs on both devices."""


FAMILIES = (
    Family("one-step-off, sides apart", 1, (0,), (1,)),
    Family("one-step-off, sides together", 1, (0,), (0,)),
    Family("bound 2, sides apart", 2, (0,), (1,)),
    Family("bound 0, sides apart", 0, (0,), (1,)),
)


def instance(fam: Family, rng: random.Random, steps: int = 3) -> list[PipelineState]:
    """J (rollout rounds with a long tail; training steps of 3-9 s, scaled) and B (2 workers)."""
    def draw(lo: float, hi: float, scale: float = 1.0) -> list[float]:
        return [rng.uniform(lo, hi) * scale for _ in range(steps)]

    roll, train = rng.choice((0.5, 1.0, 2.0)), rng.choice((0.5, 1.0, 2.0))
    return [PipelineState(graph=rollout("J", steps, draw(2, 6, roll), draw(1, 8, roll)), devices=fam.roll_devices),
            PipelineState(graph=training("J.train", steps, draw(3, 9, train)), devices=fam.train_devices),
            PipelineState(graph=rollout("B", steps, draw(2, 6), draw(1, 8), ranks=2, train_s=draw(3, 9)),
                          devices=(0, 1))]


def run(pipes: list[PipelineState], fam: Family, told: bool, policy: str = "jigsaw") -> float:
    jobs = {"J": ("one-step-off" if told else "", fam.staleness)}
    return execute(pipes, NODE, GRID, policy=make(policy), jobs=jobs).makespan_s


def measure(fam: Family, count: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(f"{fam.name}/{seed}")
    out: dict[str, list[float]] = {"blind": [], "static": []}
    for _ in range(count):
        pipes = instance(fam, rng)
        told = run(pipes, fam, True)
        out["blind"].append(run(pipes, fam, False) / told)
        out["static"].append(run(pipes, fam, True, "static") / told)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=32, help="instances per family")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="4 instances of the first family")
    args = ap.parse_args()
    fams, count = (FAMILIES[:1], 4) if args.quick else (FAMILIES, args.count)
    console, t0 = Console(width=120), time.perf_counter()
    table = Table(title=f"the look-ahead with the buffer in view: {count} instances per family, 2 GPUs "
                        "(makespan over jigsaw's with it)")
    for col in ("family", "blind / told", "min", "max", "told wins / ties / loses", "static / told"):
        table.add_column(col, justify="left" if col == "family" else "right")
    for k, fam in enumerate(fams):
        got = measure(fam, count, args.seed)
        b = got["blind"]
        wins, ties = sum(r > 1 + TIE for r in b), sum(abs(r - 1) <= TIE for r in b)
        table.add_row(fam.name, f"{statistics.mean(b):.3f}", f"{min(b):.3f}", f"{max(b):.3f}",
                      f"{wins} / {ties} / {len(b) - wins - ties}", f"{statistics.mean(got['static']):.3f}")
        console.print(f"[{k + 1}/{len(fams)}] {fam.name}: blind {statistics.mean(b):.3f}× told's makespan")
    console.print(table)
    console.print(f"measured in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
