"""Loaded by verl itself in every process that imports it (entry point group `verl.plugins`).

    import verl ─► verl/__init__.py loads entry points ─► this module ─► load()
        cpu.register()       the "cpu" platform (selected only by VERL_PLATFORM=cpu)
        rollout.register()   the rollout backend "jigsaw"
        weights.register()   the checkpoint engine "jigsaw" (registered when verl loads its
                             engines): weights to separate replicas through Ray's object store
        trainer.install()    under `jigsaw run` only (JIGSAW_PIPELINE set): the sync trainer
                             is replaced, under its own name, by one whose stages the daemon
                             admits; installed when verl's trainer module is first imported
        router.install()     under `jigsaw run` only: new rollout requests routed by the
                             daemon's weights (balancer.py)
        poll.install()       only with JIGSAW_VERL_POLL_S: a shorter replay-buffer poll

verl logs a failing plugin at debug level only, so what fails here is said as a warning, once,
and verl goes on without jigsaw (fail open).
"""

from __future__ import annotations

import logging

log = logging.getLogger("jigsaw.verl")


def load() -> None:
    from jigsaw.integrations.verl import cpu, poll, rollout, router, trainer, weights

    for part in (cpu.register, rollout.register, weights.register, trainer.install, router.install, poll.install):
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - verl must run as without jigsaw
            log.warning("jigsaw: %s.%s failed (%s: %s); verl runs without it", part.__module__, part.__name__,
                        type(exc).__name__, exc)


load()
