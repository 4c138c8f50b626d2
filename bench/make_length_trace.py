"""Write the shipped empirical length trace (jigsaw/sim/workloads/qwen3-4b-longcot-empirical.jsonl).

    python bench/make_length_trace.py [--out PATH] [--seed 0]

    seed ─► numpy default_rng ─► 10 steps × 64 prompts × 8 responses ─► one JSON line per sample:
            {"step": k, "prompt_len": P, "response_len": R}   (sample i of a step: prompt i // 8)

The lengths are synthetic, shaped like a long-CoT math GRPO run (DAPO / DeepScaleR-style curves:
a bimodal response length, a pile-up at the cap, lengths growing as training proceeds):

    prompt p:    prompt_len  = round(180 · exp(N(0, 0.35)))       (shared by its 8 responses)
                 difficulty  = exp(N(0, 0.4))                     (two-level correlation)
    response:    with prob. 0.10 exactly the cap, 16384           (truncated reasoning)
                 otherwise a lognormal mixture, weights 0.55 / 0.45,
                   medians 2500 / 7000 tokens, log-spreads 0.45 / 0.35,
                 × difficulty × 1.01^step (drift), clipped to [1, 16384], rounded

Deterministic for a seed (numpy's PCG64 stream); the shipped file is seed 0.  The file is the
workload's ground truth: the simulator replays it exactly, it is not re-drawn from this recipe.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "jigsaw/sim/workloads/qwen3-4b-longcot-empirical.jsonl"
STEPS, PROMPTS, GROUP, CAP = 10, 64, 8, 16384
PROMPT_MEDIAN, PROMPT_SIGMA, DIFFICULTY_SIGMA = 180.0, 0.35, 0.4
WEIGHTS, MEDIANS, SIGMAS = (0.55, 0.45), (2500.0, 7000.0), (0.45, 0.35)
CAP_SPIKE, DRIFT = 0.10, 0.01


def step_records(rng: np.random.Generator, step: int) -> list[dict]:
    """One step's samples, prompt-major."""
    prompt_len = np.maximum(1, np.round(PROMPT_MEDIAN * np.exp(rng.normal(0.0, PROMPT_SIGMA, PROMPTS))))
    difficulty = np.repeat(np.exp(rng.normal(0.0, DIFFICULTY_SIGMA, PROMPTS)), GROUP)
    n = PROMPTS * GROUP
    comp = rng.choice(len(WEIGHTS), size=n, p=WEIGHTS)
    body = np.asarray(MEDIANS)[comp] * np.exp(np.asarray(SIGMAS)[comp] * rng.standard_normal(n))
    body = body * difficulty * (1.0 + DRIFT) ** step
    response = np.where(rng.random(n) < CAP_SPIKE, CAP, np.clip(np.round(body), 1, CAP)).astype(int)
    return [{"step": step, "prompt_len": int(prompt_len[i // GROUP]), "response_len": int(response[i])}
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    with open(args.out, "w") as fh:
        for step in range(STEPS):
            for rec in step_records(rng, step):
                fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
    print(f"wrote {STEPS * PROMPTS * GROUP} records to {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
