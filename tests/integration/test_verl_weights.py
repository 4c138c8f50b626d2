"""The checkpoint engine "jigsaw" (weights.py) in verl's own sequence, on a local Ray (verl venv).

    actor rank 0 (sender) ─┐                         ┌─► rollout worker 0: every tensor, bit-equal
    actor rank 1 ──────────┴─ prepare, build_topology ┤
                              init_process_group       └─► rollout worker 1: every tensor, bit-equal
    a second sync: the new weights, not the old; a receiver with no sender: a clear error;
    a sync one receiver failed to take: the next one still gets every receiver the new weights
    a standalone worker's adapter (told its replica rank): the async stream to that replica's server
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install -c constraints.txt -e '.[dev,verl]'")

pytestmark = [pytest.mark.verl, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def engine():
    import ray
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from jigsaw.integrations.verl.weights import NAME

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield CheckpointEngineRegistry.get(NAME)
    finally:
        ray.shutdown()


def _connect(cls, actors: int, rollouts: int):
    """verl's CheckpointEngineManager.build_process_group, in one process."""
    senders = [cls(bucket_size=1 << 20, is_master=rank == 0) for rank in range(actors)]
    receivers = [cls(bucket_size=1 << 20) for _ in range(rollouts)]
    metadata = [e.prepare() for e in (*senders, *receivers)]
    actor_kw, rollout_kw = cls.build_topology(actors, rollouts, metadata)
    for group, kw in ((senders, actor_kw), (receivers, rollout_kw)):
        for i, e in enumerate(group):
            e.init_process_group(**{k: v[i] for k, v in kw.items()})
    return senders, receivers


async def _sync(senders, receivers, state: dict, walked: list, step: int | None = None) -> list[dict]:
    def weights(rank):
        for name, t in state.items():
            walked.append(rank)  # every actor rank walks the generator (a collective in verl)
            yield name, t

    async def receive(e):
        return {name: t async for name, t in e.receive_weights(global_steps=step)}

    sends = [e.send_weights(weights(rank), global_steps=step) for rank, e in enumerate(senders)]
    *_, got = await asyncio.gather(*sends, asyncio.gather(*[receive(e) for e in receivers]))
    for e in (*senders, *receivers):
        e.finalize()
    return got


def test_every_rollout_worker_gets_every_tensor_of_each_sync(engine):
    import torch

    senders, receivers = _connect(engine, actors=2, rollouts=2)
    for version in (1, 2):
        state = {"embed.weight": torch.full((4, 3), float(version)), "head.bias": torch.arange(5.0) * version}
        walked = []
        got = asyncio.run(_sync(senders, receivers, state, walked))
        assert sorted(walked) == [0, 0, 1, 1]
        assert len(got) == 2
        for received in got:
            assert list(received) == list(state)
            for name, t in state.items():
                assert torch.equal(received[name], t), (version, name)


def test_a_receiver_without_a_sender_fails_clearly(engine, monkeypatch):
    from jigsaw.integrations.verl import weights

    monkeypatch.setattr(weights, "RECEIVE_TIMEOUT_S", 0.5)
    _, (receiver,) = _connect(engine, actors=1, rollouts=1)

    async def receive():
        return [x async for x in receiver.receive_weights()]

    with pytest.raises(RuntimeError, match="no weights from the trainer"):
        asyncio.run(receive())


def test_weights_a_failed_receiver_left_are_dropped_for_the_next_syncs(engine):
    """Sync 1's second receiver fails before it takes its copy; at sync 2 it gets step 2's
    weights, not the copy left in the queue."""
    import torch

    senders, receivers = _connect(engine, actors=1, rollouts=2)

    async def first():
        await senders[0].send_weights(iter([("w", torch.zeros(2))]), global_steps=1)
        return {n: t async for n, t in receivers[0].receive_weights(global_steps=1)}

    assert torch.equal(asyncio.run(first())["w"], torch.zeros(2))
    got = asyncio.run(_sync(senders, receivers, {"w": torch.ones(2)}, [], step=2))
    assert [torch.equal(g["w"], torch.ones(2)) for g in got] == [True, True]


def test_a_standalone_workers_adapter_feeds_the_replica_it_was_told(engine):
    """A standalone replica's CheckpointEngineWorker builds the adapter with `replica_rank`
    (no torch.distributed yet): the engine's async stream goes whole to that replica's server."""
    import ray
    import torch

    from jigsaw.integrations.verl.rollout import adapter_class
    from jigsaw.integrations.verl.server import server_name

    @ray.remote(num_cpus=0)
    class Server:  # the replica's server as the adapter sees it
        def __init__(self):
            self.state, self.steps = None, None

        async def update_weights(self, state):
            self.state = state

        async def set_global_steps(self, steps):
            self.steps = steps

        def seen(self):
            return self.state, self.steps

    server = Server.options(name=server_name(1)).remote()
    adapter = adapter_class()(SimpleNamespace(), SimpleNamespace(), None, replica_rank=1)

    async def stream():
        yield "w", torch.arange(3.0)

    asyncio.run(adapter.update_weights(stream(), global_steps=4))
    state, steps = ray.get(server.seen.remote(), timeout=30)
    assert list(state) == ["w"] and torch.equal(state["w"], torch.arange(3.0)) and steps == 4
    ray.kill(server)
