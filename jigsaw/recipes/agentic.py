"""Multi-turn rollout with a real code tool: model turns, a sandboxed Python call between two.

    step's prompts ─► turn 1: grpo_step._rollout (DP workers, regimes, grants, as one-turn GRPO)
      ─► per sample, the code of its turn: a ```python block it wrote, else the task's scaffold,
         print(<the question's expression>) (a random model never writes code)
      ─► per DP worker, one `tool` sub-stage (host work: the worker's device share is given
         back while its requests wait), its calls `tool_workers` at a time in the sandbox
         (engines/sandbox.py: no network, time/memory/output limits); the calls compute on
         this CPU (Admit.computes): on a CPU node they run on the cores no device sub-stage
         holds, and the pipeline keeps its share of the cores meanwhile
      ─► "Output: …" tokens appended: an observation, masked out of the loss
      ─► turn 2 on prompt + turn 1 + observation: the waiting request resumes with its whole
         context, prefilled again (its KV is not kept across the call) ─► … ─► last turn
    ─► one Completion-like Turns per sample: output = turns and observations interleaved,
       logprobs of sampled tokens (0.0 where given), loss mask, the tool calls' results

The reward scores the last turn's answer, as one-turn GRPO does.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from jigsaw.engines.sandbox import SandboxConfig, ToolResult, run_python

_FENCE = re.compile(r"```python\n(.*?)```", re.DOTALL)
MAX_OBSERVATION_CHARS = 200
"""A tool's output is cut to this before it becomes tokens of the next turn's context."""


@dataclass(slots=True)
class Turns:
    """One sample's rollout over its turns."""

    rid: str
    prompt_ids: tuple[int, ...]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    calls: list[ToolResult] = field(default_factory=list)
    last_turn: tuple[int, ...] = ()

    def add(self, ids, logprobs, sampled: bool) -> None:
        self.output_ids += ids
        self.logprobs += logprobs if sampled else [0.0] * len(ids)
        self.loss_mask += [int(sampled)] * len(ids)

    def context(self) -> tuple[int, ...]:
        return self.prompt_ids + tuple(self.output_ids)


def code_of(turn_text: str, item: dict) -> str:
    """The code a turn calls the tool with: its own ```python block, else the scaffold's."""
    block = _FENCE.search(turn_text)
    if block:
        return block.group(1)
    expression = (item.get("metadata") or {}).get("expression")
    return f"print({expression})" if expression else "print('no code')"


def observation(result: ToolResult) -> str:
    """The next turn's context from a tool call: what it printed, and how it ended."""
    return f"\nOutput: {result.feedback(MAX_OBSERVATION_CHARS)}\n"


def rollout(cfg, step: int, client, dp, prompts, items, tok, sandbox: SandboxConfig, generate,
            say=lambda line: None) -> list[Turns]:
    """Every sample over cfg.tool_turns turns; a tool call between two (module docstring).
    `generate(prompts, turn)`: one turn of every sample, as the recipe generates (grpo_step._rollout);
    `say`: the pipeline's log; every call cut off or failed gets a line there."""
    samples = [Turns(rid=rid, prompt_ids=tuple(ids)) for rid, ids in prompts]
    for turn in range(cfg.tool_turns):
        done = generate([(s.rid, s.context()) for s in samples], turn)
        for s, c in zip(samples, done):
            s.last_turn = tuple(c.output_ids)
            s.add(list(c.output_ids), list(c.logprobs), sampled=True)
        if turn + 1 < cfg.tool_turns:
            _tools(cfg, step, client, dp, samples, items, tok, sandbox, say)
    return samples


def _tools(cfg, step, client, dp, samples: list[Turns], items, tok, sandbox: SandboxConfig, say) -> None:
    """Each DP worker's tool calls in one tool sub-stage, the workers at once."""
    ranks = [dp.finished_on[s.rid] for s in samples]  # where its turn ended (migrations included)

    def worker(rank: int) -> None:
        mine = [(s, it) for s, it, r in zip(samples, items, ranks) if r == rank]
        with client.substage("tool", dp_rank=rank, step=step, computes=True):  # its sandboxes run here
            with ThreadPoolExecutor(max(1, cfg.tool_workers)) as pool:
                texts = [tok.decode(list(s.last_turn), skip_special_tokens=True) for s, _ in mine]
                results = list(pool.map(lambda a: run_python(code_of(a[0], a[1]), sandbox),
                                        zip(texts, [it for _, it in mine])))
        for (s, _), res in zip(mine, results):
            if res.status != "ok":
                say(f"tool call of {s.rid}: {res.status} after {res.wall_s:.2f} s "
                    f"({(res.feedback().splitlines() or [''])[-1][:80]})")
            s.calls.append(res)
            s.add(tok(observation(res))["input_ids"], [], sampled=False)

    with ThreadPoolExecutor(dp.num_workers, thread_name_prefix="tools") as workers:
        list(workers.map(worker, range(dp.num_workers)))  # the workers at once; a failure is raised here


__all__ = ["Turns", "code_of", "observation", "rollout"]
