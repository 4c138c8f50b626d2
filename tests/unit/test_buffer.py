"""The sample buffer of an asynchronous pipeline: its staleness gate and exactly-once batches."""

from __future__ import annotations

import pytest

from jigsaw.graph.buffer import SampleBuffer, StaleSample, Trained

pytestmark = pytest.mark.timeout(10)


def _batch(n: int, size: int = 3) -> list[int]:
    return list(range(n * size, (n + 1) * size))


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_batch_may_start_only_within_k_versions_of_the_step_that_trains_it(k):
    buf = SampleBuffer(staleness=k)
    allowed = [n for n in range(8) if buf.may_generate(n)]
    assert allowed == list(range(k + 1))  # version 0: batches 0..k
    for step in range(3):
        buf.put(step, [(u, buf.version) for u in _batch(step)])
        buf.take(step)
        buf.trained(step)
    assert [n for n in range(12) if buf.may_generate(n)] == list(range(3 + k + 1))


def test_steps_train_their_own_batch_once_in_order_and_the_ledger_says_so():
    buf = SampleBuffer(staleness=1)
    buf.put(0, [(u, 0) for u in _batch(0)])
    buf.put(1, [(u, 0) for u in _batch(1)])
    with pytest.raises(ValueError, match="in order"):
        buf.take(1)
    with pytest.raises(ValueError, match="without taking"):
        buf.trained(0)
    assert [u for u, _ in buf.take(0)] == _batch(0)
    buf.trained(0)
    buf.take(1)
    buf.trained(1)
    assert [(t.uid, t.step, t.staleness) for t in buf.ledger] == \
        [(u, 0, 0) for u in _batch(0)] + [(u, 1, 1) for u in _batch(1)]
    with pytest.raises(KeyError):
        buf.take(2)  # nothing generated for it


def test_a_sample_put_twice_is_refused():
    buf = SampleBuffer(staleness=1)
    buf.put(0, [(0, 0), (1, 0)])
    with pytest.raises(ValueError, match="put twice"):
        buf.put(0, [(5, 0)])
    with pytest.raises(ValueError, match="put before"):
        buf.put(1, [(1, 0), (2, 0)])
    with pytest.raises(ValueError, match="put before"):
        buf.put(2, [(7, 0), (7, 0)])


def test_a_batch_generated_under_weights_older_than_the_bound_is_never_trained():
    buf = SampleBuffer(staleness=1)
    for step in range(2):
        buf.put(step, [(u, step) for u in _batch(step)])
        buf.take(step)
        buf.trained(step)
    buf.put(2, [(u, 0) for u in _batch(2)])  # generated under version 0, trained at step 2
    with pytest.raises(StaleSample, match="2 versions stale, the bound is 1"):
        buf.take(2)
    assert all(t.step < 2 for t in buf.ledger)


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        SampleBuffer(staleness=-1)


def test_one_step_off_generates_under_exactly_k_stale_weights_and_fully_async_under_the_newest():
    buf = SampleBuffer(staleness=1)
    for step in range(3):
        buf.put(step, [(u, buf.weights_for(step, newest=False)) for u in _batch(step)])
        buf.take(step)
        buf.trained(step)
    assert buf.version == 3 and [t.staleness for t in buf.ledger] == [0] * 3 + [1] * 6
    assert [buf.weights_for(n, newest=False) for n in range(5)] == [0, 0, 1, 2, 3]
    assert [buf.weights_for(n, newest=True) for n in range(5)] == [3] * 5
    with pytest.raises(ValueError, match="may not start"):
        buf.weights_for(5, newest=False)


def test_a_resumed_buffer_goes_on_after_its_ledger_under_the_checkpoints_weights():
    done = [Trained(uid, born, step) for step, born in ((0, 0), (1, 0)) for uid in (2 * step, 2 * step + 1)]
    buf = SampleBuffer.resumed(1, done)
    assert buf.version == 2 and buf.ledger == done
    # one step off would generate batch 2 under version 1, whose weights no checkpoint holds
    assert buf.weights_for(2, newest=False) == 2 and buf.weights_for(3, newest=False) == 2
    with pytest.raises(ValueError, match="put before"):
        buf.put(2, [(3, 2)])  # a sample the checkpoint's steps trained
    buf.put(2, [(4, 2), (5, 2)])
    assert buf.take(2) == ((4, 2), (5, 2)) and buf.trained(2) == 3
    with pytest.raises(ValueError, match="steps 0..1"):
        SampleBuffer.resumed(1, done[2:])  # step 1's samples without step 0's
