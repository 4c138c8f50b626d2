"""Opt-in: a shorter poll of verl's sync replay buffer (JIGSAW_VERL_POLL_S), for measurements.

    JIGSAW_VERL_POLL_S=0.05 ─► in the process that builds verl's ReplayBuffer: its default
                               poll_interval (2.0 s in verl 0.9.1) becomes 0.05 s

verl's sync trainer waits for a step's rollout by polling every 2 s, so `gen` lasts 2 s, 4 s,
6 s...: a rollout of 2.01 s costs 4 s.  That quantum swamps whatever a schedule changes, so the
bench sets this in every mode it compares (serial and naive included).  Nothing changes
without the variable: verl runs as it is.
"""

from __future__ import annotations

import os

ENV = "JIGSAW_VERL_POLL_S"
MODULE = "verl.trainer.ppo.v1.replay_buffer"


def install() -> None:
    value = os.environ.get(ENV)
    if not value:
        return
    poll_s = float(value)
    if not poll_s > 0:
        raise ValueError(f"{ENV}={value!r}: a poll interval in seconds, > 0")
    from jigsaw.integrations.verl.imports import after_import

    after_import(MODULE, lambda module: _patch(module, poll_s))


def _patch(module, poll_s: float) -> None:
    cls = module.ReplayBuffer
    init = cls.__init__
    if getattr(init, "jigsaw_poll_s", None) is not None:
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.poll_interval = min(self.poll_interval, poll_s)

    __init__.jigsaw_poll_s = poll_s
    cls.__init__ = __init__
