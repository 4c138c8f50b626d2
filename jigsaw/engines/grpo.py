"""GRPO math on plain tensors: advantages, batch layout, per-token log-probs, the loss.

    rollout ─► Sample(prompt_ids, output_ids, reward, old_logprobs?) × (groups × group_size)
        │
        ├─► group_advantages(rewards, group_size)       (r - mean_group) / (std_group + eps)
        ▼
    collate(samples, pad_id)       one row per sample:  [pad … pad | prompt | output | pad … pad]
        │                                                 ◄─ P columns ─►◄─── R columns ───►
        ▼
    token_logprobs(model, input_ids, attention_mask, P) ─► [B, R] log p(output token | prefix)
        │
        ▼
    grpo_loss(logprobs, old, ref, advantages, response_mask)  PPO-clip + k3 KL, token mean

Prompts are left-padded and outputs right-padded to the widest of the batch, so the response
is always the fixed column block [P, P + R) and every per-token tensor is [B, R] with
`response_mask` marking real output tokens. Position ids count real tokens only, so a row's
log-probs do not depend on how much padding its batch needed (ranks and micro-batches pad
differently and must still agree). Nothing here is distributed.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class Sample:
    """One rollout: a prompt, the sampled continuation and its scalar reward."""

    prompt_ids: tuple[int, ...]
    """Prompt token ids (not empty)."""
    output_ids: tuple[int, ...]
    """Sampled response token ids."""
    reward: float
    """Scalar reward of the whole response."""
    old_logprobs: tuple[float, ...] | None = None
    """Sampling policy log-prob of each output token, when the rollout returned them."""
    loss_mask: tuple[int, ...] | None = None
    """Per output token, 1 where the policy sampled it, 0 where it was given (a tool's output
    between two turns): given tokens are context, never trained on.  None: all sampled."""

    def trained_tokens(self) -> int:
        return len(self.output_ids) if self.loss_mask is None else sum(self.loss_mask)


def group_advantages(rewards: Sequence[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """(r - mean of its group) / (population std of its group + eps); groups are consecutive.

    A group whose rewards are all equal gets advantage 0: it carries no preference signal.
    """
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start:start + group_size]]
        mean = statistics.fmean(group)
        std = statistics.pstdev(group, mu=mean)
        out.extend((r - mean) / (std + eps) for r in group)
    return out


def pad_rows(rows: Sequence[Sequence[float]], width: int, value: float = 0.0) -> Tensor:
    """[len(rows), width] float32, each row right-padded with `value` (the response layout)."""
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"row {i} has {len(row)} values for {width} response columns")
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def collate(samples: Sequence[Sample], pad_id: int) -> dict[str, Tensor]:
    """Tensors of one batch in the layout drawn in the module docstring.

    input_ids, attention_mask, position_ids: [B, P + R] (int64)
    response_mask: [B, R] float (1 on real output tokens the policy sampled: not on padding, nor
    on a tool's output between turns, `loss_mask`); rewards: [B] float
    num_prompt_tokens: 0-d int64 holding P
    old_logprobs: [B, R] float, only when every sample carries them
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    if any(not s.prompt_ids for s in samples):
        raise ValueError("every sample needs a non-empty prompt")
    width_p = max(len(s.prompt_ids) for s in samples)
    width_r = max(max(len(s.output_ids) for s in samples), 1)
    ids = torch.full((len(samples), width_p + width_r), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    response = torch.zeros(len(samples), width_r, dtype=torch.float32)
    for i, s in enumerate(samples):
        start, end = width_p - len(s.prompt_ids), width_p + len(s.output_ids)
        ids[i, start:end] = torch.tensor(s.prompt_ids + s.output_ids, dtype=torch.int64)
        mask[i, start:end] = 1
        if s.loss_mask is not None and len(s.loss_mask) != len(s.output_ids):
            raise ValueError(f"sample {i}: {len(s.loss_mask)} loss-mask entries for {len(s.output_ids)} output tokens")
        response[i, :len(s.output_ids)] = 1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
    batch = {
        "input_ids": ids, "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),  # count real tokens only
        "response_mask": response,
        "rewards": torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
        "num_prompt_tokens": torch.tensor(width_p, dtype=torch.int64),
    }
    have_old = [s.old_logprobs is not None for s in samples]
    if all(have_old):
        batch["old_logprobs"] = pad_rows([s.old_logprobs for s in samples], width_r)  # type: ignore[misc]
    elif any(have_old):
        raise ValueError("either every sample carries old_logprobs or none does")
    return batch


def token_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                   num_prompt_tokens: int | Tensor, position_ids: Tensor | None = None) -> Tensor:
    """[B, R] log-probs of tokens input_ids[:, P:] under `model` (P = num_prompt_tokens).

    Logits at column t predict the token at t + 1, so the response block [P, P + R) is scored
    by logits [P - 1, P + R - 1). Padded response columns hold junk: mask them.
    """
    width_p = int(num_prompt_tokens)
    if position_ids is None:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    logits = logits[:, width_p - 1:-1].float()
    targets = input_ids[:, width_p:]
    # log_softmax then gather: a [B, R, V] temporary, fine for the small vocabularies run here
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def grpo_loss(logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor, advantages: Tensor,
              response_mask: Tensor, clip_eps: float, kl_coef: float,
              num_tokens: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip objective on group-normalised advantages + kl_coef × k3 KL to the reference.

    logprobs / old / ref / response_mask: [B, R]; advantages: [B] (one per sequence).
    Per token: -min(ρA, clip(ρ, 1 ± clip_eps)A) + kl_coef (e^(ref-lp) - (ref-lp) - 1), with
    ρ = e^(lp - old). Summed over the mask and divided by `num_tokens` (default: the mask's
    sum): pass the whole batch's count so micro-batches and ranks add up to the batch mean.
    Metrics use the same divisor: loss, kl (mean k3), clip_frac (tokens whose gradient the
    clip removes: ρ > 1 + eps with A > 0, or ρ < 1 - eps with A < 0).
    """
    mask = response_mask.to(logprobs.dtype)
    real = mask > 0
    denom = float(num_tokens) if num_tokens is not None else max(float(mask.sum()), 1.0)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    # Padded columns hold junk log-probs: zero the exponents there first, so exp() cannot
    # overflow into inf * 0 = NaN, neither in the sum nor in its gradient.
    ratio = torch.exp(torch.where(real, logprobs - old_logprobs, 0.0))
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    policy = -torch.minimum(ratio * adv, clipped * adv)
    log_ref_ratio = torch.where(real, ref_logprobs - logprobs, 0.0)
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0  # k3: unbiased, always >= 0
    loss = ((policy + kl_coef * kl) * mask).sum() / denom
    with torch.no_grad():
        cut = ((ratio > 1.0 + clip_eps) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))
        metrics = {"loss": float(loss.detach()), "kl": float((kl * mask).sum() / denom),
                   "clip_frac": float((cut.to(mask.dtype) * mask).sum() / denom)}
    return loss, metrics
