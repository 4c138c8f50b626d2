"""jigsaw's SM grant applied to SGLang's pdmux decode stream group. GPU-only and unverified.

    jigsaw daemon ── writes float in (0, 1] ──► $JIGSAW_SM_FRAC_FILE
                                                   │ GrantReader: os.stat at most every 50 ms, re-read on change
    Scheduler.adjust_stream_groups() ── original picks (idx, streams) from the decode batch size
                                                   │ around_adjust_stream_groups: if a grant is known and the
                                                   ▼ original chose a group that decodes (idx > 0)
    pick_stream_idx(grant, sched.sm_counts) ─► set_current_stream_idx(k), model_runner.update_decode_attn_backend(k)
                                            ─► (k, sched.stream_groups[k])

pdmux's groups (`pdmux_context.initialize_stream_groups`, sglang 0.5.12): index 0 is a full-GPU prefill
pair, 1..n-2 green-context (prefill_sms, decode_sms) pairs, n-1 a full-GPU decode pair; `sm_counts[i]`
is `(prefill_sms, decode_sms)` with `(total, 0)` first and `(0, total)` last.

Nothing here has run on a GPU. Known limits: pdmux calls `adjust_stream_groups` only when a split prefill
starts or ends or the decode batch empties, so a new grant takes effect at the next such point, not at
the next decode step (per-step control needs a replaced `event_loop_pdmux`). The CPU tests drive the hook
with fake schedulers; the stream and attention-backend switch itself is untested.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

ADJUST_STREAM_GROUPS_TARGET = "sglang.srt.managers.scheduler.Scheduler.adjust_stream_groups"


def pick_stream_idx(sm_frac: float, sm_counts: Sequence[tuple[int, int]]) -> int | None:
    """The decode stream group whose decode SMs are the most that fit in `sm_frac` of the GPU.

    Candidates are indices 1..n-1 (index 0 is prefill-only). When even the smallest decode group is above
    the grant, that smallest group: decode has to run somewhere. Ties go to more prefill SMs, then the lower
    index. None when there is nothing to choose (no groups, no SMs, or a grant that is not a positive number).
    """
    if len(sm_counts) < 2 or not math.isfinite(sm_frac) or sm_frac <= 0:
        return None
    num_sms = max(prefill_sms + decode_sms for prefill_sms, decode_sms in sm_counts)
    if num_sms <= 0:
        return None
    grant_sms = min(sm_frac, 1.0) * num_sms
    candidates = [(decode_sms, prefill_sms, -idx) for idx, (prefill_sms, decode_sms) in enumerate(sm_counts)
                  if idx > 0]
    fitting = [c for c in candidates if c[0] <= grant_sms + 1e-9]
    if fitting:
        return -max(fitting)[2]
    smallest_sms = min(c[0] for c in candidates)
    return -max(c for c in candidates if c[0] == smallest_sms)[2]


class GrantReader:
    """The SM fraction jigsaw granted this replica, from a small file holding one float.

    Never blocks on anything but a local stat and a read of a few bytes, at most once per `poll_s`. Writers
    should replace the file atomically (write a temp file, rename): a half-written value is ignored and the
    last good one kept. A missing file means no grant.
    """

    def __init__(self, path: str, *, poll_s: float = 0.05, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.poll_s = poll_s
        self._clock = clock
        self._checked_s = -math.inf
        self._stat_key: tuple[int, int, int] | None = None
        self._sm_frac: float | None = None

    def sm_frac(self) -> float | None:
        now_s = self._clock()
        if now_s - self._checked_s < self.poll_s:
            return self._sm_frac
        self._checked_s = now_s
        try:
            st = os.stat(self.path)
        except OSError:
            self._stat_key = self._sm_frac = None
            return None
        # The inode is part of the key: an atomic rename can land within the same mtime tick.
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if key != self._stat_key:
            try:
                with open(self.path, "rb") as f:
                    value = float(f.read(64))
            except (OSError, ValueError):
                return self._sm_frac  # key not stored: the next poll reads it again
            self._stat_key = key
            self._sm_frac = min(value, 1.0) if math.isfinite(value) and value > 0 else None
        return self._sm_frac


def _sglang_set_stream_idx(idx: int) -> None:
    from sglang.srt.multiplex.pdmux_context import set_current_stream_idx

    set_current_stream_idx(idx)


def make_adjust_stream_groups_hook(grants: GrantReader,
                                   set_stream_idx: Callable[[int], None] = _sglang_set_stream_idx) -> Callable:
    """AROUND hook for `Scheduler.adjust_stream_groups(self) -> (idx, (prefill_stream, decode_stream))`."""

    def around_adjust_stream_groups(original_fn: Callable, *args: Any, **kwargs: Any) -> Any:
        result = original_fn(*args, **kwargs)  # SGLang's errors are SGLang's: not caught
        try:
            return _override(args[0], result, grants, set_stream_idx)
        except Exception:
            logger.debug("jigsaw pdmux hook failed; keeping SGLang's choice", exc_info=True)
            return result

    return around_adjust_stream_groups


def _override(sched: Any, result: Any, grants: GrantReader, set_stream_idx: Callable[[int], None]) -> Any:
    old_idx = result[0]
    sm_frac = grants.sm_frac()
    if sm_frac is None or old_idx == 0:  # idx 0: nothing decodes, prefill keeps the whole GPU
        return result
    idx = pick_stream_idx(sm_frac, sched.sm_counts)
    if idx is None or idx == old_idx:
        return result
    model_runner = sched.tp_worker.model_runner
    set_stream_idx(idx)  # raises before changing anything when idx is out of range
    try:
        model_runner.update_decode_attn_backend(idx)
    except BaseException:
        # Stream index and attention backend must agree (graphs are keyed by the index): put both back.
        set_stream_idx(old_idx)
        model_runner.update_decode_attn_backend(old_idx)
        raise
    return idx, sched.stream_groups[idx]
