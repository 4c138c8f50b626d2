"""Issue 31 over the real socket: a real daemon serving from a thread (tests/nodes.py) and
real clients."""

import signal
import subprocess
import sys
import threading

import pytest
from nodes import ROOT, TOY, Node, ThreadNode
from waiting import HANG_S, wait_until

from jigsaw.runtime.client import Client
from jigsaw.runtime.paths import endpoint

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


# ------------------------------------------------------------------ item 9: identity without gaps

JOIN = ("import logging, sys; logging.basicConfig(level=logging.INFO)\n"
        "from jigsaw.runtime.client import Client\n"
        "c = Client(sys.argv[1], sys.argv[2]); print('JOINED' if c.connected else 'REFUSED', flush=True); c.close()")


def test_a_pipeline_made_without_a_token_belongs_to_the_process_that_made_it(tmp_path):
    """Any same-uid process could join a tokenless pipeline, and unregister it whole (its
    grant was lost).  Now only the process that made it joins; another is told why, loudly."""
    node = ThreadNode(tmp_path, devices=1)
    try:
        mine = node.client("A")
        with mine.substage("training") as g:
            assert g.substage
            other = subprocess.run([sys.executable, "-c", JOIN, "A", endpoint(node.dir)], capture_output=True,
                                   text=True, timeout=60)
            assert other.stdout.strip() == "REFUSED", other
            assert "ERROR" in other.stderr and "belongs to another job" in other.stderr and "WITHOUT" in other.stderr
            again = Client("A", endpoint(node.dir))  # this process: its own pipeline
            assert again.connected
            again.close()
            assert list(node.daemon.state.pipelines["A"].running) == [g.substage]
    finally:
        node.close()


def test_a_worker_of_a_jigsaw_run_job_started_without_its_environment_finds_the_token(tmp_path):
    """A worker started without $JIGSAW_OWNER was refused as name-taken and ran exclusive all
    job long; it now reads the token its `jigsaw run` keeps in the runtime directory."""
    node = Node(tmp_path)
    node.start("--devices", "1")
    out = tmp_path / "w.out"
    try:
        job = subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "run", "--name", "J", "--", "env", "-u",
                              "JIGSAW_OWNER", sys.executable, str(TOY), "--out", str(out), "--steps", "1",
                              "--work-ms", "5"], env=node.env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert job.returncode == 0, job.stderr
        lines = [ln.split() for ln in out.read_text().splitlines()]
        assert len(lines) == 5 and all(exclusive == "0" for *_, exclusive in lines), lines  # every piece granted
        assert not (node.dir / "owners" / "J").exists()  # the token leaves with its job
    finally:
        node.stop()


def test_an_admit_sent_to_a_daemon_that_died_returns_once_a_new_one_answers(tmp_path):
    """The Admit went to the daemon that was killed; the client's heartbeat joined the new
    one at once, so it looked connected, and the Admit waited for ever for a reply nobody
    would send.  The pipeline never talked to the new daemon again."""
    node = Node(tmp_path)
    node.start("--devices", "1", "--policy", "serial", "--max-wait-s", "None")
    a, b = Client("A", node.ep), Client("B", node.ep)
    got = {}

    def b_asks():
        with b.substage("training", step=0) as h:
            got["b"] = h

    try:
        with a.substage("training", step=0):
            t = threading.Thread(target=b_asks, daemon=True)
            t.start()
            wait_until(lambda: any(p.pending for p in node.pipelines().values()), HANG_S, "B waiting")
            node.daemon.kill()
            node.daemon.wait(10)
            node.start("--devices", "1", "--policy", "serial", "--max-wait-s", "None")
            t.join(30)
            assert not t.is_alive(), "B's Admit to the dead daemon never returned"
        with b.substage("training", step=1) as h:  # and B is scheduled by the new daemon
            assert h.substage == "B/1/r0/training/0"
    finally:
        a.close()
        b.close()
        node.stop()


def test_a_jobs_coupling_said_by_a_later_client_reaches_the_node(tmp_path):
    """`jigsaw run` registers the rollout side without a mode; the job's own client says it
    when it joins, and the scheduler's node state links the sides from then on."""
    node = ThreadNode(tmp_path, devices=2)
    try:
        node.client("J")
        late = Client("J", endpoint(node.dir), job="J", mode="one-step-off", staleness=1)
        node.clients["J-late"] = late
        assert late.connected
        p = node.daemon.state.pipelines["J"]
        assert (p.mode, p.staleness) == ("one-step-off", 1)
        said = wait_until(lambda: [e["data"] for e in node.events() if e["event"] == "job"] or None, HANG_S,
                          "the coupling in the trace")
        assert said == [{"job": "J", "mode": "one-step-off", "staleness": 1}]
    finally:
        node.close()
