"""A GRPO-shaped pipeline on one GPU that applies its grants: the GPU twin of recipes/grpo.py.

    python -m jigsaw.recipes.gpu_grpo --seed 1 --steps 4 [--result R.json]   (alone, or under `jigsaw run`)

    model: Qwen3ForCausalLM from Qwen3-0.6B's shape (random bf16 weights, `--layers` of its 28;
           nothing is downloaded); `--model tiny` is a small fp32 one for CPU dry runs
    per step:
      rollout    `prompts` random prompts × `group`, sampled one forward per token; each request
                 stops at its own long-tail cap and leaves the batch (KV rows dropped), so a
                 step's rollout runs prefill ─► decode ─► tail.  Every forward runs under
                 bind.on_stream(the rollout grant's stream AT THAT FORWARD) and its shape goes to
                 client.rollout(...).forward(), which turns regimes into sub-stages
      reward     host: a rule on the tokens (timing needs no verifier)
      reference  forward, no grad   ┐ micro-batches of `micro_batch` sequences, each under
      training   forward + backward ┘ bind.on_stream(grant.stream) read again before it,
                 then one AdamW step
    ─► result JSON in recipes/grpo.py's shape (steps with start_s, end_s, tokens, latency_s),
       what `jigsaw demo --framework gpu` sums up

A budget change the daemon sends while a sub-stage runs re-binds the grant (runtime/client.py);
the next forward or micro-batch launches on the new stream.  Without a daemon every grant is
exclusive: the current stream, the whole device.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from jigsaw.mux.partition.bind import on_stream
from jigsaw.recipes.grpo_step import long_tail_caps

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, vocab_size=151936, rope_theta=1_000_000.0, tie_word_embeddings=True)
"""Qwen3-0.6B's config.json (28 layers), less what `--layers` sets."""
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, tie_word_embeddings=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuRecipeConfig:
    """One GRPO-shaped pipeline on one GPU."""

    steps: int = 4
    """RL steps."""
    prompts: int = 16
    """Prompts per step."""
    group: int = 4
    """Responses per prompt."""
    prompt_tokens: int = 64
    """Tokens of every prompt (random ids)."""
    max_new_tokens: int = 128
    """Response budget; each request's own cap is drawn from a lognormal below it (a long tail)."""
    micro_batch: int = 16
    """Sequences per reference / training micro-batch.  (A grant's micro_batch is a gang member's
    share of the batch, for trainers of several ranks; this pipeline's trainer is one process.)"""
    model: str = "qwen3-0.6b"
    """qwen3-0.6b (its shape, random weights, bf16) | tiny (fp32, for CPU dry runs)."""
    layers: int = 8
    """Decoder layers instantiated (Qwen3-0.6B has 28)."""
    device: str = "cuda"
    """cuda | cpu."""
    seed: int = 0
    """Weights, prompts, sampling and length caps."""
    name: str | None = None
    """Pipeline name; if unset, $JIGSAW_PIPELINE or gpu-grpo-seed<seed>."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """One GRPO-shaped pipeline on a GPU, applying the grants of a jigsaw daemon when run under `jigsaw run`."""

    recipe: tyro.conf.OmitArgPrefixes[GpuRecipeConfig] = GpuRecipeConfig()
    result: Path | None = None
    """Write the per-step results here (JSON)."""


def main(argv=None) -> int:
    args = tyro.cli(Args, args=argv)
    doc = run(args.recipe)
    if args.result:
        args.result.write_text(json.dumps(doc, indent=1))
    return 0


def run(cfg: GpuRecipeConfig) -> dict:
    import os

    import torch

    from jigsaw.recipes.start_gate import wait_at_gate
    from jigsaw.runtime.client import connect

    name = cfg.name or os.environ.get("JIGSAW_PIPELINE") or f"gpu-grpo-seed{cfg.seed}"
    client = connect(pipeline=name, steps=cfg.steps, max_tokens=cfg.max_new_tokens)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    params = sum(p.numel() for p in model.parameters())
    say = lambda line: print(f"[{name}] {line}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"{'under the jigsaw daemon' if client.connected else 'alone (no daemon)'}; {cfg.model} × {cfg.layers} "
        f"layers ({params / 1e6:.0f} M parameters) on {cfg.device}")
    steps = []
    for step in range(cfg.steps):
        wait_at_gate(say, step=step)
        steps.append(_step(cfg, step, client, model, opt, params))
        say(f"step {step}: {steps[-1]['latency_s']:.2f} s, {steps[-1]['tokens']} tokens")
    client.close()
    return {"name": name, "steps": steps, "tokens": sum(s["tokens"] for s in steps),
            "start_s": steps[0]["start_s"] if steps else 0.0, "end_s": steps[-1]["end_s"] if steps else 0.0,
            "fell_open": [{k: v for k, v in rec.items() if k != "reported"} for rec in client.fallen_open]}


def build_model(cfg: GpuRecipeConfig):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = {"qwen3-0.6b": QWEN3_06B, "tiny": TINY}.get(cfg.model)
    if shape is None:
        raise ValueError(f"unknown model {cfg.model!r}: qwen3-0.6b or tiny")
    config = Qwen3Config(**shape, num_hidden_layers=cfg.layers,
                         max_position_embeddings=cfg.prompt_tokens + cfg.max_new_tokens + 8)
    dtype = torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32
    with torch.device(cfg.device):  # initialised where it runs: seconds less per process start on a GPU
        return Qwen3ForCausalLM(config).to(dtype=dtype)


def _step(cfg: GpuRecipeConfig, step: int, client, model, opt, params: int) -> dict:
    import torch

    start = time.time()
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed * 100_003 + step)
    n = cfg.prompts * cfg.group
    prompts = torch.randint(0, model.config.vocab_size, (n, cfg.prompt_tokens), generator=gen).to(cfg.device)
    outputs = rollout(cfg, step, client, model, prompts, long_tail_caps(cfg.seed, step, n, cfg.max_new_tokens), params)
    with client.substage("reward", step=step):
        rewards = torch.tensor([float(len(o) % 3 == 0) for o in outputs])  # a rule on the tokens
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    seqs = [torch.cat([p, o]) for p, o in zip(prompts, outputs)]
    seq_tokens = sum(len(s) for s in seqs)
    with client.substage("reference", step=step) as g:
        for mb in _micro_batches(seqs, cfg.micro_batch):
            with torch.no_grad(), on_stream(g.stream):
                model(input_ids=_pad(mb)).logits.float().mean()
        g.report(num_tokens=seq_tokens, batch_size=n, flops=2.0 * params * seq_tokens)
    with client.substage("training", step=step) as g:
        opt.zero_grad(set_to_none=True)
        for mb, a in zip(_micro_batches(seqs, cfg.micro_batch), _micro_batches(list(adv), cfg.micro_batch)):
            with on_stream(g.stream):
                logits = model(input_ids=_pad(mb)).logits
                (-(logits.float().logsumexp(-1).mean(-1) * torch.stack(a).to(logits.device)).mean()).backward()
        with on_stream(g.stream):
            opt.step()
        g.report(num_tokens=seq_tokens, batch_size=n, flops=6.0 * params * seq_tokens)
    tokens = sum(len(o) for o in outputs)
    client.step_end(step, tokens=tokens, samples=n)
    end = time.time()
    return {"step": step, "latency_s": end - start, "tokens": tokens, "start_s": start, "end_s": end}


def rollout(cfg: GpuRecipeConfig, step: int, client, model, prompts, lengths: list[int], params: int) -> list:
    """Sampled decoding, one forward per token; a request leaves the batch at its cap."""
    import torch
    from transformers import DynamicCache

    n = prompts.shape[0]
    out: list[list] = [[] for _ in range(n)]
    live = list(range(n))
    cache = DynamicCache()
    with client.rollout(step=step) as ro:
        ro.flops_per_token = 2.0 * params
        ro.start(n * cfg.prompt_tokens)
        ids, kv = prompts, 0
        while live:
            prefill = ids.shape[1] > 1
            grant = ro.forward(ids.numel() if prefill else 0, 0 if prefill else len(live), kv)  # may switch regime
            with torch.no_grad(), on_stream(grant.stream if grant is not None else None):
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].float()
            nxt = torch.multinomial(torch.softmax(logits, -1), 1)
            for row, rid in enumerate(live):
                out[rid].append(nxt[row])
            keep = [row for row, rid in enumerate(live) if len(out[rid]) < lengths[rid]]
            if len(keep) < len(live) and keep:
                cache.reorder_cache(torch.tensor(keep, device=nxt.device))  # the finished leave the batch
            live = [live[row] for row in keep]
            ids = nxt[keep]
            kv = len(live) * (cache.get_seq_length() + 1)
    return [torch.cat(o) for o in out]


def _micro_batches(items: list, size: int):
    return (items[i:i + size] for i in range(0, len(items), max(1, size)))


def _pad(seqs: list):
    import torch

    width = max(len(s) for s in seqs)
    return torch.stack([torch.nn.functional.pad(s, (0, width - len(s))) for s in seqs])


if __name__ == "__main__":
    sys.exit(main())

