"""Records and sub-stages: the vocabulary every other module speaks.

    engine forward step ──► StepRecord ──(builder: buckets + hysteresis)──► SubStage
                                                                              │
                                  SubStageGraph (graph.py) ◄──────────────────┘

A `StepRecord` is one forward step of a rollout engine on one DP worker, or one
micro-batch of a reference / training pass.  A `SubStage` is a run of steps with a
uniform resource profile (paper §4.1): its kind says how it uses the device, its
numbers say how long it ran exclusively and how much memory it held.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Stage(enum.StrEnum):
    """Coarse RL stage a record belongs to (what verl would call a stage)."""

    ROLLOUT = "rollout"
    REFERENCE = "reference"
    TRAINING = "training"
    REWARD = "reward"
    TOOL = "tool"


class SubStageKind(enum.StrEnum):
    """Resource regime of a sub-stage; the slowdown grid is indexed by these names.

    The three rollout kinds are the paper's token buckets: tokens per forward =
    prefill tokens + active decode requests, `[0,128)` tail, `[128,1024)` large-batch
    decode, `[1024,∞)` prefill-heavy.
    """

    ROLLOUT_PREFILL = "rollout_prefill"
    ROLLOUT_DECODE = "rollout_decode"
    ROLLOUT_TAIL = "rollout_tail"
    REFERENCE = "reference"
    TRAINING = "training"
    REWARD = "reward"
    TOOL = "tool"

    @property
    def on_device(self) -> bool:
        """Whether the sub-stage occupies the accelerator (tool calls and rule-based
        rewards run on the host and leave the GPU idle)."""
        return self not in (SubStageKind.REWARD, SubStageKind.TOOL)

    @property
    def collective(self) -> bool:
        """Whether the DP replicas run in lockstep (FSDP collectives every layer), so
        the scheduler must start them together and the slowest replica sets the pace."""
        return self in (SubStageKind.REFERENCE, SubStageKind.TRAINING)

    @property
    def is_rollout(self) -> bool:
        return self in ROLLOUT_KINDS


ROLLOUT_KINDS = (SubStageKind.ROLLOUT_TAIL, SubStageKind.ROLLOUT_DECODE, SubStageKind.ROLLOUT_PREFILL)
"""Rollout kinds from the lowest token bucket to the highest."""

DEVICE_KINDS = tuple(k for k in SubStageKind if k.on_device)
"""Kinds a slowdown grid must cover."""

STAGE_KIND = {
    Stage.REFERENCE: SubStageKind.REFERENCE,
    Stage.TRAINING: SubStageKind.TRAINING,
    Stage.REWARD: SubStageKind.REWARD,
    Stage.TOOL: SubStageKind.TOOL,
}
"""Kind of the single sub-stage a non-rollout stage becomes on each DP worker."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """One forward step (rollout) or one micro-batch (reference, training) on one worker.

    For reference and training records `num_prefill_tokens` counts the tokens of the
    micro-batch and `num_decode_reqs` its sequences.  Tool and reward records span the
    interval the worker waited on the host.
    """

    pipeline: str
    """Name of the RL pipeline (job) that ran the step."""
    step: int
    """RL step (global batch) index."""
    stage: Stage = Stage.ROLLOUT
    """Coarse stage of the record."""
    dp_rank: int = 0
    """Data-parallel worker that ran it."""
    t_start_s: float
    """Start of the step, seconds on the pipeline's clock."""
    t_end_s: float
    """End of the step, seconds on the pipeline's clock."""
    num_prefill_tokens: int = 0
    """Prompt tokens processed in this forward (micro-batch tokens for ref/train)."""
    num_decode_reqs: int = 0
    """Requests decoding one token in this forward (micro-batch sequences for ref/train)."""
    kv_tokens_used: int = 0
    """Tokens held in the KV cache during the step."""
    mem_bytes: int = 0
    """Device memory held by the worker during the step."""
    flops: float = 0.0
    """Model FLOPs of the step (0 if the engine does not report them)."""
    slowdown: float = 1.0
    """Slowdown the step ran under (its grant's prediction); the builder divides by it so
    sub-stage durations are exclusive, whatever ran beside them."""

    def __post_init__(self) -> None:
        if not self.slowdown > 0:
            raise ValueError(f"StepRecord {self.pipeline}/{self.step}: slowdown must be > 0")
        if not self.pipeline or "/" in self.pipeline:
            raise ValueError(f"StepRecord: pipeline name must be non-empty without '/', got {self.pipeline!r}")
        if self.t_end_s < self.t_start_s:
            raise ValueError(f"StepRecord {self.pipeline}/{self.step}/rank{self.dp_rank}: "
                             f"t_end_s {self.t_end_s} is before t_start_s {self.t_start_s}")
        for name in ("num_prefill_tokens", "num_decode_reqs", "kv_tokens_used", "mem_bytes", "dp_rank"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepRecord {self.pipeline}/{self.step}: {name} is negative")

    @property
    def num_tokens(self) -> int:
        """Tokens per forward, the quantity the paper buckets."""
        return self.num_prefill_tokens + self.num_decode_reqs

    @property
    def duration_s(self) -> float:
        return self.t_end_s - self.t_start_s


def grant_need_bytes(kind: SubStageKind, mem_bytes: int) -> int:
    """What a sub-stage of `mem_bytes` footprint must be granted to run at all: its footprint,
    but a rollout engine nothing, since it sizes its KV pool from the memory it is given
    (SGLang's mem_fraction_static): what it reported holding is what its grant let it fill."""
    return 0 if kind.is_rollout else mem_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class SubStage:
    """A node of the sub-stage graph: one regime of one stage on one DP worker."""

    id: str
    """Unique within a pipeline graph: `<pipeline>/<step>/<stage>/r<rank>/<index>`."""
    pipeline: str
    """Pipeline the sub-stage belongs to."""
    step: int
    """RL step index."""
    kind: SubStageKind
    """Resource regime."""
    dp_rank: int
    """DP worker (one replica of the rollout sub-stages per worker)."""
    duration_s: float
    """Exclusive duration: the whole device, no co-located partner."""
    mem_bytes: int = 0
    """Device memory the sub-stage needs to run at all (weights, minimal KV / micro-batch)."""
    batch_size: float = 0.0
    """Mean active requests per forward (rollout) or sequences (reference, training)."""
    seq_len: float = 0.0
    """Mean tokens per sequence: KV tokens per request (rollout), tokens per sequence otherwise."""
    num_steps: int = 1
    """Forward steps or micro-batches it covers."""
    num_tokens: int = 0
    """Tokens processed (prefill + decode for rollout)."""
    flops: float = 0.0
    """Model FLOPs (0 if unknown)."""

    def __post_init__(self) -> None:
        if not self.duration_s >= 0.0:
            raise ValueError(f"sub-stage {self.id}: duration_s must be >= 0, got {self.duration_s}")
        if self.mem_bytes < 0:
            raise ValueError(f"sub-stage {self.id}: mem_bytes must be >= 0, got {self.mem_bytes}")
