"""How tests wait: on the condition itself, with a deadline; never a `sleep` standing in for it.

    wait_until(cond, timeout_s, what)   polls `cond` every POLL_S; its first truthy value, or the
                                        test fails saying `what` was not seen in `timeout_s`
    HANG_S                              the deadline of a wait for something that must happen
                                        eventually: it only catches a hang, and a loaded
                                        machine never reaches it
    alive(pid)                          whether a process still runs (a zombie does not)
    Hold(model, forwards)               an engine's generation thread stopped after its n-th
                                        forward until released: a test acts "mid-generation"
                                        at a step it chose, not at whatever step the race gave

A deadline bounds how long a broken run takes to fail; it is never what a test asserts.  A
test that needs "at once, not later" makes "later" impossible within the deadline (a scripted
clock, a heartbeat longer than the deadline) or reads the order of the daemon's own events.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.01
HANG_S = 60.0
"""Generous on purpose: far past what anything here takes on a loaded 2-core machine."""


def alive(pid: int) -> bool:
    """Whether `pid` still runs: it exists and is not a zombie (exited, not yet reaped)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def wait_until(cond: Callable[[], T], timeout_s: float, what: str) -> T:
    """`cond()`'s first truthy value; AssertionError naming `what` if none comes by the deadline.
    `cond` may itself fail the test (e.g. a process it depends on exited)."""
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(POLL_S)
    return got


class Hold:
    """Stop a model's forwards on other threads (an engine's generation thread) right after the
    `forwards`-th from now, until `release()`; forwards on the creating thread (a logprob
    recomputation the test asks for) pass.  A held thread goes on by itself after
    `timeout_s`, so a test that fails never leaves it stuck."""

    def __init__(self, model, forwards: int, timeout_s: float = HANG_S):
        self.forwards, self.timeout_s, self.seen = forwards, timeout_s, 0
        self._reached, self._go = threading.Event(), threading.Event()
        self._creator = threading.get_ident()
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if threading.get_ident() == self._creator:
            return
        self.seen += 1
        if self.seen == self.forwards:
            self._reached.set()
            self._go.wait(self.timeout_s)

    def reached(self) -> None:
        """Return once the held thread stands after its `forwards`-th forward."""
        wait_until(self._reached.is_set, HANG_S, f"the engine's forward {self.forwards}")

    def release(self) -> None:
        self._handle.remove()
        self._go.set()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
