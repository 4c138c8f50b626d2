"""Every verl 0.9.1 (and Ray) name jigsaw's verl integration touches, with what jigsaw relies on.

A verl release that renames, re-signs or drops one of them fails the test naming it, before any
job runs.  Private names (module globals and underscored methods) are marked so in TARGETS;
jigsaw/integrations/verl/ uses no others.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install -c constraints.txt -e '.[dev,verl]'")

pytestmark = pytest.mark.verl

# (dotted name, parameters it must accept in this order (None: not a callable check), private?)
TARGETS = [
    ("verl.plugin.platform.platform_manager.PlatformRegistry.register", ("cls", "platform"), False),
    ("verl.plugin.platform.platform_base.PlatformBase", None, False),
    ("verl.workers.rollout.replica.RolloutReplicaRegistry.register", ("cls", "name", "loader"), False),
    ("verl.workers.rollout.replica.RolloutReplica.__init__",
     ("self", "replica_rank", "config", "model_config", "gpus_per_node", "is_reward_model", "is_teacher_model",
      "name_suffix"), False),
    ("verl.workers.rollout.replica.RolloutReplica.launch_servers", ("self",), False),
    ("verl.workers.rollout.replica.RolloutReplica.max_concurrency", None, False),
    ("verl.workers.rollout.replica.TokenOutput", None, False),
    ("verl.workers.rollout.base.BaseRollout.__init__", ("self", "config", "model_config", "device_mesh"), False),
    ("verl.workers.rollout.base.BaseRollout.update_weights", ("self", "weights", "wire_format"), False),
    ("verl.workers.rollout.base.BaseRollout.resume", ("self", "tags"), False),
    ("verl.workers.rollout.base.BaseRollout.release", ("self",), False),
    ("verl.workers.rollout.base._ROLLOUT_REGISTRY", None, True),
    ("verl.workers.rollout.base.get_rollout_class", ("rollout_name", "mode"), False),
    ("verl.utils.fs.copy_to_local", ("src",), False),
    ("verl.trainer.ppo.v1.replay_buffer.ReplayBuffer.__init__",
     ("self", "trainer_mode", "trainer_config", "max_off_policy_threshold", "max_off_policy_strategy",
      "sampler_kwargs", "poll_interval"), False),
    ("verl.trainer.ppo.v1.trainer_base.TRAINER_REGISTRY", None, False),
    ("verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_reward_colocate", ("self", "batch", "metrics"), True),
    ("verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_old_log_prob", ("self", "batch", "metrics"), True),
    ("verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_ref_log_prob", ("self", "batch", "metrics"), True),
    ("verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_values", ("self", "batch", "metrics"), True),
    ("verl.trainer.ppo.v1.trainer_base.PPOTrainer._update_critic", ("self", "batch", "metrics"), True),
    ("verl.trainer.ppo.v1.trainer_base.PPOTrainer._update_actor", ("self", "batch", "metrics"), True),
    ("verl.trainer.ppo.v1.trainer_base.PPOTrainer._submit_batch_to_rollout", ("self", "batch"), True),
    ("verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync.on_step_end", ("self",), False),
    ("verl.trainer.ppo.v1.trainer_colocate_async.PPOTrainerColocateAsync.on_step_end", ("self",), False),
    ("verl.trainer.ppo.v1.trainer_separate_async.PPOTrainerSeparateAsync.on_step_end", ("self",), False),
    ("verl.workers.rollout.llm_server.LLMServerManager.get_replicas", ("self",), False),
    ("verl.single_controller.ray.base.RayWorkerGroup.workers", None, False),
    ("verl.workers.rollout.router.get_router_handle",
     ("servers", "router_config_path", "full_determinism", "load_balancer_cls"), False),
    ("verl.workers.rollout.router.GlobalRequestLoadBalancer.__init__",
     ("self", "servers", "max_cache_size", "full_determinism"), False),
    ("verl.workers.rollout.router.GlobalRequestLoadBalancer.acquire_server", ("self", "request_id"), False),
    ("verl.workers.rollout.router.GlobalRequestLoadBalancer.release_server", ("self", "server_id"), False),
    ("verl.checkpoint_engine.base.CheckpointEngineManager.update_weights", ("self", "global_steps"), False),
    ("verl.checkpoint_engine.base.CheckpointEngineRegistry.register", ("backend",), False),
    ("verl.checkpoint_engine.base.CheckpointEngine", None, False),
    ("verl.workers.rollout.utils.ensure_async_iterator", ("iterable",), False),
    ("verl.trainer.ppo.ray_trainer.RayPPOTrainer._compute_reward_colocate", ("self", "batch"), True),
    ("verl.trainer.ppo.ray_trainer.RayPPOTrainer._compute_old_log_prob", ("self", "batch"), True),
    ("verl.trainer.ppo.ray_trainer.RayPPOTrainer._compute_ref_log_prob", ("self", "batch"), True),
    ("verl.trainer.ppo.ray_trainer.RayPPOTrainer._compute_values", ("self", "batch"), True),
    ("verl.trainer.ppo.ray_trainer.RayPPOTrainer._update_critic", ("self", "batch"), True),
    ("verl.trainer.ppo.ray_trainer.RayPPOTrainer._update_actor", ("self", "batch"), True),
    ("verl.experimental.separation.ray_trainer.SeparateRayPPOTrainer._fit_update_weights", ("self",), True),
    ("verl.experimental.one_step_off_policy.ray_trainer.OneStepOffRayTrainer", None, False),
    ("verl.experimental.fully_async_policy.fully_async_trainer.FullyAsyncTrainer", None, False),
    ("ray.util.queue.Queue.put_async", ("self", "item"), False),
    ("ray.util.queue.Queue.get_async", ("self", "block", "timeout"), False),
]


def resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = inspect.getattr_static(obj, attr) if inspect.isclass(obj) else getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("dotted, params, private", TARGETS, ids=[t[0].removeprefix("verl.") for t in TARGETS])
def test_verl_still_has(dotted, params, private):
    obj = resolve(dotted)
    if params is None:
        return
    fn = obj.__func__ if isinstance(obj, classmethod | staticmethod) else obj
    got = tuple(inspect.signature(fn).parameters)
    assert got[:len(params)] == params, f"{dotted}{got}: jigsaw calls it as {params}"


def source(module: str) -> str:
    return inspect.getsource(importlib.import_module(module))


@pytest.mark.parametrize("module, text, why", [
    ("verl", 'entry_points(group="verl.plugins")', "verl loads jigsaw's plugin through this group"),
    ("verl.plugin.platform.platform_manager", "VERL_PLATFORM", "selects the cpu platform"),
    ("verl.workers.engine.base", "VERL_ENGINE_DEVICE", "the FSDP engine registered for cuda runs on cpu"),
    ("verl.utils.distributed", 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"',
     "the duplicated backend cpu.patch() removes"),
    ("verl.trainer.ppo.v1.trainer_base", 'marked_timer("gen"', "the stage label of the rollout regimes"),
    ("verl.trainer.ppo.v1.trainer_base", 'marked_timer("old_log_prob"', "a stage label"),
    ("verl.trainer.ppo.v1.trainer_base", 'marked_timer("ref"', "a stage label"),
    ("verl.trainer.ppo.v1.trainer_base", 'marked_timer("update_actor"', "a stage label"),
    ("verl.trainer.ppo.v1.trainer_sync", 'marked_timer("update_weights"', "a stage label"),
    ("verl.trainer.ppo.v1.trainer_sync", '@register_trainer("sync")', "the name jigsaw's trainer replaces"),
    ("verl.trainer.ppo.v1.trainer_colocate_async", '@register_trainer("colocate_async")', "a name jigsaw replaces"),
    ("verl.trainer.ppo.v1.trainer_separate_async", '@register_trainer("separate_async")', "a name jigsaw replaces"),
    ("verl.trainer.ppo.v1.trainer_colocate_async", 'marked_timer("update_weights"', "a stage label"),
    ("verl.trainer.ppo.v1.trainer_separate_async", 'marked_timer("update_weights"', "a stage label"),
    ("verl.trainer.ppo.v1.trainer_base", "self.trainer_mode = ", "tells the gate an asynchronous trainer"),
    ("verl.trainer.ppo.v1.trainer_base", "max_off_policy_threshold=sampler_config.max_off_policy_threshold",
     "the staleness bound the gate registers (trainer.v1.sampler)"),
    ("verl.trainer.ppo.v1.trainer_base", "self._submit_batch_to_rollout(batch)",
     "every batch, warm-up and top-ups included, goes to the replicas through it"),
    ("verl.trainer.main_ppo", "get_trainer_cls(config.trainer.v1.trainer_mode)", "the registry is read per job"),
    ("verl.trainer.ppo.v1.trainer_base", "self.actor_rollout_wg = ", "the trainer ranks' worker group"),
    ("verl.trainer.ppo.v1.trainer_base", "self.llm_server_manager", "the rollout replicas"),
    ("verl.workers.rollout.llm_server", "server.generate.remote(", "how requests reach a replica's server"),
    ("verl.workers.rollout.llm_server", '"abort"', "the stop reason the resuming client continues from"),
    ("ray._private.worker", "RAY_RUNTIME_ENV_HOOK", "how jigsaw run reaches every Ray worker"),
    ("verl.experimental.one_step_off_policy.main_ppo",
     "from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer",
     "the main reads the class jigsaw replaced when it imports it"),
    ("verl.experimental.fully_async_policy.fully_async_main",
     "from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer",
     "the main reads the actor class jigsaw replaced when it imports it"),
    ("verl.experimental.one_step_off_policy.ray_trainer", "class OneStepOffRayTrainer(SeparateRayPPOTrainer)",
     "its stages are RayPPOTrainer's methods, its weight sync _fit_update_weights"),
    ("verl.experimental.fully_async_policy.fully_async_trainer", "class FullyAsyncTrainer(SeparateRayPPOTrainer)",
     "its stages are RayPPOTrainer's methods, its weight sync _fit_update_weights"),
    ("verl.experimental.fully_async_policy.fully_async_trainer",
     "if self.local_trigger_step != 1:\n            return None",
     "a sync moves weights only on the step that completes trigger_parameter_sync_step"),
    ("verl.experimental.fully_async_policy.fully_async_rollouter",
     "* (self.staleness_threshold + 1)\n                * self.config.async_training.trigger_parameter_sync_step",
     "the rollouter's cap per weight sync, which the bound jigsaw registers is derived from"),
    ("verl.experimental.separation.ray_trainer", 'marked_timer("update_weights"', "a stage label"),
    ("verl.experimental.separation.ray_trainer", "self._compute_old_log_prob(batch)", "a gated stage method"),
    ("verl.experimental.separation.ray_trainer", "self._update_actor(batch)", "a gated stage method"),
    ("verl.experimental.one_step_off_policy.ray_trainer", "self.actor_rollout_wg = self.actor_wg",
     "the trainer ranks' worker group"),
    ("verl.experimental.fully_async_policy.fully_async_trainer", "self.actor_rollout_wg = self.actor_wg",
     "the trainer ranks' worker group"),
    ("verl.checkpoint_engine.base", "        self.replicas = replicas\n",
     "the replicas a trainer without an LLMServerManager (fully_async's) tells its rollout step"),
    ("verl.workers.engine_workers", "is_master=(torch.distributed.get_rank() == 0)",
     "the jigsaw checkpoint engine sends from actor rank 0"),
    ("verl.workers.rollout.replica", "replica_rank=self.replica_rank,",
     "a standalone replica's worker tells its server adapter which replica it serves"),
    ("verl.workers.rollout.llm_server", "        from verl.workers.rollout.router import get_router_handle\n",
     "looked up when the router is built, so the one router.install() wraps is called"),
    ("verl.workers.rollout.router", "self._request_id_to_server[request_id] = server_id",
     "the sticky map JigsawBalancer fills (private)"),
    ("verl.workers.rollout.router", "self._inflight_requests[server_id] += 1",
     "the in-flight counts JigsawBalancer weighs (private)"),
])
def test_verl_still_reads(module, text, why):
    assert text in source(module), f"{module} no longer has {text!r} ({why})"


def test_every_call_verl_makes_on_a_replica_server_is_served():
    """Each `server.<method>.remote(` verl's replica and checkpoint code make exists on jigsaw's
    rollout server, and generate takes the keywords verl passes."""
    from jigsaw.integrations.verl.server import RolloutServer

    called = set()
    for module in ("verl.workers.rollout.replica", "verl.workers.rollout.llm_server"):
        called |= set(re.findall(r"server\.(\w+)\.remote\(", source(module)))
    assert {"generate", "sleep", "wake_up"} <= called, called  # the pattern still finds verl's calls
    assert not [m for m in called if not hasattr(RolloutServer, m)], called
    kwargs = re.search(r"server\.generate\.remote\((.*?)\n\s*\)", source("verl.workers.rollout.llm_server"), re.S)
    passed = set(re.findall(r"(\w+)=", kwargs.group(1)))
    params = set(inspect.signature(RolloutServer.generate).parameters)
    assert passed <= params, passed - params


def test_the_cpu_platform_implements_every_abstract_method():
    from verl.plugin.platform.platform_base import PlatformBase

    from jigsaw.integrations.verl.cpu import platform_class

    cls = platform_class()
    assert not getattr(cls, "__abstractmethods__", None), cls.__abstractmethods__
    p = cls()
    assert isinstance(p, PlatformBase) and p.device_name == "cpu" and p.communication_backend_name() == "gloo"
    assert p.current_device() == "cpu" and not p.is_platform_available()  # asked for by name only


def test_the_checkpoint_engine_implements_every_abstract_method():
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

    from jigsaw.integrations.verl.weights import NAME

    cls = CheckpointEngineRegistry.get(NAME)  # registered once verl loaded its engines
    assert issubclass(cls, CheckpointEngine) and not getattr(cls, "__abstractmethods__", None)
    assert inspect.isasyncgenfunction(cls.receive_weights) and inspect.iscoroutinefunction(cls.send_weights)


def test_the_experimental_trainers_are_replaced_by_gated_ones_of_the_same_kind(monkeypatch):
    """Under `jigsaw run`, importing verl's experimental trainers yields gated ones: the Ray actor
    class stays a Ray actor class with verl's options, wrapping the gated trainer."""
    import sys

    from jigsaw.integrations.verl import trainer as vt

    monkeypatch.setenv("JIGSAW_PIPELINE", "verl-job")
    mods = list(vt.EXPERIMENTAL)
    for m in mods:
        monkeypatch.delitem(sys.modules, m, raising=False)
    vt.install()
    one = importlib.import_module(mods[0]).OneStepOffRayTrainer
    assert one.jigsaw_gated and one.jigsaw_mode == "one-step-off" and one.__qualname__ == "OneStepOffRayTrainer"
    fa = importlib.import_module(mods[1]).FullyAsyncTrainer
    inner = fa.__ray_metadata__.modified_class.__ray_actor_class__
    assert inner.jigsaw_gated and inner.jigsaw_mode == "fully-async"
    assert fa._default_options == {"num_cpus": 10}  # verl's @ray.remote(num_cpus=10)
    assert inspect.iscoroutinefunction(inner._fit_update_weights)  # verl's is async: so is the gate's
    assert inner.__mro__[1].__name__ == "FullyAsyncTrainer" and not getattr(inner.__mro__[1], "jigsaw_gated", False)


def test_the_plugin_registered_the_platform_the_backend_and_the_adapter():
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    assert PlatformRegistry.get("cpu") is not None
    assert RolloutReplicaRegistry.get("jigsaw").__name__ == "JigsawReplica"
    assert get_rollout_class("jigsaw", "async").__name__ == "ServerAdapter"
