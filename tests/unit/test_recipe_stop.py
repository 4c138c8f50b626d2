"""SIGTERM in a run made of steps (recipes/checkpoint.py StopAtStepEnd): within a step, the step
runs to its end and the run stops after it; between steps, it stops at once; once the steps are
over, nothing is cut short; the previous handler comes back."""

from __future__ import annotations

import os
import signal
import time

import pytest

from jigsaw.recipes.checkpoint import StopAtStepEnd, Stopped

pytestmark = pytest.mark.timeout(30)


def _term() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # the handler runs in this (the main) thread at the next instruction


def test_sigterm_lets_a_step_end_stops_between_steps_at_once_and_spares_the_clean_up():
    before = signal.getsignal(signal.SIGTERM)
    done = []
    with StopAtStepEnd() as stop:
        with stop.step():
            done.append(0)
        assert not stop.requested
        with pytest.raises(Stopped):
            with stop.step():
                _term()
                done.append(1)  # reached: the step in flight ran to its end
        assert done == [0, 1] and stop.requested
        t0 = time.monotonic()
        with pytest.raises(Stopped):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(20)  # between steps (a gate, a load): cut short
        assert time.monotonic() - t0 < 10
        stop.ended()
        _term()  # the processes' clean-up after the last step: not interrupted
    assert signal.getsignal(signal.SIGTERM) == before
