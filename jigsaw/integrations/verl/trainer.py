"""verl's trainers with every stage admitted by the jigsaw daemon, in the trainer process.

    install()  (every process; only under `jigsaw run`: JIGSAW_PIPELINE is set)
        ├─ when verl.trainer.ppo.v1.trainer_<mode> is imported: TRAINER_REGISTRY[mode] =
        │  gated(its trainer), under the same name, for each of verl's `trainer.v1.trainer_mode`s:
        │  sync, colocate_async and separate_async
        └─ when an experimental main's trainer module is imported (EXPERIMENTAL): its class, or
           the Ray actor class around it, replaced by the gated one before the main reads it

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

The asynchronous modes are an asynchronous job to jigsaw (graph/buffer.py), as the CPU recipe's
are: the replicas its rollout side (the job's name), the trainer's gangs its training side
(`<job>.train`), registered with the job, mode fully-async (verl interrupts running rollouts at
a weight update and resumes them: partial rollout) and the staleness bound verl keeps
(`trainer.v1.sampler.max_off_policy_threshold`).  Their rollouts run ahead of training: the
prompts of batch b are step b of the rollout side, whatever step the trainer is in.

verl's experimental mains (`one_step_off_policy`, `fully_async_policy`) run RayPPOTrainer's stage
methods, the same names, with their weight sync in `_fit_update_weights` (fully_async's is
async, and moves weights only every `trigger_parameter_sync_step` steps).  They are one-step-off
(bound 1) and fully-async (the bound their rollouter's sample cap implies) jobs to jigsaw; a sync
at step N makes the replicas' next rollouts step N + 1.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os

from jigsaw.runtime.paths import ENV_PIPELINE

log = logging.getLogger("jigsaw.verl")

TRAINER_MODULES = {
    "sync": "verl.trainer.ppo.v1.trainer_sync",
    "colocate_async": "verl.trainer.ppo.v1.trainer_colocate_async",
    "separate_async": "verl.trainer.ppo.v1.trainer_separate_async",
}
"""verl's trainer modes (`trainer.v1.trainer_mode`), each with the module that registers it."""
EXPERIMENTAL = {
    "verl.experimental.one_step_off_policy.ray_trainer": ("OneStepOffRayTrainer", "one-step-off"),
    "verl.experimental.fully_async_policy.fully_async_trainer": ("FullyAsyncTrainer", "fully-async"),
}
"""verl's experimental asynchronous mains' trainers: module -> (class, its mode to jigsaw).  Their
mains build them directly, not through TRAINER_REGISTRY, so the module's attribute is replaced
(a Ray actor class by a Ray actor class of the gated trainer, with the same options)."""
ASYNC_MODE = "fully-async"
"""What verl's v1 asynchronous trainers are to jigsaw (graph/buffer.py MODES)."""
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
    """Replace each of verl's trainers once verl defines it (now, if it already did)."""
    if not os.environ.get(ENV_PIPELINE):
        return  # not under `jigsaw run`: verl as it is
    from jigsaw.integrations.verl.imports import after_import

    for mode, module in TRAINER_MODULES.items():
        after_import(module, functools.partial(_replace, mode))
    for module, (name, mode) in EXPERIMENTAL.items():
        after_import(module, functools.partial(_replace_attr, name, mode))


def _replace(mode: str, module) -> None:
    from verl.trainer.ppo.v1 import trainer_base

    base = trainer_base.TRAINER_REGISTRY.get(mode)
    if base is None or getattr(base, "jigsaw_gated", False):
        return
    trainer_base.TRAINER_REGISTRY[mode] = gated(base)
    log.info("jigsaw: verl's %s trainer runs its stages under the jigsaw daemon", mode)


def _replace_attr(name: str, mode: str, module) -> None:
    cls = getattr(module, name)
    actor = getattr(cls, "__ray_metadata__", None)  # @ray.remote: gate the class it wraps
    base = actor.modified_class.__ray_actor_class__ if actor is not None else cls
    if getattr(base, "jigsaw_gated", False):
        return
    new = gated(base, mode)
    if actor is not None:
        import ray

        new = ray.remote(**cls._default_options)(new)
    setattr(module, name, new)
    log.info("jigsaw: verl's %s runs its stages under the jigsaw daemon", name)


def gated(base: type, mode: str | None = None) -> type:
    """`base` with each stage of STAGES and the weight sync admitted by the daemon.  `mode`: what
    an experimental trainer is to jigsaw (None: a v1 trainer, whose `trainer_mode` says)."""
    methods = {name: _gate(base, label, name, kind) for label, (name, kind) in STAGES.items() if hasattr(base, name)}
    if hasattr(base, "on_step_end"):  # v1: the step's weight sync
        methods["on_step_end"] = _gate_sync(base, "on_step_end")
    if hasattr(base, "_fit_update_weights"):  # the experimental trainers' weight sync
        methods["_fit_update_weights"] = _gate_sync(base, "_fit_update_weights")
    if hasattr(base, "_submit_batch_to_rollout"):
        def _submit_batch_to_rollout(self, batch):
            _tell_replicas(self, _rollout_step(self, len(batch)))
            return base._submit_batch_to_rollout(self, batch)

        methods["_submit_batch_to_rollout"] = _submit_batch_to_rollout

    def _jigsaw_stage(self, label: str, kind: str, batch=None):
        gate = self.__dict__.get("_jigsaw_gate")
        if gate is None:
            gate = self.__dict__["_jigsaw_gate"] = Gate(self)
        return gate.stage(self, label, kind, batch)

    ns = dict(methods, _jigsaw_stage=_jigsaw_stage, jigsaw_gated=True, jigsaw_mode=mode,
              __module__=base.__module__, __qualname__=base.__qualname__,
              __doc__=f"{base.__doc__ or ''}\n(stages gated by jigsaw)")
    return type(base.__name__, (base,), ns)


def _gate(base: type, label: str, name: str, kind: str):
    verl_stage = getattr(base, name)

    def stage(self, batch, *args, **kwargs):
        with self._jigsaw_stage(label, kind, batch):
            return verl_stage(self, batch, *args, **kwargs)

    stage.__name__ = name
    return stage


def _gate_sync(base: type, name: str):
    """verl's weight sync `name` as the training side's `update_weights` stage.  After an
    experimental trainer's sync at step N, the replicas' next rollouts belong to step N + 1."""
    verl_sync = getattr(base, name)
    experimental = name == "_fit_update_weights"

    if inspect.iscoroutinefunction(verl_sync):  # fully_async_policy's
        async def sync(self, *args, **kwargs):
            if not _syncs(self):
                return await verl_sync(self, *args, **kwargs)
            with self._jigsaw_stage(WEIGHT_SYNC, "training"):
                out = await verl_sync(self, *args, **kwargs)
            _tell_replicas(self, self.global_steps + 1)
            return out
    else:
        def sync(self, *args, **kwargs):
            with self._jigsaw_stage(WEIGHT_SYNC, "training"):
                out = verl_sync(self, *args, **kwargs)
            if experimental:
                _tell_replicas(self, self.global_steps + 1)
            return out

    sync.__name__ = name
    return sync


def _syncs(trainer) -> bool:
    """Whether fully_async_policy's `_fit_update_weights` moves weights this step: only on the
    step that completes `trigger_parameter_sync_step` (it returns at once otherwise)."""
    return getattr(trainer, "local_trigger_step", 1) == 1


def mode_of(trainer) -> str:
    """What `trainer` is to jigsaw: sync, or an asynchronous mode of graph/buffer.py."""
    mode = getattr(trainer, "jigsaw_mode", None)
    if mode is not None:
        return mode
    return ASYNC_MODE if getattr(trainer, "trainer_mode", "sync") != "sync" else "sync"


def is_async(trainer) -> bool:
    return mode_of(trainer) != "sync"


def _rollout_step(trainer, prompts: int) -> int:
    """The rollout step `prompts` new prompts belong to: the trainer's step when it waits for
    them (sync), else the batch they complete (counted in prompts: verl tops batches up)."""
    if not is_async(trainer):
        return trainer.global_steps
    before = trainer.__dict__.get("_jigsaw_prompts", 0)
    trainer.__dict__["_jigsaw_prompts"] = before + prompts
    return 1 + before // int(trainer.config.data.train_batch_size)


def _tell_replicas(trainer, step: int) -> None:
    """The jigsaw rollout replicas' next rollout belongs to `step` (other backends: nothing)."""
    import ray

    manager = getattr(trainer, "llm_server_manager", None)  # fully_async's trainer has only the sync's
    replicas = manager.get_replicas() if manager is not None else trainer.checkpoint_manager.replicas
    calls = [s.set_jigsaw_step.remote(step) for r in replicas for s in r.servers if hasattr(s, "set_jigsaw_step")]
    ray.get(calls, timeout=30)


class Gate:
    """The trainer process's client and the processes its stages run in."""

    def __init__(self, trainer=None):
        from jigsaw.integrations.verl.placement import node_devices
        from jigsaw.runtime.client import connect

        self.client = connect(**_side(trainer)) if trainer is not None and is_async(trainer) else connect()
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


def _side(trainer) -> dict:
    """An asynchronous trainer's registration: its job's training side, the job's bound."""
    from jigsaw.graph.buffer import train_side

    job = os.environ[ENV_PIPELINE]
    return {"pipeline": train_side(job), "job": job, "mode": mode_of(trainer), "staleness": staleness(trainer)}


def staleness(trainer) -> int:
    """The training steps a sample may be trained after the weights it was generated under."""
    if mode_of(trainer) == "one-step-off":
        return 1  # batch N + 1 is generated during step N, under the weights step N - 1 made
    a = getattr(trainer.config, "async_training", None)
    if a is not None:  # fully_async_policy: the rollouter generates at most (1 + threshold) x
        #  trigger_parameter_sync_step batches per weight sync (its max_required_samples)
        return math.ceil((1 + float(a.staleness_threshold)) * int(a.trigger_parameter_sync_step))
    return int(trainer.config.trainer.v1.sampler.get("max_off_policy_threshold") or 0)


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
        rows = _rows(self.batch)
        if rows is not None:
            for g in self.grants:
                g.report(batch_size=rows / len(self.grants))
        return self.cm.__exit__(*exc)


def _rows(batch) -> int | None:
    """A stage's batch size: a v1 trainer's KVBatchMeta lists its keys, a DataProto has a length."""
    keys = getattr(batch, "keys", None)
    if isinstance(keys, list | tuple):
        return len(keys)
    try:
        return len(batch) if batch is not None else None
    except TypeError:
        return None
