"""Verifiable rewards for the CPU GRPO pipelines.

    ReasoningGymTask(name, size, seed) ─► prompts(n, step) ─► [(prompt text, item)] ─► rollout
        rollout's completion text ─► extract_answer ─► dataset.score_answer(answer, item) ─► reward
    TargetTokenReward(token_id) ─► reward(output_ids) = share of output tokens equal to token_id

reasoning-gym generates its items offline and deterministically from (name, size, seed), so a
step's prompts are a pure function of (seed, step). TargetTokenReward is the task a tiny
random model can visibly learn in a few dozen steps (a check that the RL loop learns at all).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_ANSWER_TAG = "answer:"
INSTRUCTION = "Answer with a number only, as 'Answer: <number>'."
"""Appended to every question so a completion ends in something extract_answer finds."""


def extract_answer(completion_text: str) -> str | None:
    """The text after the last "Answer:" (case-insensitive), else the last number; None if none.

    Thousands separators are dropped ("28,080" → "28080"), since the scorers parse floats.
    """
    lowered = completion_text.lower()
    cut = lowered.rfind(_ANSWER_TAG)
    if cut >= 0:
        tail = completion_text[cut + len(_ANSWER_TAG):].strip().splitlines()
        found = _NUMBER.search(tail[0]) if tail else None
        if found:
            return found.group(0).replace(",", "")
        return tail[0].strip() if tail else None
    numbers = _NUMBER.findall(completion_text)
    return numbers[-1].replace(",", "") if numbers else None


class ReasoningGymTask:
    """Prompts and rewards from one reasoning-gym generator (e.g. basic_arithmetic, gsm_symbolic)."""

    def __init__(self, name: str = "basic_arithmetic", size: int = 1000, seed: int = 0):
        import reasoning_gym  # imported late: 0.8 s, and only the recipes need it

        self.name, self.size, self.seed = name, size, seed
        self.dataset = reasoning_gym.create_dataset(name, size=size, seed=seed)

    def prompts(self, n: int, step: int) -> list[tuple[str, dict[str, Any]]]:
        """Step `step`'s n (prompt text, item) pairs: the items [step·n, step·n + n) of the
        dataset, wrapping around, so consecutive steps see new questions until it is used up."""
        items = [self.dataset[(step * n + i) % self.size] for i in range(n)]
        return [(f"{item['question']} {INSTRUCTION}", item) for item in items]

    def reward(self, completion_text: str, item: dict[str, Any]) -> float:
        """The dataset's own score of the extracted answer (1.0 exact; 0.0 when none found)."""
        answer = extract_answer(completion_text)
        if answer is None:
            return 0.0
        return float(self.dataset.score_answer(answer, item))


class TargetTokenReward:
    """Reward = fraction of output tokens equal to `token_id` (0.0 for an empty output)."""

    def __init__(self, token_id: int):
        self.token_id = token_id

    def reward(self, output_ids: Sequence[int]) -> float:
        if not output_ids:
            return 0.0
        return sum(1 for t in output_ids if t == self.token_id) / len(output_ids)
