"""Node runtime with real processes: daemon, `jigsaw run`, client API, leases, fail-open."""

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from nodes import ROOT, Node, ThreadNode
from waiting import HANG_S, wait_until

from jigsaw import protocol as pr
from jigsaw.graph.ids import SubStageId
from jigsaw.mux.partition.partitioners import Advisory
from jigsaw.runtime.client import connect
from jigsaw.runtime.paths import socket_path
from jigsaw.runtime.wire import Channel

KINDS = ("rollout_prefill", "rollout_decode", "rollout_tail", "reference", "training")


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    n.start()
    yield n
    n.stop()


def work_done(out: Path, steps: int) -> Counter:
    """(step, kind) of every finished sub-stage; all must be there exactly once."""
    done = Counter(tuple(line.split()[:2]) for line in out.read_text().splitlines())
    assert done == Counter({(str(s), k): 1 for s in range(steps) for k in KINDS}), done
    return done


def both_asking(node, tmp_path, *extra: str) -> tuple[subprocess.Popen, subprocess.Popen, Path]:
    """A and B under `jigsaw run`, each held in its first sub-stage (or its wait for it) until
    the file returned exists; returned once both have asked the daemon for one, so they run
    side by side from `go` on, however long either took to start."""
    go = tmp_path / "go"
    a, b = (node.run(p, tmp_path / f"{p.lower()}.out", *extra, "--pause-file", str(go)) for p in "AB")

    def asked() -> bool:
        assert a.poll() is None and b.poll() is None, "a pipeline exited before it asked for a sub-stage"
        got = node.pipelines()
        return all(p in got and got[p].requested for p in "AB")

    wait_until(asked, HANG_S, "A and B each asking for a sub-stage")
    return a, b, go


def test_two_pipelines_are_co_scheduled_and_the_trace_shows_the_plans(node, tmp_path):
    a, b, go = both_asking(node, tmp_path, "--steps", "3")
    go.touch()
    assert a.wait(60) == 0 and b.wait(60) == 0
    for out in ("a.out", "b.out"):
        work_done(tmp_path / out, 3)
    lines = [ln.split() for f in ("a.out", "b.out") for ln in (tmp_path / f).read_text().splitlines()]
    assert all(exclusive == "0" for *_, exclusive in lines)  # every sub-stage went through the daemon
    ev = node.events()
    granted = {e["substage"] for e in ev if e["event"] == "grant"}
    assert {sid for _, _, sid, _, _ in lines} == granted  # the workers ran what the plans granted
    shares = {sid: float(frac) for _, _, sid, frac, _ in lines}
    assert any(f < 1.0 for f in shares.values())  # the scheduler split the device at least once
    assert _overlap(ev, "A", "B")  # and the two pipelines ran side by side
    assert all(e["pipeline"] in "AB" for e in ev)
    steps = [e for e in ev if e["event"] == "step"]
    assert len(steps) == 6 and all(e["data"]["latency_s"] > 0 for e in steps)
    from jigsaw import timeline  # the runtime's trace draws like the simulator's

    tl = timeline.load(node.trace)
    doc = timeline.chrome_trace(tl)
    timeline.validate_chrome_trace(doc)
    drawn = {e["args"]["substage"] for e in doc["traceEvents"] if e["ph"] == "X" and e.get("cat") != "host"}
    assert drawn == granted and tl.mean_mfu_frac is not None and 0 < tl.mean_util_frac <= 1


def _overlap(events: list[dict], p: str, q: str) -> bool:
    held: dict[str, str] = {}
    for e in events:
        if e["event"] == "grant":
            held[e["substage"]] = e["pipeline"]
        elif e["event"] == "release":
            held.pop(e["substage"], None)
        if {p, q} <= set(held.values()):
            return True
    return False


def admitted_worker(node, tmp_path):
    """Worker A, one step, paused inside its first sub-stage once the daemon admitted it."""
    a = node.worker("A", tmp_path / "a.out", "--steps", "1", "--pause-file", str(tmp_path / "go"))
    node.running("A", a)
    return a


def test_a_killed_pipeline_loses_its_grants_to_its_lease_and_the_other_finishes(node, tmp_path):
    """How soon (one lease after its last message, not before) is the daemon's arithmetic,
    on a scripted clock: test_daemon_faults.py::test_a_silent_holder_loses_its_grants_one_lease_
    after_its_last_message.  Here: a real process killed mid-sub-stage is reclaimed by its
    lease expiring, and B runs to its end."""
    a = admitted_worker(node, tmp_path)
    b = node.run("B", tmp_path / "b.out", "--steps", "2")
    a.send_signal(signal.SIGKILL)  # mid-sub-stage: it holds a grant and never says done
    a.wait(10)
    wait_until(lambda: "A" not in node.pipelines(), HANG_S, "A's grants reclaimed")
    assert b.wait(60) == 0
    work_done(tmp_path / "b.out", 2)
    ev = node.events()
    assert [e["data"]["reason"] for e in ev if e["event"] == "drop" and e["pipeline"] == "A"] == ["lease expired"]
    assert any(e["event"] == "release" and e["pipeline"] == "A" and e["data"].get("reclaimed") == "lease expired"
               for e in ev)


def test_a_worker_stopped_past_its_lease_reports_the_sub_stage_that_fell_open(node, tmp_path):
    a = admitted_worker(node, tmp_path)
    a.send_signal(signal.SIGSTOP)  # holding a grant, its heartbeats stop (as on a starved machine)
    try:
        wait_until(lambda: "A" not in node.pipelines(), HANG_S, "A's lease expiring")
    finally:
        a.send_signal(signal.SIGCONT)
    (tmp_path / "go").touch()
    assert a.wait(60) == 0
    work_done(tmp_path / "a.out", 1)  # it went on: nothing lost or done twice
    ev = node.events()
    first = "A/0/r0/rollout_prefill/0"
    assert any(e["event"] == "release" and e["substage"] == first and e["data"].get("reclaimed") for e in ev)
    opened = [(e["substage"], e["data"]["reason"]) for e in ev if e["event"] == "open"]
    assert opened == [(first, "lost")]  # the worker knows it ran without the daemon, and says so once
    later = [e["substage"] for e in ev if e["event"] == "grant" and e["pipeline"] == "A"]
    assert later[0] == first and len(later) == 5  # the rest of the step went through the daemon again


def test_pipelines_finish_when_the_daemon_is_killed(node, tmp_path):
    a, b, go = both_asking(node, tmp_path, "--steps", "2", "--work-ms", "20")  # held until the daemon is gone
    node.daemon.send_signal(signal.SIGKILL)
    node.daemon.wait(10)
    go.touch()
    assert a.wait(60) == 0 and b.wait(60) == 0
    for out in ("a.out", "b.out"):
        work_done(tmp_path / out, 2)
    lines = (tmp_path / "a.out").read_text().splitlines() + (tmp_path / "b.out").read_text().splitlines()
    assert any(ln.endswith(" 1") for ln in lines)  # some ran exclusively, without the daemon


def test_pipelines_register_again_with_a_restarted_daemon(node, tmp_path):
    go = tmp_path / "go"  # A is held in its first sub-stage: it cannot end before the new daemon is up
    a = node.run("A", tmp_path / "a.out", "--steps", "2", "--work-ms", "20", "--pause-file", str(go))
    node.running("A", a)
    node.daemon.send_signal(signal.SIGKILL)
    node.daemon.wait(10)
    node.start()
    wait_until(lambda: (got := node.pipelines().get("A")) is not None and got.clients == 2, HANG_S,
               "A's worker and its jigsaw run registered with the new daemon")
    go.touch()
    assert a.wait(120) == 0
    work_done(tmp_path / "a.out", 2)
    ev = node.events()
    restarted = [i for i, e in enumerate(ev) if e["event"] == "node"][1]
    assert any(e["event"] == "grant" and e["pipeline"] == "A" for e in ev[restarted:])  # the new daemon schedules A


def test_run_returns_the_commands_exit_code_and_runs_without_a_daemon(tmp_path):
    env = dict(os.environ, JIGSAW_RUNTIME_DIR=str(tmp_path / "rt"))
    r = subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "run", "--no-start-daemon", "--",
                        sys.executable, "-c",
                        "import os; print(os.environ.get('JIGSAW_PIPELINE')); raise SystemExit(3)"],
                       env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 3
    assert "unscheduled" in r.stderr and r.stdout.strip().startswith("python")
    missing = subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "run"], env=env, capture_output=True,
                             text=True, timeout=60, cwd=ROOT)
    assert missing.returncode == 2 and "needs a command" in missing.stderr


def test_client_without_daemon_grants_exclusively():
    c = connect(pipeline="solo", endpoint=None)
    with c.substage("training", step=0) as g:
        assert g.exclusive and g.sm_frac == 1.0
    c.close()


def test_a_budget_change_reaches_a_running_worker_at_once_not_at_its_next_heartbeat(tmp_path):
    """The daemon's wall clock stands still, so a parked heartbeat never times out and no lease
    expires; a client sends its next heartbeat when the parked one has gone unanswered for five
    heartbeats, 300 s here, past the test's deadline.  A change reaches A within the deadline
    only if the change itself answers the heartbeat parked at the daemon, however loaded the
    machine."""
    beat_s = 60.0  # the longest a heartbeat may be held (Heartbeat.wait_s)
    assert 5 * beat_s > HANG_S
    n = ThreadNode(tmp_path, wall=lambda: 0.0, policy="muxserve", heartbeat_s=beat_s, lease_s=4 * beat_s)
    a, b = n.client("A"), n.client("B")
    try:
        with a.substage("rollout_decode", step=0) as ga:
            assert ga.sm_frac == 1.0  # alone on the device
            wait_until(lambda: n.daemon.sessions[a.session].parked, HANG_S, "A's heartbeat parked at the daemon")
            with b.substage("rollout_decode", step=0) as gb:
                wait_until(lambda: ga.sm_frac != 1.0, HANG_S, "A's budget change (only its parked heartbeat brings it)")
                assert ga.sm_frac + gb.sm_frac == pytest.approx(1.0), (ga.sm_frac, gb.sm_frac)
    finally:
        n.close()
    ev = n.events()
    delivered = [(SubStageId.parse(e["substage"]).pipeline, e["sm_frac"]) for e in ev if e["event"] == "delivered"]
    assert delivered[0] == ("A", 0.5)


def _kind(sid: str) -> str:
    return SubStageId.parse(sid).kind.value


def test_rollout_buckets_forward_steps_client_side(node):
    c = connect(pipeline="R", endpoint=node.ep)
    assert c.connected
    with c.rollout(dp_rank=0, step=0) as ro:
        kinds = [_kind(ro.forward(n, 0).substage) for n in [2000] * 20 + [300] * 30 + [0, 5000] * 3 + [10] * 40]
    c.close()
    assert ro.transitions == 3  # short fluctuations (the 5000-token blips) never split a regime
    assert kinds[0] == "rollout_prefill" and kinds[-1] == "rollout_tail"
    ev = [e for e in node.left("R") if e["pipeline"] == "R"]
    assert [_kind(e["substage"]) for e in ev if e["event"] == "grant"] == \
        ["rollout_prefill", "rollout_decode", "rollout_tail"]
    released = {e["substage"]: e["data"] for e in ev if e["event"] == "release"}
    assert sum(d["tokens"] for d in released.values()) == 20 * 2000 + 30 * 300 + 3 * 5000 + 40 * 10


def test_a_regime_reports_its_batch_and_sequence_length_as_the_graph_builder_summarises_them(node):
    """What prices a migration of a tail's requests: mean decoding requests per forward and
    KV tokens per request, sent with the regime's end (the daemon's graph keeps them)."""
    c = connect(pipeline="R", endpoint=node.ep)
    with c.rollout(dp_rank=0, step=0) as ro:
        for i in range(12):  # 4 then 2 requests decoding, 50 + i tokens of context each
            reqs = 4 if i < 6 else 2
            ro.forward(0, reqs, kv_tokens=reqs * (50 + i))
    c.close()
    (done,) = [e["data"] for e in node.left("R") if e["event"] == "done" and e["pipeline"] == "R"]
    assert done["num_steps"] == 12 and done["batch_size"] == pytest.approx(36 / 12)
    assert done["seq_len"] == pytest.approx(sum((4 if i < 6 else 2) * (50 + i) for i in range(12)) / 36)


def test_a_gang_is_asked_for_at_once_and_each_member_runs_on_its_own_device(tmp_path):
    """A trainer's ranks as one lockstep stage: every member's request reaches the daemon in
    one read, before it decides (one at a time, a daemon that starts gangs whole would wait on
    the member not yet asked, or start half of it), and each member gets its DP rank's device."""
    n = Node(tmp_path)
    n.start("--devices", "2")
    c = connect(pipeline="T", endpoint=n.ep)
    try:
        with c.gang("training", members=[(0, (os.getpid(),)), (1, (os.getpid(),))], step=0) as hs:
            assert [h.device for h in hs] == [0, 1] and not any(h.exclusive for h in hs)
            assert len({h.substage for h in hs}) == 2
            for h in hs:
                h.report(batch_size=4.0)
    finally:
        c.close()
        n.stop()
    every = n.events()
    order = [e["event"] for e in every if e["event"] == "plan" or (e["pipeline"] == "T" and e["event"] == "request")]
    assert order[:3] == ["request", "request", "plan"], order  # read together, decided once: never half a gang
    ends = [e["event"] for e in every if e["event"] == "plan" or (e["pipeline"] == "T" and e["event"] == "done")]
    first = ends.index("done")
    assert ends[first:first + 2] == ["done", "done"], ends  # ended together as well: no decision between
    ev = [e for e in every if e["pipeline"] == "T"]
    assert sorted(e["data"]["rank"] for e in ev if e["event"] == "request") == [0, 1]
    assert [e["data"]["batch_size"] for e in ev if e["event"] == "done"] == [4.0, 4.0]


def test_readme_client_example_runs_under_jigsaw_run(node, tmp_path):
    import re

    code = re.search(r"```py\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "run", "--name", "ex", "--", sys.executable,
                        str(script)], env=node.env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 10 and not any("exclusive" in ln for ln in lines)
    assert {e["substage"] for e in node.events() if e["event"] == "grant"} >= {"ex/1/r0/training/0"}


def test_metrics_port_serves_prometheus_text(tmp_path):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = Node(tmp_path)
    n.start("--metrics-port", str(port))
    try:
        c = connect(pipeline="M", endpoint=n.ep)
        with c.substage("training", step=0):
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        c.close()
    finally:
        n.stop()
    assert "jigsaw_pipelines 1.0" in text and "jigsaw_running_substages 1.0" in text
    assert 'jigsaw_trace_events_total{event="grant"} 1.0' in text


def test_run_forwards_signals_to_the_command(tmp_path):
    env = dict(os.environ, JIGSAW_RUNTIME_DIR=str(tmp_path / "rt"))
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
             "print('ready', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "run", "--no-start-daemon", "--", sys.executable,
                          "-c", child], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 7


def test_out_of_order_requests_get_errors_and_change_nothing(node):
    s = Channel(socket_path(node.ep))

    def ask(msg):
        s.send(pr.encode(msg))
        assert s.poll(5000)
        return pr.decode_reply(s.recv())

    try:
        reg = ask(pr.Register(pipeline="O", pid=os.getpid(), req=1))
        done = ask(pr.Done(session=reg.session, substage="O/0/r0/training/0", req=2))  # never admitted
        assert isinstance(done, pr.Error) and done.code == "out-of-order"
        assert isinstance(ask(pr.Admit(session=reg.session, kind="training", dp_rank=0, step=3, req=3)), pr.Grant)
        old = ask(pr.Admit(session=reg.session, kind="training", dp_rank=0, step=1, req=4))  # a finished step
        assert isinstance(old, pr.Error) and old.code == "out-of-order" and "already finished" in old.message
        bad_kind = ask(pr.Admit(session=reg.session, kind="juggling", dp_rank=0, step=3, req=5))
        assert isinstance(bad_kind, pr.Error) and bad_kind.req == 5
        st = node.status()
        assert [p.running for p in st.pipelines if p.name == "O"] == [("O/3/r0/training/0",)]
    finally:
        s.close()


def test_gpu_options_without_a_gpu_leave_the_daemon_serving(tmp_path):
    """Green partitions, MPS and NVML telemetry are absent here: the daemon says so and schedules."""
    n = Node(tmp_path)
    n.start("--partitioner", "green", "--mps", "--telemetry-s", "0.1")
    try:
        c = connect(pipeline="G", endpoint=n.ep)
        with c.substage("training", step=0) as g:
            assert not g.exclusive and isinstance(g.partition, Advisory)  # the green partitioner failed over
        c.close()
    finally:
        n.stop()
    log = n.log.read_text()
    assert "MPS:" in log and "telemetry off" in log and "green partitioner unavailable" in log


@pytest.mark.parametrize("policy", ["serial", "split", "static", "muxserve", "rollmux", "hrrs", "streamrl", "areal",
                                    "greedy", "jigsaw"])
def test_the_daemon_runs_every_policy_live(tmp_path, policy):
    from jigsaw.graph.policies import NAMES

    assert policy in NAMES  # the list above is every policy `make` knows
    assert len(NAMES) == 10
    n = Node(tmp_path)
    # verl's order: with a max-wait (2 s by default) a loaded machine would start B beside A
    n.start("--policy", policy, *(("--max-wait-s", "None") if policy == "serial" else ()))
    try:
        a, b, go = both_asking(n, tmp_path, "--steps", "2", "--work-ms", "40")  # side by side: 0.4 s of work each
        go.touch()
        assert a.wait(90) == 0 and b.wait(90) == 0
    finally:
        n.stop()
    for out in ("a.out", "b.out"):
        work_done(tmp_path / out, 2)
    ev = n.events()
    assert [e["data"]["policy"] for e in ev if e["event"] == "node"] == [policy]
    plans = [e["data"] for e in ev if e["event"] == "plan"]
    assert plans and not any(p["fallback"] for p in plans)  # the policy itself decided every time
    lines = [ln.split() for f in ("a.out", "b.out") for ln in (tmp_path / f).read_text().splitlines()]
    assert all(exclusive == "0" for *_, exclusive in lines)
    if policy == "serial":  # verl: whole steps back to back, one pipeline on the device at a time
        assert not _overlap(ev, "A", "B") and all(float(frac) == 1.0 for _, _, _, frac, _ in lines)
    if policy == "jigsaw":
        assert _overlap(ev, "A", "B")
    if policy == "static":  # half the device each, every sub-stage, side by side
        assert _overlap(ev, "A", "B") and all(float(frac) == 0.5 for _, _, _, frac, _ in lines)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a disk that is always full)")
def test_a_trace_that_cannot_be_written_stops_and_the_daemon_keeps_serving(tmp_path):
    n = Node(tmp_path)
    n.trace = Path("/dev/full")  # every write fails with ENOSPC, as on a full disk
    n.start()
    try:
        a = n.run("A", tmp_path / "a.out", "--steps", "2")
        assert a.wait(60) == 0
        work_done(tmp_path / "a.out", 2)  # scheduled through to the end, nothing lost
        assert n.daemon.poll() is None and isinstance(n.status(), pr.StatusReply)
    finally:
        n.stop()


def test_a_change_of_memory_alone_moves_no_process_a_change_of_cores_does(monkeypatch):
    """A budget change whose partition is the one the worker is on (on a CPU: memory from
    half to whole when a partner ends) updates the handle but re-pins nothing; new cores do."""
    from jigsaw import protocol as pr
    from jigsaw.mux.partition.partitioners import Cpu
    from jigsaw.runtime.client import GrantHandle

    c = connect(pipeline="P", endpoint=None)
    bound = []
    monkeypatch.setattr(c, "_bind", lambda h: bound.append((h.substage, h.partition)))
    half = Cpu(cores=(0,), threads=1)
    c._live["P/0/r0/rollout_tail/0"] = GrantHandle(substage="P/0/r0/rollout_tail/0", device=0, sm_frac=0.5,
                                                   mem_bytes=1, partition=half)
    c._live["P/0/r0/training/0"] = GrantHandle(substage="P/0/r0/training/0", device=0, sm_frac=0.5, mem_bytes=1,
                                               partition=half)
    whole = Cpu(cores=(0, 1), threads=2)
    c._changed((pr.Grant(substage="P/0/r0/rollout_tail/0", device=0, sm_frac=0.5, mem_bytes=2, partition=half),
                pr.Grant(substage="P/0/r0/training/0", device=0, sm_frac=1.0, mem_bytes=2, partition=whole)))
    assert bound == [("P/0/r0/training/0", whole)]
    assert [h.mem_bytes for h in c._live.values()] == [2, 2]
    c.close()


def test_run_with_an_slo_registers_it_and_the_steps_are_measured_against_it(node, tmp_path):
    out = tmp_path / "a.out"
    proc = subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "run", "--name", "A", "--slo", "1.5", "--",
                             sys.executable, str(ROOT / "tests" / "workers" / "toy_pipeline.py"), "--out", str(out),
                             "--steps", "2"], env=node.env, cwd=ROOT)
    assert proc.wait(60) == 0
    work_done(out, 2)
    events = node.events()
    (reg,) = [e for e in events if e["event"] == "pipeline" and e["pipeline"] == "A"]
    assert reg["data"]["slo_slowdown"] == 1.5
    steps = [e["data"] for e in events if e["event"] == "step" and e["pipeline"] == "A"]
    assert len(steps) == 2 and all(s["slo_slowdown"] == 1.5 for s in steps), steps
    for s in steps:  # alone on the node: each step as fast as its pieces' exclusive work allows
        assert s["exclusive_s"] > 0 and s["slo_kept"] == (s["step_slowdown"] <= 1.5 + 1e-6), s
