"""A toy RL pipeline doing real CPU work through the jigsaw client API (for tests and bench).

    for step: rollout_prefill ─► rollout_decode ─► rollout_tail ─► reference ─► training
              each sub-stage: admitted by the daemon (or exclusively without one), then
              `--work-ms` of numpy matmuls; one line per finished sub-stage in --out

The --out file is the proof of work: every (step, sub-stage) must appear exactly once.
"""

import argparse
import os
import time

import numpy as np

from jigsaw.runtime.client import connect

KINDS = ("rollout_prefill", "rollout_decode", "rollout_tail", "reference", "training")


def burn(ms: float) -> int:
    a = np.ones((96, 96))
    n, end = 0, time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        a = a @ a * 1e-3 + 1.0
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--work-ms", type=float, default=100.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gap-ms", type=float, default=0.0, help="host time before each sub-stage (holds no device)")
    ap.add_argument("--pause-file", help="wait for this file to exist before each sub-stage's work")
    ap.add_argument("--pause-timeout-s", type=float, default=300.0, help="exit 1 if --pause-file is not there by then")
    ap.add_argument("--elapsed-out", help="write the seconds the steps took here")
    ap.add_argument("--waits-out", help="append 'monotonic-start waited-s exclusive' per sub-stage here")
    args = ap.parse_args()
    client = connect()
    t0 = time.perf_counter()
    waits = open(args.waits_out, "a", buffering=1) if args.waits_out else None
    with open(args.out, "a", buffering=1) as out:
        for step in range(args.steps):
            for kind in KINDS:
                time.sleep(args.gap_ms / 1e3)
                with client.substage(kind, dp_rank=0, step=step, urgent=kind.startswith("rollout_")
                                     and kind != "rollout_prefill") as grant:
                    paused_until = time.monotonic() + args.pause_timeout_s
                    while args.pause_file and not os.path.exists(args.pause_file):
                        if time.monotonic() > paused_until:  # the test that paused it is gone
                            raise SystemExit(f"{args.pause_file} not there after {args.pause_timeout_s:g} s")
                        time.sleep(0.02)
                    n = burn(args.work_ms)
                    grant.report(num_tokens=n, flops=2 * 96**3 * n)
                out.write(f"{step} {kind} {grant.substage or '-'} {grant.sm_frac:g} {int(grant.exclusive)}\n")
                if waits is not None:
                    waits.write(f"{grant.started_s:.6f} {grant.waited_s:.6f} {int(grant.exclusive)}\n")
            client.step_end(step, tokens=args.steps, samples=1)
    if args.elapsed_out:
        with open(args.elapsed_out, "w") as f:
            f.write(f"{time.perf_counter() - t0:.6f}\n")
    client.close()


if __name__ == "__main__":
    main()
