"""verl's sync trainer with every stage admitted by the jigsaw daemon, in the trainer process.

    install()  (every process; only under `jigsaw run`: JIGSAW_PIPELINE is set)
        └─ when verl.trainer.ppo.v1.trainer_sync is imported: TRAINER_REGISTRY["sync"] =
           gated(PPOTrainerSync), under the same name (verl checks trainer_mode == "sync")

    PPOTrainerSync.fit ─► step N ─► _submit_batch_to_rollout  the replicas learn step N;
        │                           their engines ask for the rollout regimes (serving.py)
        ├─ on_sample_begin..on_sample_end ─► client.substage("tool", label="gen"): the trainer
        │                           waits on the host for the rollout (verl polls every 2 s), so
        │                           the scheduler does not keep a share of the cores for it
        ├─ _compute_reward_colocate ► client.substage("reference", label="reward")  (a reward model)
        ├─ _compute_old_log_prob  ─► client.substage("reference", label="old_log_prob")
        ├─ _compute_ref_log_prob  ─► client.substage("reference", label="ref")
        ├─ _compute_values        ─► client.substage("reference", label="values")
        ├─ _update_critic         ─► client.substage("training",  label="update_critic")
        ├─ _update_actor          ─► client.substage("training",  label="update_actor")
        └─ on_step_end            ─► client.substage("training",  label="update_weights")
    each: admitted before verl's call (the trainer ranks bound to the grant's cores, found
    through Ray), reported done after it with the batch size.

Gating here, never per rank: the ranks run collectives, and a rank held back alone would
deadlock the others.  Without a daemon every stage is granted at once (fail open).
"""

from __future__ import annotations

import logging
import os

from jigsaw.runtime.paths import ENV_PIPELINE

log = logging.getLogger("jigsaw.verl")

TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_sync"
STAGES = {
    "reward": ("_compute_reward_colocate", "reference"),
    "old_log_prob": ("_compute_old_log_prob", "reference"),
    "ref": ("_compute_ref_log_prob", "reference"),
    "values": ("_compute_values", "reference"),
    "update_critic": ("_update_critic", "training"),
    "update_actor": ("_update_actor", "training"),
}
"""verl stage (its `marked_timer` name) -> (the PPOTrainer method that runs it, jigsaw kind).
"reward" runs in the trainer only with a colocated reward model (a forward on the device); a
rule-based reward runs in verl's reward workers, inside `gen`, on the host."""
WEIGHT_SYNC = "update_weights"
GEN_WAIT = "gen"
"""The trainer's wait for the rollout inside verl's `gen` stage: a host wait (kind tool)."""


def install() -> None:
    """Replace the sync trainer once verl defines it (now, if it already did)."""
    if not os.environ.get(ENV_PIPELINE):
        return  # not under `jigsaw run`: verl as it is
    from jigsaw.integrations.verl.imports import after_import

    after_import(TRAINER_MODULE, _replace)


def _replace(module) -> None:
    from verl.trainer.ppo.v1 import trainer_base

    base = trainer_base.TRAINER_REGISTRY.get("sync")
    if base is None or getattr(base, "jigsaw_gated", False):
        return
    trainer_base.TRAINER_REGISTRY["sync"] = gated(base)
    log.info("jigsaw: verl's sync trainer runs its stages under the jigsaw daemon")


def gated(base: type) -> type:
    """`base` with each stage of STAGES and the weight sync admitted by the daemon."""
    methods = {name: _gate(base, label, name, kind) for label, (name, kind) in STAGES.items() if hasattr(base, name)}

    def on_step_end(self):
        with self._jigsaw_stage(WEIGHT_SYNC, "training"):
            return base.on_step_end(self)

    def on_sample_begin(self):
        # the trainer now waits for the rollout (and verl's replay buffer polls every 2 s):
        # a wait on the host, so its share of the cores is not kept for it meanwhile
        wait = self._jigsaw_stage(GEN_WAIT, "tool")
        wait.__enter__()
        self.__dict__["_jigsaw_wait"] = wait
        return base.on_sample_begin(self)

    def on_sample_end(self):
        try:
            return base.on_sample_end(self)
        finally:
            if (wait := self.__dict__.pop("_jigsaw_wait", None)) is not None:
                wait.__exit__(None, None, None)

    def _submit_batch_to_rollout(self, batch):
        _tell_replicas(self, self.global_steps)
        return base._submit_batch_to_rollout(self, batch)

    def _jigsaw_stage(self, label: str, kind: str, batch=None):
        gate = self.__dict__.get("_jigsaw_gate")
        if gate is None:
            gate = self.__dict__["_jigsaw_gate"] = Gate()
        return gate.stage(self, label, kind, batch)

    ns = dict(methods, on_step_end=on_step_end, on_sample_begin=on_sample_begin, on_sample_end=on_sample_end,
              _submit_batch_to_rollout=_submit_batch_to_rollout,
              _jigsaw_stage=_jigsaw_stage, jigsaw_gated=True, __doc__=f"{base.__doc__ or ''}\n(stages gated by jigsaw)")
    return type(base.__name__, (base,), ns)


def _gate(base: type, label: str, name: str, kind: str):
    verl_stage = getattr(base, name)

    def stage(self, batch, *args, **kwargs):
        with self._jigsaw_stage(label, kind, batch):
            return verl_stage(self, batch, *args, **kwargs)

    stage.__name__ = name
    return stage


def _tell_replicas(trainer, step: int) -> None:
    """The jigsaw rollout replicas' next rollout belongs to `step` (other backends: nothing)."""
    import ray

    replicas = trainer.llm_server_manager.get_replicas()
    calls = [s.set_jigsaw_step.remote(step) for r in replicas for s in r.servers if hasattr(s, "set_jigsaw_step")]
    ray.get(calls, timeout=30)


class Gate:
    """The trainer process's client and the processes its stages run in."""

    def __init__(self):
        from jigsaw.runtime.client import connect

        self.client = connect()
        self._pids: tuple[int, ...] | None = None

    def pids(self, trainer) -> tuple[int, ...]:
        """The trainer ranks' processes (asked of Ray once)."""
        if self._pids is None:
            import ray

            workers = trainer.actor_rollout_wg.workers
            self._pids = tuple(ray.get([w.__ray_call__.remote(_pid) for w in workers], timeout=30))
        return self._pids

    def stage(self, trainer, label: str, kind: str, batch=None):
        pids = self.pids(trainer) if kind not in ("reward", "tool") else ()
        cm = self.client.substage(kind, step=trainer.global_steps, pids=pids, label=label)
        return _Reported(cm, batch)


def _pid(actor) -> int:
    return os.getpid()


class _Reported:
    """client.substage(...) that reports the batch's size when the stage is done."""

    def __init__(self, cm, batch):
        self.cm, self.batch = cm, batch

    def __enter__(self):
        self.grant = self.cm.__enter__()
        return self.grant

    def __exit__(self, *exc):
        keys = getattr(self.batch, "keys", None)
        if isinstance(keys, list | tuple):
            self.grant.report(batch_size=len(keys))
        return self.cm.__exit__(*exc)
