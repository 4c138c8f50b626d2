"""One GRPO step's pieces, for the synchronous recipe (grpo.py) and the asynchronous one
(async_grpo.py) alike.

    generate   batch n: the DP workers' rollout, one Rollout (client-side bucketing) per worker
               bound to its grants (_rollout; tool turns: agentic.py) ─► the host reward
    train      batch n's reference log-probs and GRPO update, the trainer's ranks as a gang
               (_trainer_stage), each member's numbers reported from its share (_report)
    long_tail_caps  each request's length cap: the same for the same seed and step, so every
               mode of a comparison does the same work
"""

from __future__ import annotations

import contextlib
import random
import sys

LONG_TAIL_MEDIAN_FRAC = 0.2
LONG_TAIL_SIGMA = 1.0


def lengths(samples) -> list[tuple[int, int]]:
    """(prompt, response) tokens of each sample; an answer that ends at once still generated
    its end-of-sequence token."""
    return [(len(s.prompt_ids), max(1, len(s.output_ids))) for s in samples]


def generate(cfg, step, client, dp, task, tok, params: int, on_poll=None) -> list:
    """Batch `step`'s samples: rollout (and tool turns) ─► reward, as `client`'s sub-stages;
    `on_poll(dp)` runs beside the rollout's own poll (a fully async recipe loads new weights)."""
    from jigsaw.engines.grpo import Sample

    items = [it for it in task.prompts(cfg.prompts, step) for _ in range(cfg.group)]
    prompts = [(f"{step}-{i}", tuple(tok(text)["input_ids"])) for i, (text, _) in enumerate(items)]
    if cfg.tool_turns > 1:
        from jigsaw.engines.sandbox import SandboxConfig
        from jigsaw.recipes import agentic

        turns = agentic.rollout(cfg, step, client, dp, prompts, [it for _, it in items], tok,
                                SandboxConfig(timeout_s=cfg.tool_timeout_s),
                                lambda ps, turn: _rollout(cfg, step, client, dp, ps, params, turn=turn,
                                                          on_poll=on_poll),
                                say=log_as(client.pipeline))
        rolled = [(t.prompt_ids, tuple(t.output_ids), tuple(t.logprobs), tuple(t.loss_mask), t.last_turn)
                  for t in turns]
    else:
        rolled = [(c.prompt_ids, c.output_ids, c.logprobs, None, c.output_ids)
                  for c in _rollout(cfg, step, client, dp, prompts, params, on_poll=on_poll)]
    with client.substage("reward", step=step):  # the answer of the last turn is scored
        texts = tok.batch_decode([r[4] for r in rolled], skip_special_tokens=True)
        return [Sample(prompt_ids=p, output_ids=o, reward=task.reward(t, item), old_logprobs=lp, loss_mask=m)
                for (p, o, lp, m, _), t, (_, item) in zip(rolled, texts, items)]


def train(cfg, step, client, trainer, samples, params: int) -> dict:
    """Reference log-probs and the GRPO update of `samples`, as `client`'s gangs; its metrics."""
    seq = [len(s.prompt_ids) + len(s.output_ids) for s in samples]
    with _trainer_stage(client, "reference", step, cfg, trainer.pids()) as grants:
        shares = gang_shares(grants, len(samples))
        ref = trainer.reference_logprobs(samples, shares)
        _report(grants, shares, seq, 2.0 * params)  # forward: 2 FLOPs/param/token
    with _trainer_stage(client, "training", step, cfg, trainer.pids()) as grants:
        shares = gang_shares(grants, len(samples))
        metrics = trainer.train_step(samples, ref, group_size=cfg.group, shares=shares)
        _report(grants, shares, seq, 6.0 * params)  # forward + backward
    return metrics


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


def _rollout(cfg, step, client, dp, prompts, params: int, turn: int = 0, on_poll=None):
    """Generation, one Rollout (client-side bucketing) per DP worker, bound to its grants."""
    routing = None
    rollouts = [client.rollout(dp_rank=r, step=step, pids=(dp.pids[r],)) for r in range(dp.num_workers)]
    for ro in rollouts:
        ro.flops_per_token = 2.0 * params  # forward FLOPs per token, for MFU in the trace
    for r, ro in enumerate(rollouts):  # the first regime waits for admission before any work
        ro.start(sum(len(p) for _, p in prompts[r::dp.num_workers]))
        routing = ro.grant.routing or routing
    moved: set[tuple[int, int]] = set()

    def poll(d) -> None:
        if on_poll is not None:
            on_poll(d)
        total = len(prompts)
        if any(ro.progress(d.held[r]) for r, ro in enumerate(rollouts) if not ro.closed):
            client.samples(step, total - len(d.pending()), total)
        for r, ro in enumerate(rollouts):
            for m in ro.grant.migrations if ro.grant is not None else ():
                src, dst = m.source_rank + ro.rank_offset, m.target_rank + ro.rank_offset
                if src == r and (src, dst) not in moved:
                    moved.add((src, dst))
                    d.migrate(src, dst)
                    ro.close()  # its requests went to the target: this worker's rollout is over

    try:
        done = dp.generate(prompts, _caps(cfg, step, len(prompts), turn), routing=routing,
                           on_step=lambda r, fs: rollouts[r].forward(fs.num_prefill_tokens, fs.num_decode_reqs,
                                                                     fs.kv_tokens),
                           on_poll=poll)
    finally:
        for ro in rollouts:
            ro.close()
    client.lengths(len(c.output_ids) for c in done)  # how long responses run: the next tails' residual life
    return done


def log_as(name: str):
    """A pipeline's log: each line to stderr, prefixed with its name."""
    return lambda line: print(f"[{name}] {line}", file=sys.stderr, flush=True)
