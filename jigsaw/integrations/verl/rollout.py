"""verl's rollout backend "jigsaw": replicas served by jigsaw's own engine (`server.py`).

    rollout.name=jigsaw
      TaskRunner:  LLMServerManager ─► RolloutReplicaRegistry["jigsaw"] ─► JigsawReplica
                      launch_servers(): one Ray actor RolloutServer per replica,
                      named server.server_name(replica rank), no CPU reserved (it shares the
                      trainer's cores: the daemon's partitions decide who runs)
      each trainer rank:  _ROLLOUT_REGISTRY[("jigsaw", "async")] ─► ServerAdapter
                      update_weights(generator): every rank materialises each tensor
                      (`full_tensor()`, a collective), the replica's leader rank sends the
                      state dict to its server through Ray's object store
      or, a standalone replica (verl's separate trainers): its CheckpointEngineWorker's
                      ServerAdapter, fed by the checkpoint engine "jigsaw" (weights.py)

`_ROLLOUT_REGISTRY` is private to verl 0.9.1 (there is no public register function); the
contract tests name it.
"""

from __future__ import annotations

import logging

log = logging.getLogger("jigsaw.verl")

NAME = "jigsaw"
"""verl's `actor_rollout_ref.rollout.name` of this backend."""


def _local_path(model_config) -> str:
    """The checkpoint directory of verl's model config (a DictConfig here; a hub name is
    fetched the way verl fetches it)."""
    from verl.utils.fs import copy_to_local

    local = model_config.get("local_path") if hasattr(model_config, "get") else None
    return str(local or copy_to_local(model_config.path))


def replica_class():
    """The `RolloutReplica` subclass (built on first use: it imports verl and Ray)."""
    import ray
    from verl.workers.rollout.replica import RolloutReplica

    from jigsaw.integrations.verl.server import RolloutServer, ServerConfig, server_name

    class JigsawReplica(RolloutReplica):
        """One replica = one jigsaw engine in one Ray actor (tensor/pipeline parallel 1)."""

        async def launch_servers(self):
            c, m = self.config, self.model_config
            if self.world_size != 1:
                raise ValueError(f"the jigsaw rollout serves one model copy per replica: tensor, data and pipeline "
                                 f"parallel sizes must be 1 (their product is {self.world_size})")
            cfg = ServerConfig(model_path=_local_path(m), temperature=float(c.temperature),
                               max_new_tokens=int(c.response_length), seed=int(m.get("seed", 0) or 0),
                               replica_rank=self.replica_rank)
            name = server_name(self.replica_rank, self.name_suffix)
            server = ray.remote(RolloutServer).options(name=name, num_cpus=0,
                                                       max_concurrency=self.max_concurrency).remote(cfg)
            await server.ready.remote()
            self.servers = [server]
            self._server_handle, self._server_address = server, name

    return JigsawReplica


def adapter_class():
    """The trainer ranks' side of the weight sync (a `BaseRollout`)."""
    import ray
    import torch
    from verl.workers.rollout.base import BaseRollout

    class ServerAdapter(BaseRollout):
        """Pushes the trainer's weights to the replica this rank leads; nothing else to do on
        a host, whose memory is never released between stages."""

        def __init__(self, config, model_config, device_mesh, *args, replica_rank: int | None = None, **kwargs):
            super().__init__(config, model_config, device_mesh)
            if replica_rank is None:  # a trainer rank (colocated): its rank; a standalone worker is told
                replica_rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            self.replica_rank, self.leader = replica_rank, True  # one rank per replica (launch_servers checks)
            self._server = None

        def _actor(self):
            from jigsaw.integrations.verl.server import server_name

            if self._server is None:
                self._server = ray.get_actor(server_name(self.replica_rank))
            return self._server

        async def resume(self, tags: list[str]):
            return None

        async def release(self):
            return None

        async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None, **kwargs):
            if wire_format != "named_tensors":
                raise ValueError(f"the jigsaw rollout takes full named tensors, not {wire_format!r}")
            from verl.workers.rollout.utils import ensure_async_iterator

            state = {}
            async for name, tensor in ensure_async_iterator(weights):  # a checkpoint engine's is async
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # every rank: a collective
                if self.leader:
                    state[name] = full.detach().to("cpu", torch.float32).clone()
            if self.leader:
                await self._actor().update_weights.remote(state)
                if global_steps is not None:
                    await self._actor().set_global_steps.remote(global_steps)

    return ServerAdapter


def register() -> None:
    """Make `rollout.name=jigsaw` known to verl (in every process that imports verl)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(NAME, replica_class)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.ServerAdapter"


def __getattr__(name: str):
    # verl imports the adapter by dotted name (`get_rollout_class`); build it on that first use
    if name == "ServerAdapter":
        globals()[name] = cls = adapter_class()
        return cls
    raise AttributeError(name)
