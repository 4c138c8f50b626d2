"""The rollout engine's KV pool is bounded like a real engine's: admission, retraction, fit."""

from __future__ import annotations

import numpy as np
import pytest

from jigsaw.mux.model.costmodel import StepCost
from jigsaw.mux.model.specs import H100
from jigsaw.sim.request import Request
from jigsaw.sim.rollout import DoesNotFit, RolloutWorker

pytestmark = pytest.mark.timeout(60)
COST = StepCost(H100, "qwen3-4b")


def _requests(n: int, tokens: int) -> list[Request]:
    return [Request(rid=i, context=200, turns=[tokens + 37 * i], appended=[], tool_s=[]) for i in range(n)]


def _run(wk: RolloutWorker, reqs: list[Request]) -> RolloutWorker:
    wk.add(reqs, 0.0)
    for _ in range(100_000):
        if wk.plan() is None:
            return wk
        wk.commit()
        held = wk.held_kv_tokens()
        assert held <= wk.cap_tokens, f"holds {held} KV tokens, its pool has {wk.cap_tokens}"
    raise AssertionError("the worker never finished")


def _worker(grant_tokens: int | None = None) -> RolloutWorker:
    wk = RolloutWorker(pipeline="p", step=0, rank=0, cost=COST, mem_bytes=COST.rollout_mem_bytes(10**6))
    if grant_tokens is not None:
        wk.grant(COST.weights_bytes() + COST.config.rollout_reserve_bytes + grant_tokens * COST.kv_bytes_per_token())
    return wk


def test_a_small_grant_queues_and_retracts_but_every_response_keeps_its_length():
    tight = _run(_worker(grant_tokens=12_000), _requests(32, 2000))
    ample = _run(_worker(), _requests(32, 2000))
    want = {r.rid: r.turns for r in _requests(32, 2000)}
    for wk in (tight, ample):  # nothing restarted from scratch, nothing lost or doubled
        assert sorted(r.rid for r in wk.finished) == list(range(32))
        assert {r.rid: r.turns for r in wk.finished} == want
        assert all(r.context == 200 + r.turns[0] for r in wk.finished)
    assert tight.retracted > 0 and ample.retracted == 0
    cols_t, cols_a = tight.columns(), ample.columns()
    assert cols_t.kv_tokens_used.max() <= 12_000 < cols_a.kv_tokens_used.max()
    # a retracted request recomputes its whole context: more prefill, and a longer rollout
    assert cols_t.num_prefill_tokens.sum() > cols_a.num_prefill_tokens.sum()
    assert tight.t > ample.t


def test_retraction_takes_the_requests_with_the_fewest_generated_tokens_first():
    wk = _worker(grant_tokens=2_720)  # 20 tokens short of RETRACT_DECODE_STEPS × 2 once both grew
    wk.add([Request(rid=0, context=100, turns=[4000], appended=[], tool_s=[]),
            Request(rid=1, context=100, turns=[4000], appended=[], tool_s=[])], 0.0)
    wk.plan()
    wk.commit()  # both prefilled together
    wk.decoding[0].generated, wk.decoding[0].context = 2000, 2100  # rid 0 is further along
    wk.decoding[1].generated, wk.decoding[1].context = 500, 600
    wk._retract()
    assert [r.rid for r in wk.decoding] == [0] and [r.rid for r in wk.queue] == [1]
    assert wk.queue[0].pending == wk.queue[0].context == 600  # recomputes what it had


def test_a_response_longer_than_a_whole_device_cannot_run():
    wk = _worker()
    with pytest.raises(DoesNotFit, match="does not fit a rollout KV pool of .* tokens"):
        wk.add([Request(rid=0, context=100, turns=[wk.device_tokens], appended=[], tool_s=[])], 0.0)


def test_a_grant_below_one_response_is_flagged_and_the_engine_keeps_its_minimum():
    wk = _worker()
    wk.add(_requests(1, 3000), 0.0)
    wk.grant(COST.weights_bytes() + COST.config.rollout_reserve_bytes + 100 * COST.kv_bytes_per_token())
    assert wk.undersized and wk.cap_tokens == 200 + 8192  # its context and all the cap allows it


def test_tool_waits_lose_their_cached_kv_first_and_recompute_it():
    wk = _worker(grant_tokens=5_000)
    wk.add([Request(rid=0, context=2000, turns=[10, 10], appended=[50], tool_s=[100.0]),
            Request(rid=1, context=2800, turns=[500], appended=[], tool_s=[])], 0.0)
    for _ in range(10_000):
        if wk.plan() is None:
            break
        wk.commit()
    done = {r.rid: r for r in wk.finished}
    assert set(done) == {0, 1} and done[0].turns == [10, 10] and wk.retracted >= 1
    # rid 0's 2,010 cached tokens were dropped while it waited; it prefilled them again
    assert wk.columns().num_prefill_tokens.sum() >= 2000 + 2800 + 2010 + 50


def test_queued_prefixes_are_evicted_for_the_head_of_the_queue_when_nothing_decodes():
    # Found by the property test (hrrs, four 14B pipelines): the pool held the cached prefixes
    # of queued requests back from a tool call, the head of the queue (retracted, its whole
    # context to recompute) did not fit beside them, nothing decoded to free KV, and the
    # worker stopped with requests left.  SGLang's radix cache evicts unlocked prefixes.
    wk = _worker(grant_tokens=5_000)
    head = Request(rid=0, context=3000, turns=[800, 100], appended=[200], tool_s=[0.0], turn=1, pending=3000)
    back = [Request(rid=i, context=1500, turns=[300, 100], appended=[100], tool_s=[0.0], turn=1, pending=100)
            for i in (1, 2, 3)]
    wk.queue.extend([head, *back])
    assert wk._locked() == 3 * 1400 and not wk.decoding  # 800 tokens free: the head does not fit
    for _ in range(10_000):
        if wk.plan() is None:
            break
        wk.commit()
    assert sorted(r.rid for r in wk.finished) == [0, 1, 2, 3] and wk.num_active == 0
    assert {r.rid: r.context for r in wk.finished} == {0: 3100, 1: 1600, 2: 1600, 3: 1600}
    assert wk.retracted >= 1  # a prefix was dropped, and prefilled again


def test_trajectories_past_the_wall_clock_limit_end_where_they_are():
    wk = RolloutWorker(pipeline="p", step=0, rank=0, cost=COST, mem_bytes=COST.rollout_mem_bytes(10**5),
                       deadline_s=2.0)
    reqs = [Request(rid=0, context=100, turns=[50], appended=[], tool_s=[]),
            Request(rid=1, context=100, turns=[20_000], appended=[], tool_s=[]),
            Request(rid=2, context=100, turns=[5, 5], appended=[10], tool_s=[50.0])]
    _run(wk, reqs)
    done = {r.rid: r for r in wk.finished}
    assert set(done) == {0, 1, 2}
    assert done[0].turns == [50]
    assert 0 < done[1].turns[0] < 20_000 and done[1].context == 100 + done[1].turns[0]
    assert done[2].turns == [5, 0]  # cut during its tool call
    starts = wk.columns().t_start_s
    assert np.all(starts < 2.0) and wk.t >= 2.0


def test_each_request_keeps_its_finished_turns_and_tool_output_to_come_as_it_runs():
    # The KV pool reads both for every running request at every step (its floor): kept as
    # turns end, never summed again, so they must equal the sums of the request's lists.
    wk = _worker(grant_tokens=6_000)
    wk.add([Request(rid=i, context=300 + 50 * i, turns=[40 + i, 30, 60 - i], appended=[120, 80 + i],
                    tool_s=[0.0 if i % 2 else 3.0, 1.0]) for i in range(6)], 0.0)
    seen_turns = set()
    for _ in range(10_000):
        if wk.plan() is None:
            break
        wk.commit()
        for r in wk._active():
            assert r.done_tokens == sum(r.turns[:r.turn]) and r.to_append == sum(r.appended[r.turn:]), r
            seen_turns.add(r.turn)
        floor = max((r.context + max(0, wk.max_new_tokens - sum(r.turns[:r.turn]) - r.generated)
                     + sum(r.appended[r.turn:]) for r in wk._active()), default=0)
        assert wk.floor_tokens() == min(wk.device_tokens, floor)
    assert seen_turns == {0, 1, 2} and len(wk.finished) == 6


def test_a_request_cut_short_keeps_what_it_generated_and_nothing_to_come():
    r = Request(rid=0, context=100, turns=[5, 7, 9], appended=[30, 40], tool_s=[1.0, 2.0])
    r.generated = 5
    assert r.next_turn() == 30 and (r.context, r.pending, r.turn, r.done_tokens, r.to_append) == (130, 30, 1, 5, 40)
    r.generated = 3
    r.cut()
    assert (r.turns, r.appended, r.tool_s, r.output_tokens, r.to_append) == ([5, 3], [30], [1.0], 8, 0)
