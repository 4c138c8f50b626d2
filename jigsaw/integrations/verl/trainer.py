"""verl's sync trainer with every stage admitted by the jigsaw daemon, in the trainer process.

    install()  (every process; only under `jigsaw run`: JIGSAW_PIPELINE is set)
        └─ when verl.trainer.ppo.v1.trainer_sync is imported: TRAINER_REGISTRY["sync"] =
           gated(PPOTrainerSync), under the same name (verl checks trainer_mode == "sync")

    PPOTrainerSync.fit ─► step N ─► _submit_batch_to_rollout  the replicas learn step N; `gen`
        │                           is their engines' regimes, each replica a DP worker
        │                           (serving.py); the trainer itself only waits meanwhile
        ├─ _compute_reward_colocate ► client.gang("reference", label="reward")  (a reward model)
        ├─ _compute_old_log_prob  ─► client.gang("reference", label="old_log_prob")
        ├─ _compute_ref_log_prob  ─► client.gang("reference", label="ref")
        ├─ _compute_values        ─► client.gang("reference", label="values")
        ├─ _update_critic         ─► client.gang("training",  label="update_critic")
        ├─ _update_actor          ─► client.gang("training",  label="update_actor")
        └─ on_step_end            ─► client.gang("training",  label="update_weights")
    each: a sub-stage per DP rank (placement.gang_members: trainer rank i on DP rank i mod the
    node's devices, its process found through Ray), all admitted before verl's call and bound
    to their grants' cores, reported done after it with their share of the batch.

Gating here, never per rank: the ranks run collectives, and a rank held back alone would
deadlock the others; the gang is asked for whole and verl's call starts once every member is
admitted.  Without a daemon every stage is granted at once (fail open).
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

    def _submit_batch_to_rollout(self, batch):
        _tell_replicas(self, self.global_steps)
        return base._submit_batch_to_rollout(self, batch)

    def _jigsaw_stage(self, label: str, kind: str, batch=None):
        gate = self.__dict__.get("_jigsaw_gate")
        if gate is None:
            gate = self.__dict__["_jigsaw_gate"] = Gate()
        return gate.stage(self, label, kind, batch)

    ns = dict(methods, on_step_end=on_step_end, _submit_batch_to_rollout=_submit_batch_to_rollout,
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
        from jigsaw.integrations.verl.placement import node_devices
        from jigsaw.runtime.client import connect

        self.client = connect()
        self.devices = node_devices(self.client)
        self._pids: tuple[int, ...] | None = None

    def pids(self, trainer) -> tuple[int, ...]:
        """The trainer ranks' processes, in rank order (asked of Ray once)."""
        if self._pids is None:
            import ray

            workers = trainer.actor_rollout_wg.workers
            self._pids = tuple(ray.get([w.__ray_call__.remote(_pid) for w in workers], timeout=30))
        return self._pids

    def stage(self, trainer, label: str, kind: str, batch=None):
        from jigsaw.integrations.verl.placement import gang_members

        members = gang_members(self.pids(trainer), self.devices)
        cm = self.client.gang(kind, members=members, step=trainer.global_steps, label=label)
        return _Reported(cm, batch)


def _pid(actor) -> int:
    return os.getpid()


class _Reported:
    """client.gang(...) whose members report their share of the batch when the stage is done."""

    def __init__(self, cm, batch):
        self.cm, self.batch = cm, batch

    def __enter__(self):
        self.grants = self.cm.__enter__()
        return self.grants

    def __exit__(self, *exc):
        keys = getattr(self.batch, "keys", None)
        if isinstance(keys, list | tuple):
            for g in self.grants:
                g.report(batch_size=len(keys) / len(self.grants))
        return self.cm.__exit__(*exc)
