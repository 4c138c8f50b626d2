"""Issue 31 over the real socket: a real daemon serving from a thread (tests/nodes.py) and
real clients."""

import threading

import pytest
from nodes import ThreadNode

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
