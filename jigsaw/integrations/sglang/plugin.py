"""SGLang general plugin: per-forward token counts out of each scheduler, jigsaw's SM grant into pdmux.

    run_scheduler_process() ─► sglang.srt.plugins.load_plugins() ─► entry point "jigsaw" ─► load()
        JIGSAW_ENABLE != "1": nothing registered
        JIGSAW_FORWARD_SOCK set: AROUND hook on Scheduler.run_batch
        JIGSAW_SM_FRAC_FILE set: AROUND hook on Scheduler.adjust_stream_groups (pdmux.py, GPU-only)

    Scheduler.run_batch(batch) ─► around_run_batch ─► original ─► its result, unchanged
        tp_rank 0, pp_rank 0 only: forward_counts(batch) = (prefill_tokens, decode_reqs)
        ─► ForwardReporter: one 40-byte datagram (replica = $JIGSAW_REPLICA, seq, counts, t_mono_s)
           on a non-blocking AF_UNIX SOCK_DGRAM ─► $JIGSAW_FORWARD_SOCK ─► forward_sink.ForwardSink

The scheduler loop is single-threaded and latency-bound, so the hook never blocks and never raises
from its own code: a record that cannot be sent (no receiver, full buffer, any OSError) is dropped and
counted. An exception from SGLang's own run_batch passes through untouched.

Every TP rank has its own scheduler process with the same batch, so only tp_rank 0 reports; pp_rank 0
too, since each pipeline stage runs the same batch. With the overlap scheduler run_batch only launches
the forward: the counts are exact, `t_mono_s` (taken on entry) is launch time, not GPU time.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jigsaw.integrations.sglang.forward_sink import encode_record
from jigsaw.integrations.sglang.pdmux import ADJUST_STREAM_GROUPS_TARGET, GrantReader, make_adjust_stream_groups_hook

logger = logging.getLogger(__name__)

RUN_BATCH_TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"
UNKNOWN_REPLICA = -1

Register = Callable[[str, Callable], None]


@dataclass(frozen=True, kw_only=True)
class PluginConfig:
    """What the plugin does in one SGLang process, from its environment."""

    enabled: bool = False
    """JIGSAW_ENABLE=1: anything at all (otherwise the plugin registers nothing)."""
    forward_sock_path: str | None = None
    """Where ForwardSink listens; no run_batch hook without it."""
    replica: int = UNKNOWN_REPLICA
    """JIGSAW_REPLICA: the verl replica this scheduler serves (-1: unknown)."""
    sm_frac_file: str | None = None
    """File holding jigsaw's SM grant for this replica; no pdmux hook without it."""
    grant_poll_s: float = 0.05
    """Re-read the grant file at most this often."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PluginConfig:
        try:
            replica = int(environ.get("JIGSAW_REPLICA", ""))
        except ValueError:
            replica = UNKNOWN_REPLICA
        return cls(enabled=environ.get("JIGSAW_ENABLE") == "1",
                   forward_sock_path=environ.get("JIGSAW_FORWARD_SOCK") or None,
                   replica=replica,
                   sm_frac_file=environ.get("JIGSAW_SM_FRAC_FILE") or None)


def forward_counts(batch: Any) -> tuple[int, int] | None:
    """(prefill_tokens, decode_reqs) of one forward, or None for one that does no model work.

    MIXED is tested before EXTEND because ForwardMode.is_extend() is true for MIXED too; MIXED's
    extend_num_tokens holds one token per decoding row on top of the prefill tokens. A split prefill
    (pdmux) runs the same batch once per chunk of layers: only its first chunk counts.
    """
    mode = batch.forward_mode
    if mode.is_idle():
        return None
    if mode.is_mixed():
        decode_reqs = len(batch.decoding_reqs or ())
        return max(int(batch.extend_num_tokens or 0) - decode_reqs, 0), decode_reqs
    if mode.is_decode():
        return 0, int(batch.batch_size())
    if mode.is_extend():
        if getattr(batch, "split_index", 0):
            return None
        return int(batch.extend_num_tokens or 0), 0
    return None


class ForwardReporter:
    """Sends one record per forward; drops it, and counts the drop, whenever sending would block or fails."""

    def __init__(self, sock_path: str, replica: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.sock_path = sock_path
        self.replica = replica
        self.sent = self.dropped = 0
        self._seq = 0
        self._clock = clock
        self._sock: socket.socket | None = None

    def now_s(self) -> float:
        return self._clock()

    def report(self, prefill_tokens: int, decode_reqs: int, t_mono_s: float) -> bool:
        self._seq += 1  # numbered before sending, so the sink sees a dropped record as a gap
        try:
            data = encode_record(replica=self.replica, seq=self._seq, prefill_tokens=prefill_tokens,
                                 decode_reqs=decode_reqs, t_mono_s=t_mono_s)
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(data, self.sock_path)
        except Exception:  # BlockingIOError, no receiver (ENOENT, ECONNREFUSED), struct.error: all the same drop
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def make_run_batch_hook(reporter: ForwardReporter) -> Callable:
    """AROUND hook for `Scheduler.run_batch(self, batch, pp_proxy_tensors=None)`."""

    def around_run_batch(original_fn: Callable, *args: Any, **kwargs: Any) -> Any:
        counts, t_mono_s = _counts_at_entry(reporter, args, kwargs)
        result = original_fn(*args, **kwargs)  # SGLang's errors are SGLang's: not caught
        if counts is not None:
            reporter.report(counts[0], counts[1], t_mono_s)  # swallows every Exception of its own
        return result

    return around_run_batch


def _counts_at_entry(reporter: ForwardReporter, args: tuple, kwargs: dict) -> tuple[tuple[int, int] | None, float]:
    # Read at entry: run_batch may mutate the batch (e.g. filter finished requests) before it returns.
    try:
        sched = args[0]
        if getattr(sched, "tp_rank", 0) != 0 or getattr(sched, "pp_rank", 0) != 0:
            return None, 0.0
        batch = args[1] if len(args) > 1 else kwargs["batch"]
        return forward_counts(batch), reporter.now_s()
    except Exception:
        reporter.dropped += 1
        return None, 0.0


def _register_with_sglang(target: str, hook: Callable) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType.AROUND)


def install(config: PluginConfig, register: Register) -> tuple[str, ...]:
    """Register this config's hooks through `register(target, hook)`; the targets registered."""
    if not config.enabled:
        return ()
    targets = []
    if config.forward_sock_path:
        register(RUN_BATCH_TARGET, make_run_batch_hook(ForwardReporter(config.forward_sock_path, config.replica)))
        targets.append(RUN_BATCH_TARGET)
    if config.sm_frac_file:
        grants = GrantReader(config.sm_frac_file, poll_s=config.grant_poll_s)
        register(ADJUST_STREAM_GROUPS_TARGET, make_adjust_stream_groups_hook(grants))
        targets.append(ADJUST_STREAM_GROUPS_TARGET)
    return tuple(targets)


def load(*, register: Register | None = None, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The entry point SGLang calls (with no arguments) in every process that runs `load_plugins()`.

    Registering in processes without a scheduler is harmless: the hooks only run where Scheduler does,
    and the socket is opened on the first report.
    """
    try:
        config = PluginConfig.from_env(os.environ if environ is None else environ)
        return install(config, _register_with_sglang if register is None else register)
    except Exception:
        logger.exception("jigsaw SGLang plugin failed to load; SGLang runs without it")
        return ()
