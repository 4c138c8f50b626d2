"""Issue 31 over the real socket: a real daemon serving from a thread (tests/nodes.py) and
real clients."""

import signal
import threading

import pytest
from nodes import Node, ThreadNode
from waiting import HANG_S, wait_until

from jigsaw.runtime.client import Client

pytestmark = pytest.mark.timeout(120)


def test_a_client_whose_admit_is_refused_by_the_input_checks_runs_at_once(tmp_path):
    """The daemon answered an out-of-range Admit with req=0, which the client ignores: it
    waited for ever, heartbeats keeping it 'connected'.  Now it gets its refusal and runs
    the sub-stage without the daemon, saying so."""
    node = ThreadNode(tmp_path, devices=1)
    c = node.client("A")
    got = {}

    def ask():
        with c.substage("training", step=10**12) as h:  # past the protocol's bound for a step
            got["handle"] = h

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(30)
    try:
        assert not t.is_alive(), "the refused Admit was never answered"
        assert got["handle"].exclusive and c.fallen_open[-1]["reason"] == "refused"
    finally:
        node.close()


# ------------------------------------------------------------------ item 1: a stall over the lease heals


def test_after_a_stall_over_the_lease_the_pipeline_is_scheduled_again_and_nothing_runs_twice(tmp_path):
    """SIGSTOP the daemon past its clients' patience: the Done sent meanwhile went unanswered
    and was never sent again, the steps run without the daemon were never told, and after
    SIGCONT every Admit was refused ('step 3 jumps ahead of its step 0') until the job ended."""
    node = Node(tmp_path)
    node.start("--devices", "1")
    c = Client("A", node.ep)
    try:
        assert c.connected
        with c.substage("training", step=0) as h:
            assert h.substage == "A/0/r0/training/0"
            node.daemon.send_signal(signal.SIGSTOP)
            try:
                wait_until(lambda: not c.connected, HANG_S, "the client giving the stopped daemon up")
            except BaseException:
                node.daemon.send_signal(signal.SIGCONT)
                raise
        for step in (1, 2):  # run without the daemon, all device long
            with c.substage("rollout_decode", step=step) as h:
                assert h.exclusive
        node.daemon.send_signal(signal.SIGCONT)
        wait_until(lambda: c.connected, HANG_S, "the client back with the daemon")
        with c.substage("rollout_decode", step=3) as h:
            assert h.substage == "A/3/r0/rollout_decode/0", "the first Admit after the stall was not granted"
        (p,) = node.pipelines().values()
        assert p.step == 3 and not p.running  # the missed Done gave step 0's training back
        opened = [e for e in node.events() if e["event"] == "open"]
        assert sorted(e["data"]["step"] for e in opened) == [1, 2]  # each told once
    finally:
        c.close(pipeline_done=True)
        node.stop()
