"""A live worker tells the node what the simulator's engines tell it, over the real socket.

A real daemon serving in a thread of this process (so the test reads its node state) and a
real client: registration with the step count and response cap, a rollout regime's requests
(`rollout.progress`), samples done, finished turns' lengths, a rank with nothing to do: each
reaches the pipeline's facts in the daemon, and the trace records it as a request a replay
reads back.
"""

import threading
import time

import pytest

from jigsaw.node import inputs
from jigsaw.runtime.client import Client
from jigsaw.runtime.daemon import Daemon, DaemonConfig
from jigsaw.runtime.paths import endpoint
from jigsaw.trace import Trace

pytestmark = pytest.mark.timeout(120)


def wait_until(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.005)


@pytest.fixture
def daemon(tmp_path):
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    d = Daemon(DaemonConfig(devices=2, trace=tmp_path / "trace.jsonl"), rt)
    t = threading.Thread(target=d.serve, daemon=True)
    t.start()
    yield d, endpoint(rt), tmp_path / "trace.jsonl"
    d.stopping = True
    t.join(10)


def test_what_a_live_engine_knows_reaches_the_node_state(daemon):
    d, ep, trace = daemon
    c = Client("P", ep, devices=(0, 1), steps=3, max_tokens=512)
    try:
        wait_until(lambda: "P" in d.state.pipelines, "registration")
        p = d.state.pipelines["P"]
        assert p.steps == 3 and p.lengths is not None and p.lengths.max_tokens == 512
        c.no_rollout(1, 0)  # rank 1 got nothing this step
        ro = c.rollout(dp_rank=0, step=0)
        ro.start(2000)  # a prefill regime, admitted
        assert ro.progress([(300, 10), (280, 40), (350, 3)], mem_bytes=7 << 20, force=True)
        c.samples(0, 2, 5)
        wait_until(lambda: p.samples == (2, 5), "the samples")
        r = p.running[ro.grant.substage]
        assert r.live is not None and sorted(r.live.generated) == [3, 10, 40] and r.live.batch_size == 3
        assert r.need_bytes == 7 << 20 and p.ended == {1}
        c.lengths(range(1, 9000))  # more than one message holds: sent in parts, observed once
        wait_until(lambda: p.lengths.known, "the lengths")
        assert p.lengths.residual(0) == pytest.approx(4500.0)
        ro.close()
    finally:
        c.close()
    wait_until(lambda: "P" not in d.state.pipelines, "unregistration")
    events = Trace.read(trace).events
    got = {e.event: e for e in events if e.event in inputs.EVENTS.values()}
    assert {"request", "done", "progress", "samples", "lengths", "no_rollout"} <= set(got), sorted(got)
    progress = inputs.message("progress", got["progress"].data)
    assert progress.generated == (3, 10, 40) and progress.mem_bytes == 7 << 20  # the longest-running last
    assert sum(len(inputs.message("lengths", e.data).turns) for e in events if e.event == "lengths") == 8999
