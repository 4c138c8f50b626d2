"""The verl replica's engine thread without verl or Ray: requests in, a daemon's migration order
carried out, every caller answered once.

    Serving(RolloutEngine, greedy) on its own thread, fed through its inbox as the actor feeds it
    a grant whose migration orders name this replica's rank ─► every request in flight is
    aborted here and answered Moved(target replica, its partial output): nothing lost, nothing
    answered twice, the partial a prefix of what the request would have generated
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
from waiting import HANG_S, Hold

from jigsaw import protocol as pr
from jigsaw.engines.model import ModelConfig, load
from jigsaw.engines.rollout import Completion, Request, RolloutConfig, RolloutEngine
from jigsaw.integrations.verl.server import ServerConfig, _Pending
from jigsaw.integrations.verl.serving import Moved, Serving

pytestmark = pytest.mark.timeout(120)
NEW_TOKENS = 40


class Order:
    """A grant as the client holds it, carrying the daemon's migration orders."""

    def __init__(self, *orders: pr.MigrationOrder):
        self.migrations = orders


@pytest.fixture(scope="module")
def engine():
    model, tok = load(ModelConfig())
    with RolloutEngine(model, tok, RolloutConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, threads=1)) as eng:
        yield eng


def serve(engine, prompts, order_after_steps: int | None):
    """Run Serving round by round on a thread of its own; optionally put a migration order
    (rank 0 -> 1) on its rollout's grant once it has seen `order_after_steps` forward steps,
    the engine held after that many until the round after (the order lands mid-generation
    however loaded the machine).  What each caller got, and the Serving."""
    serving = Serving(engine, ServerConfig(model_path="-", temperature=0.0, replica_rank=0), lambda: 1)
    inbox: queue.Queue = queue.Queue()
    loop = asyncio.new_event_loop()
    pend = [_Pending(rid=f"r{i}", prompt_ids=p, max_new_tokens=NEW_TOKENS, done=loop.create_future(), loop=loop)
            for i, p in enumerate(prompts)]

    hold = Hold(engine.model, forwards=order_after_steps) if order_after_steps is not None else None

    def rounds():
        seen, ordered, deadline = 0, False, time.monotonic() + HANG_S
        while time.monotonic() < deadline and not all(p.done.done() for p in pend):
            seen += serving.tick(inbox)
            if ordered:
                hold.release()  # the round after the order carried it out
            if hold is not None and seen >= order_after_steps and serving.rollout is not None:
                serving.rollout.grant.migrations = (pr.MigrationOrder(source="a", target="b", source_rank=0,
                                                                      target_rank=1),)
                ordered = True

    for p in pend:
        inbox.put(("generate", p))
    thread = threading.Thread(target=rounds, daemon=True)
    thread.start()
    try:
        got = loop.run_until_complete(asyncio.wait_for(asyncio.gather(*(p.done for p in pend)), HANG_S))
    finally:
        if hold is not None:
            hold.release()
        thread.join(10)
        loop.close()
    return got, serving


def test_a_migration_order_hands_every_request_in_flight_over_with_its_partial(engine):
    model, tok = load(ModelConfig())
    prompts = [tuple(tok.encode(t)) for t in ("what is 3 + 4?", "the answer is", "0 1 2 3", "add the numbers")]
    plain, _ = serve(engine, prompts, None)
    moved, serving = serve(engine, prompts, 3)
    assert all(isinstance(c, Completion) and c.finished for c in plain)
    handed = [m for m in moved if isinstance(m, Moved)]
    assert handed and all(m.target_replica == 1 for m in handed), moved
    assert len(moved) == len(prompts)  # every caller answered, once
    for before, after in zip(plain, moved):
        got = after.completion if isinstance(after, Moved) else after
        assert got.rid == before.rid
        assert before.output_ids[:len(got.output_ids)] == got.output_ids  # a prefix of the whole answer
        if isinstance(after, Moved):
            assert not got.finished and len(got.output_ids) < NEW_TOKENS
    assert serving.stats.moved_out == len(handed)
    assert serving.engine.active() == []  # nothing left behind in the engine


def test_an_order_for_another_rank_moves_nothing(engine):
    model, tok = load(ModelConfig())
    prompts = [tuple(tok.encode("what is 3 + 4?"))]
    serving = Serving(engine, ServerConfig(model_path="-", temperature=0.0, replica_rank=0), lambda: 1)
    serving.rollout = type("R", (), {"grant": Order(pr.MigrationOrder(source="a", target="b", source_rank=1,
                                                                      target_rank=0))})()
    serving._step = 1
    engine.submit(Request(rid="x", prompt_ids=prompts[0], max_new_tokens=NEW_TOKENS))
    serving._orders()
    assert engine.active() == ["x"] and serving.stats.moved_out == 0
    engine.abort("x")


def test_the_plans_routing_weights_go_to_verls_balancer_once_per_change(engine):
    told = []
    serving = Serving(engine, ServerConfig(model_path="-", temperature=0.0, replica_rank=0), lambda: 1,
                      on_routing=told.append)
    grant = Order()
    grant.routing = None
    serving.rollout = type("R", (), {"grant": grant})()
    serving._route()
    grant.routing = (0.75, 0.25)
    serving._route()
    serving._route()
    grant.routing = (0.5, 0.5)
    serving._route()
    assert told == [(0.75, 0.25), (0.5, 0.5)]
