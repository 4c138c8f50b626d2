"""Workload specs: what one simulated RL pipeline generates and trains on.

    jigsaw/sim/workloads/<name>.toml ─tomllib─► WorkloadSpec (validated; every parameter has
        │                                        a provenance entry: paper table, figure or trace)
        ▼
    sample_step(spec, rng) ─► prompts × group samples: prompt tokens, per-turn response
                              tokens, tool latency and tool output tokens per turn

Response lengths follow a two-level lognormal (RollPacker's simulation recipe): each
prompt draws a difficulty scale, each of its responses a length around that scale,
clipped at the generation cap.  That gives the long tails and the within-group
correlation that make some DP workers finish much later than others.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from jigsaw.mux.prior import DEVICES, MODELS


@dataclass(frozen=True, kw_only=True, slots=True)
class Lengths:
    """Generated tokens of one turn of one response."""

    median_tokens: float
    """Median over all responses."""
    prompt_sigma: float
    """Log-space spread of the per-prompt difficulty scale."""
    response_sigma: float
    """Log-space spread of one prompt's responses around its scale."""
    max_tokens: int = 8192
    """Generation cap per response (JigsawRL §5.1: 8192)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Turns:
    """How many generation turns a sample takes."""

    probs: tuple[float, ...] = (1.0,)
    """probs[k] = P(k + 1 turns)."""
    context_tokens: int = 0
    """Tokens appended before every later turn (feedback or tool output), median."""
    context_sigma: float = 0.0
    """Log-space spread of those tokens."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tool:
    """External tool called between turns (Search-R1's retrieval); none if latency is 0."""

    latency_s: float = 0.0
    """Median wall time of one call."""
    latency_sigma: float = 0.0
    """Log-space spread of the call time."""
    blocking: bool = False
    """Calls are batched per worker: a turn's tool call waits for every request of the worker
    to reach it (JigsawRL §3.1, 'blocked tool calls')."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadSpec:
    """One GRPO pipeline: model, deployment, batch and the statistics of what it generates."""

    name: str
    """Workload id (the file name)."""
    description: str
    """One line for tables and --help."""
    model: str
    """Model id in jigsaw.mux.prior.MODELS."""
    device: str
    """Device id in jigsaw.mux.prior.DEVICES ('h100', 'a100')."""
    gpus: int
    """GPUs of the deployment the workload was measured on (DP degree × rollout TP)."""
    rollout_tp: int = 1
    """Tensor parallelism of the rollout engine."""
    prompts: int = 64
    """Prompts per step (JigsawRL §5.1: global batch 64)."""
    group: int = 4
    """Responses per prompt (JigsawRL §5.1: group size 4)."""
    prompt_tokens: float = 150.0
    """Median prompt length."""
    prompt_sigma: float = 0.3
    """Log-space spread of prompt lengths."""
    lengths: Lengths
    """Response tokens per turn."""
    turns: Turns = field(default_factory=Turns)
    """Multi-turn structure."""
    tool: Tool = field(default_factory=Tool)
    """Tool calls between turns."""
    reward_s_per_sample: float = 0.0005
    """Host time of the rule-based reward per sample (negligible, JigsawRL Table 1 note)."""
    mini_batch_prompts: int = 16
    """Prompts per PPO mini-batch (verl `ppo_mini_batch_size`): one optimizer update each."""
    micro_batch_seqs: int = 8
    """Sequences per training micro-batch per GPU (verl `ppo_micro_batch_size_per_gpu`)."""
    logprob_micro_batch_seqs: int = 16
    """Sequences per log-prob micro-batch per GPU (verl `log_prob_micro_batch_size_per_gpu`)."""
    gradient_checkpointing: bool = False
    """Activation recompute in training (verl `enable_gradient_checkpointing`): four
    forward-equivalents per trained token instead of three."""
    provenance: dict[str, str] = field(default_factory=dict)
    """Source of every parameter: 'parameter.path' -> paper table / figure / trace."""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def samples(self) -> int:
        return self.prompts * self.group


def _check(w: WorkloadSpec) -> None:
    where = f"workload {w.name!r}"
    if w.model not in MODELS:
        raise ValueError(f"{where}: model {w.model!r} unknown; known: {sorted(MODELS)}")
    if w.device not in DEVICES:
        raise ValueError(f"{where}: device {w.device!r} unknown; known: {sorted(DEVICES)}")
    if w.gpus < 1 or w.rollout_tp < 1 or w.gpus % w.rollout_tp:
        raise ValueError(f"{where}: gpus ({w.gpus}) must be a positive multiple of rollout_tp ({w.rollout_tp})")
    if min(w.mini_batch_prompts, w.micro_batch_seqs, w.logprob_micro_batch_seqs) < 1:
        raise ValueError(f"{where}: mini/micro batch sizes must be >= 1")
    if w.prompts < 1 or w.group < 1 or w.lengths.median_tokens <= 0 or w.lengths.max_tokens < 1:
        raise ValueError(f"{where}: prompts, group, median and max tokens must be positive")
    p = w.turns.probs
    if not p or any(x < 0 for x in p) or abs(sum(p) - 1.0) > 1e-6:
        raise ValueError(f"{where}: turns.probs must be non-negative and sum to 1, got {p}")
    missing = sorted(set(parameter_paths(w)) - set(w.provenance))
    if missing:
        raise ValueError(f"{where}: no provenance for {missing}")


def parameter_paths(w: WorkloadSpec) -> list[str]:
    """Every parameter that needs a source: leaf fields except name/description/provenance."""
    out = []
    for f in dataclasses.fields(w):
        if f.name in ("name", "description", "provenance"):
            continue
        value = getattr(w, f.name)
        if dataclasses.is_dataclass(value):
            out += [f"{f.name}.{g.name}" for g in dataclasses.fields(value)]
        else:
            out.append(f.name)
    return out


# ---------------------------------------------------------------- files

WORKLOAD_DIR = "workloads"


def load(path: str | Path) -> WorkloadSpec:
    """A workload from a TOML file (see jigsaw/sim/workloads/README.md)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    try:
        return from_dict(raw, name=path.stem)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def from_dict(raw: dict, *, name: str) -> WorkloadSpec:
    raw = dict(raw)
    sections = {"lengths": Lengths, "turns": Turns, "tool": Tool}
    for key, cls in sections.items():
        if key in raw:
            sub = dict(raw[key])
            if key == "turns" and "probs" in sub:
                sub["probs"] = tuple(sub["probs"])
            raw[key] = cls(**sub)
    raw.setdefault("name", name)
    return WorkloadSpec(**raw)


def shipped() -> dict[str, Path]:
    """Workloads shipped with jigsaw, by name."""
    base = resources.files("jigsaw.sim").joinpath(WORKLOAD_DIR)
    return {p.name[:-5]: Path(str(p)) for p in base.iterdir() if p.name.endswith(".toml")}


def get(name_or_path: str) -> WorkloadSpec:
    """A shipped workload by name, or a TOML file by path."""
    known = shipped()
    if name_or_path in known:
        return load(known[name_or_path])
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.exists():
        return load(path)
    raise KeyError(f"unknown workload {name_or_path!r}; shipped: {', '.join(sorted(known))}")


# ---------------------------------------------------------------- sampling

@dataclass(frozen=True, slots=True)
class StepSamples:
    """What one RL step generates, sample-major (sample i belongs to prompt i // group)."""

    prompt_tokens: np.ndarray
    """(samples,) prompt length of each sample."""
    turn_tokens: list[np.ndarray]
    """Per sample: generated tokens of each turn."""
    context_tokens: list[np.ndarray]
    """Per sample: tokens appended before each later turn (len = turns - 1)."""
    tool_s: list[np.ndarray]
    """Per sample: tool latency before each later turn (len = turns - 1; zeros without a tool)."""
    prompt_scale: np.ndarray
    """(prompts,) difficulty scale, kept so a deferred prompt can be re-sampled (tail batching)."""


def sample_step(w: WorkloadSpec, rng: np.random.Generator, prompt_scale: np.ndarray | None = None) -> StepSamples:
    """Draw one step's samples; `prompt_scale` re-uses given prompts' difficulty."""
    L = w.lengths
    n_prompts = w.prompts if prompt_scale is None else len(prompt_scale)
    if prompt_scale is None:
        prompt_scale = L.median_tokens * np.exp(rng.normal(0.0, L.prompt_sigma, n_prompts))
    scale = np.repeat(prompt_scale, w.group)
    n = len(scale)
    prompts = np.maximum(1, np.round(w.prompt_tokens * np.exp(rng.normal(0.0, w.prompt_sigma, n)))).astype(int)
    turns = rng.choice(len(w.turns.probs), size=n, p=np.asarray(w.turns.probs)) + 1
    turn_tokens, ctx, tool = [], [], []
    for i in range(n):
        drawn = np.minimum(L.max_tokens, scale[i] * np.exp(rng.normal(0.0, L.response_sigma, int(turns[i]))))
        turn_tokens.append(_within_cap(np.maximum(1, np.round(drawn)).astype(int), L.max_tokens))
        k = len(turn_tokens[-1])
        ctx.append(np.round(w.turns.context_tokens * np.exp(rng.normal(0.0, w.turns.context_sigma, k - 1)))
                   .astype(int))
        tool.append(w.tool.latency_s * np.exp(rng.normal(0.0, w.tool.latency_sigma, k - 1)) if w.tool.latency_s
                    else np.zeros(k - 1))
    return StepSamples(prompt_tokens=prompts, turn_tokens=turn_tokens, context_tokens=ctx, tool_s=tool,
                       prompt_scale=prompt_scale)


def _within_cap(turns: np.ndarray, cap: int) -> np.ndarray:
    """The cap bounds a whole response: later turns are cut once the total reaches it."""
    total = np.cumsum(turns)
    if total[-1] <= cap:
        return turns
    keep = int(np.searchsorted(total, cap, side="left")) + 1
    out = turns[:keep].copy()
    out[-1] -= int(total[keep - 1] - cap)
    return out[out > 0] if np.any(out > 0) else out[:1]
