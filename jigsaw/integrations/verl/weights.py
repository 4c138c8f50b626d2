"""verl checkpoint engine "jigsaw": the trainer's weights to separate rollout replicas through
Ray's object store, so verl's disaggregated trainers run on a host without NCCL.

    CheckpointEngineManager.update_weights (trainer)           every sync, verl's own sequence:
      abort, release KV ─► prepare ─► build_topology ─► init_process_group ─► send / receive
                           ─► finalize ─► resume KV, resume generation

    actor rank 0 (is_master)                 rollout worker i (CheckpointEngineWorker)
      prepare: the job's Queue (a Ray actor,   init_process_group: the queue, no sender
        made once) ─► metadata[0]
      send_weights: every actor rank walks     receive_weights: (step, ref) = queue.get ─► the state
        verl's weight generator (gathering a     dict ─► (name, tensor) ─► the server adapter
        weight is collective over the actors);   (rollout.py ServerAdapter) ─► its replica
        rank 0 keeps a CPU copy of each,
        ray.put(state) once, one ref per receiver

verl 0.9.1's other non-colocated backends (nccl, nixl, mooncake, hccl, kimi) all need a GPU or
an RDMA NIC, and its "naive" sync needs a rollout colocated in the actor process, which
`one_step_off_policy`, `fully_async_policy` and `trainer_mode=separate_async` do not have.
The copy is whole, not bucketed: a model a host can train fits its object store.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("jigsaw.verl")

NAME = "jigsaw"
"""verl's `actor_rollout_ref.rollout.checkpoint_engine.backend` of this engine."""
RECEIVE_TIMEOUT_S = 900.0
"""How long a rollout worker waits for the trainer's weights (gathering them is the trainer's
slowest collective on a host) before it fails the sync with a clear error."""


def engine_class(base: type) -> type:
    """The engine, a subclass of verl's `CheckpointEngine` (`base`)."""
    import ray

    class ObjectStoreCheckpointEngine(base):
        """One sender (actor rank 0), every rollout worker a receiver of the whole state dict."""

        def __init__(self, bucket_size: int = 0, is_master: bool = False, **_unused):
            self.is_master = is_master
            self._queue = None  # the master's, once made; a receiver's from init_process_group
            self._sender, self._receivers = False, 0

        def prepare(self) -> dict:
            if not self.is_master:
                return {}
            if self._queue is None:
                from ray.util.queue import Queue

                self._queue = Queue()  # one per job: its handle travels in the topology
            return {"queue": self._queue}

        @classmethod
        def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
            queue = metadata[0].get("queue") if metadata else None
            if queue is None:
                raise RuntimeError("the jigsaw checkpoint engine's sender is actor rank 0, which made no queue")
            actor = {"sender": [True] + [False] * (actor_wg_world_size - 1),
                     "receivers": [rollout_world_size] * actor_wg_world_size, "queue": [queue] * actor_wg_world_size}
            rollout = {"sender": [False] * rollout_world_size, "receivers": [0] * rollout_world_size,
                       "queue": [queue] * rollout_world_size}
            return actor, rollout

        def init_process_group(self, sender: bool, receivers: int, queue):
            self._sender, self._receivers, self._queue = sender, receivers, queue

        def finalize(self):
            pass  # the queue is kept for the next sync; nothing else is held

        async def send_weights(self, weights, global_steps: int | None = None):
            from verl.workers.rollout.utils import ensure_async_iterator

            state = {}
            async for name, weight in ensure_async_iterator(weights):
                full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
                if self._sender:
                    state[name] = full.detach().to("cpu").clone()
            if not self._sender:
                return None
            ref = ray.put(state)
            for _ in range(self._receivers):  # the ref in a list: the queue keeps it, not a copy
                await self._queue.put_async((global_steps, [ref]))
            log.debug("jigsaw: sent %d tensors to %d rollout workers", len(state), self._receivers)
            return None

        async def receive_weights(self, global_steps: int | None = None):
            for name, tensor in (await self._take(global_steps)).items():
                yield name, tensor

        async def _take(self, global_steps: int | None) -> dict:
            """This sync's state dict.  An older sync's, left by a receiver that failed before
            taking it, is dropped: the newer weights supersede it."""
            from ray.util.queue import Empty

            deadline = time.monotonic() + RECEIVE_TIMEOUT_S
            while True:
                try:
                    step, (ref,) = await self._queue.get_async(timeout=max(0.0, deadline - time.monotonic()))
                except Empty:
                    raise RuntimeError(f"no weights from the trainer in {RECEIVE_TIMEOUT_S:.0f} s "
                                       f"(checkpoint engine {NAME!r})") from None
                if global_steps is None or step is None or step >= global_steps:
                    return await ref
                log.warning("jigsaw: dropped the weights of step %s, untaken, for step %s's", step, global_steps)

    ObjectStoreCheckpointEngine.__module__ = __name__
    return ObjectStoreCheckpointEngine


def register() -> None:
    """Make `checkpoint_engine.backend=jigsaw` known to verl, in every process that loads verl's
    checkpoint engines (and only there: they import every transport verl ships)."""
    from jigsaw.integrations.verl.imports import after_import

    after_import("verl.checkpoint_engine.base", _register)


def _register(module) -> None:
    module.CheckpointEngineRegistry.register(NAME)(engine_class(module.CheckpointEngine))
