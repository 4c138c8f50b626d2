"""A rollout worker's regimes from its forward steps: client-side bucketing over the client.

    engine forward step ─► Rollout.forward(prefill tokens, decoding requests, KV tokens)
        BucketTracker (graph/builder.py: token buckets + hysteresis) ─► a regime change,
        recognised some steps into the new regime and dated back to its first step:
            Done of the last regime (its steps, tokens, FLOPs, batch, KV per request, up to
            that first step) ─► Admit of the next (urgent: a running rollout cannot pause;
            the seconds it already ran) ─► its GrantHandle; its counts start at that step
    engine's requests now ─► Rollout.progress(...) ─► Progress (at most every progress_every_s)

Traffic is per regime change, not per token; the node sees a worker's rollout as the
simulator's engines show theirs (sim/report.py sends the same requests).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from jigsaw import protocol as pr
from jigsaw.graph.builder import BucketTracker

PROGRESS_EVERY_S = 0.25
"""How often a rollout tells the node what its requests are, at most."""


class _Step(NamedTuple):
    index: int
    t_s: float
    tokens: int
    reqs: int
    kv: int


class Rollout:
    """Forward steps in, sub-stage transitions out: one Done + Admit per regime change.

        with client.rollout(dp_rank=r, step=n, pids=[worker_pid]) as ro:
            for each engine forward step:  grant = ro.forward(num_prefill_tokens, num_decode_reqs)

    The bucket rule is the graph builder's (`BucketTracker`: token buckets + hysteresis);
    the first regime waits for admission, the next ones are urgent (a running rollout
    cannot pause) and only learn their budget."""

    def __init__(self, client, dp_rank: int, step: int, pids: tuple[int, ...] = (), label: str = "",
                 progress_every_s: float = PROGRESS_EVERY_S):
        """`client`: the process's runtime.client.Client."""
        self.client, self.dp_rank, self.step, self.pids, self.label = client, dp_rank, step, pids, label
        self.rank_offset = 0
        """Added to the ranks its migrations name for the pipeline's own (runtime/across.py: a
        node's daemon knows only its local ranks)."""
        self.tracker = BucketTracker()
        self._recent: deque[_Step] = deque(maxlen=self.tracker._need + 1)
        """The last forward steps: those a regime change dates back to move to the new regime."""
        self._index = 0
        self.grant = None
        self._cm = None
        self._tokens = self._steps = self._reqs = self._kv = 0
        self.transitions = 0
        self._primed, self._started_kind = False, ""
        self.closed = False
        self.flops_per_token = 0.0
        """Model FLOPs per token processed (2 × parameters for a forward), for MFU in the trace."""
        self.progress_every_s = progress_every_s
        self._told_s = -math.inf

    def start(self, num_prefill_tokens: int):
        """Admit the first regime before any forward step runs (blocks like `substage`), from
        the tokens the first forward will carry; the step itself is counted by `forward`."""
        kind = self.tracker.observe(num_prefill_tokens).kind
        self.tracker = type(self.tracker)()  # `forward` sees the first step again, in the same bucket
        self._open(kind.value, urgent=False)
        self._primed, self._started_kind = True, kind.value
        return self.grant

    def forward(self, num_prefill_tokens: int, num_decode_reqs: int, kv_tokens: int = 0):
        """One engine forward step; `kv_tokens`: the KV cache its decoding requests read (0:
        unknown).  A regime reports what the graph builder summarises from such steps: its
        steps, tokens, mean decoding requests per step (batch size) and KV tokens per request
        (sequence length), which is what a migration of its requests is priced by."""
        now = time.monotonic()
        switch = self.tracker.observe(num_prefill_tokens + num_decode_reqs)
        if self._primed:  # the regime `start` admitted is not a transition
            self._primed = False
            if switch is not None and switch.kind.value == self._started_kind:
                switch = None
        if switch is not None and not self.closed:
            moved = [x for x in self._recent if x.index >= switch.start_index]
            self._count(moved, -1)  # the steps since the new regime began are its own
            self._end(final=False)
            self._open(switch.kind.value, urgent=self.grant is not None,
                       elapsed_s=now - moved[0].t_s if moved else 0.0)
            self._count(moved, +1)
        step = _Step(self._index, now, num_prefill_tokens + num_decode_reqs, num_decode_reqs, kv_tokens)
        self._index += 1
        self._recent.append(step)
        self._count([step], +1)
        return self.grant

    def _count(self, steps: Sequence[_Step], sign: int) -> None:
        for x in steps:
            self._tokens += sign * x.tokens
            self._steps += sign
            self._reqs += sign * x.reqs
            self._kv += sign * x.kv

    def progress(self, holding: Sequence[tuple[int, int]], mem_bytes: int | None = None, *,
                 force: bool = False) -> bool:
        """What the engine holds now: (context tokens, tokens generated in the current turn)
        of each request in flight, and the memory it needs for them (None: not known).  Sent
        at most every `progress_every_s` (unless `force`), for the regime it is in; whether
        it was sent.  The scheduler prices a tail by its requests' residual life."""
        now = time.monotonic()
        if self.grant is None or not self.grant.substage or (not force and now - self._told_s < self.progress_every_s):
            return False
        self._told_s = now
        generated = sorted(g for _, g in holding)[-pr.MAX_LIST:]
        context = sum(c for c, _ in holding) / len(holding) if holding else 0.0
        self.client.tell(pr.Progress(session="", substage=self.grant.substage, requests=len(holding),
                                     context_tokens=context, generated=tuple(generated), mem_bytes=mem_bytes))
        return True

    def _open(self, kind: str, urgent: bool, elapsed_s: float = 0.0) -> None:
        self._cm = self.client.substage(kind, dp_rank=self.dp_rank, step=self.step, urgent=urgent, pids=self.pids,
                                        label=self.label, elapsed_s=elapsed_s)
        self.grant = self._cm.__enter__()
        self.transitions += 1

    def close(self) -> None:
        """The worker's rollout of this step is over (its requests are done, or handed over)."""
        self._end(final=True)
        self.closed = True

    def _end(self, final: bool) -> None:
        if self._cm is not None:
            self.grant.report(num_tokens=self._tokens, num_steps=self._steps,
                              flops=self.flops_per_token * self._tokens,
                              batch_size=self._reqs / self._steps if self._steps else 0.0,
                              seq_len=self._kv / self._reqs if self._reqs else 0.0)
            self.grant.final = final
            self._cm.__exit__(None, None, None)
            self._cm, self._tokens, self._steps, self._reqs, self._kv = None, 0, 0, 0, 0

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
