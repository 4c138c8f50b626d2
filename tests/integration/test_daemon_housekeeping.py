"""The daemon's housekeeping: what an on-demand daemon runs with, status and stop, idle exit, the
default trace and its rotation, the files a leaving daemon removes, and `jigsaw run` saying
when its pipeline runs unscheduled.

Node-facing tests run real processes in a fresh 0700 runtime directory under tmp_path; every
wait has a deadline.  Timer logic (idle exit) is driven on a scripted clock.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nodes import ROOT, Node
from recorder import Recorder
from waiting import HANG_S, wait_until

from jigsaw import protocol as pr
from jigsaw.profiles import CPU_DEFAULT, CPU_PER_CORE, resolve
from jigsaw.runtime import housekeeping, node_info
from jigsaw.runtime.client import Client, connect
from jigsaw.runtime.client import status as ask_status

pytestmark = pytest.mark.timeout(120)


def jigsaw(*args: str, env: dict | None = None, timeout_s: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jigsaw.cli.main", *args], env=env or dict(os.environ), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture
def rt(tmp_path, monkeypatch) -> Path:
    """A fresh private runtime directory, in this process's environment (and its children's)."""
    path = tmp_path / "rt"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("JIGSAW_RUNTIME_DIR", str(path))
    monkeypatch.delenv("JIGSAW_ENDPOINT", raising=False)
    return path


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.stop()


def left_behind(directory: Path) -> list[str]:
    return [f for f in ("daemon.sock", "daemon.lock") if (directory / f).exists()]


# ------------------------------------------------------------------ what an on-demand daemon runs with

def test_without_nvml_the_cpu_grid_partitioner_and_one_device_are_chosen(monkeypatch):
    def no_driver():
        raise OSError("NVML Shared Library Not Found")

    monkeypatch.setattr(node_info, "_nvml_names", no_driver)
    probe = node_info.probe()
    assert probe.gpus == () and "NVML Shared Library Not Found" in probe.no_gpu and probe.cores >= 1
    choice = node_info.choose(probe)
    assert (choice.devices, choice.profile, choice.partitioner) == (1, CPU_DEFAULT, "cpu")
    assert choice.warnings == () and "no GPU" in choice.summary and CPU_DEFAULT in choice.summary


@pytest.mark.parametrize("gpu, count, profile, warned", [
    ("NVIDIA H100 80GB HBM3", 2, "h100/qwen3-4b", False),
    ("NVIDIA A100-SXM4-80GB", 4, "a100/qwen3-4b", False),
    ("NVIDIA L40S", 1, "h100/qwen3-4b", True),
])
def test_gpus_found_by_nvml_choose_a_prior_by_sku_and_a_device_each(gpu, count, profile, warned):
    choice = node_info.choose(node_info.Probe(gpus=(gpu,) * count, cores=16))
    assert (choice.devices, choice.profile, choice.partitioner) == (count, profile, "advisory")
    assert resolve(choice.profile).is_file()  # a name the daemon can load
    assert f"{count} × {gpu}" in choice.summary
    assert bool(choice.warnings) == warned and all(gpu in w and "h100" in w for w in choice.warnings)


@pytest.mark.parametrize("state, warned", [("running", False), ("stopped", True), ("no-binary", True), ("", False)])
def test_a_gpu_node_without_mps_is_told_its_pipelines_will_be_time_sliced(state, warned):
    choice = node_info.choose(node_info.Probe(gpus=("NVIDIA H100 80GB HBM3",), cores=16, mps=state))
    said = [w for w in choice.warnings if "time-sliced" in w]
    assert bool(said) == warned and all(state in w and "--mps" in w for w in said)


@pytest.mark.parametrize("probe, words, devices, profile", [
    (node_info.Probe(cores=2), ["trainer.n_gpus_per_node=2"], 2, CPU_PER_CORE),  # a core per replica
    (node_info.Probe(cores=8), ["trainer.n_gpus_per_node=2"], 2, CPU_DEFAULT),  # 4 cores each: split them
    (node_info.Probe(cores=2), ["trainer.nnodes=1"], 1, CPU_DEFAULT),  # verl's default GPUs: not said
    (node_info.Probe(cores=2), ["trainer.n_gpus_per_node=4"], 1, CPU_DEFAULT),  # more than cores: as chosen
    (node_info.Probe(gpus=("NVIDIA H100 80GB HBM3",) * 8, cores=64), ["trainer.n_gpus_per_node=2"], 8,
     "h100/qwen3-4b"),  # real GPUs: one device each, whatever the job uses
])
def test_a_verl_job_on_a_cpu_node_gets_a_device_per_fake_gpu(probe, words, devices, profile):
    from jigsaw.cli.run import verl_on_cpu

    cmd = ["python", "-m", "verl.trainer.main_ppo", *words]
    choice = verl_on_cpu(node_info.choose(probe), probe, cmd)
    assert (choice.devices, choice.profile) == (devices, profile)
    assert resolve(choice.profile).is_file()


def test_pynvml_is_imported_only_when_the_node_is_probed():
    probe = ("import sys, jigsaw.runtime.node_info, jigsaw.cli.run, jigsaw.cli.daemon\n"
             "print('pynvml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.split() == ["False"], out.stderr


@pytest.mark.timeout(180)
def test_run_starts_a_daemon_with_what_the_node_has_and_a_trace_in_traces(rt):
    expected = node_info.choose(node_info.probe())
    try:
        out = jigsaw("run", "--start-timeout-s", "60", "--", sys.executable, "-c", "print('ran')")
        assert out.returncode == 0 and out.stdout.strip() == "ran", out.stderr
        assert f"starting a daemon for this node ({expected.summary}" in out.stderr
        st = ask_status(f"ipc://{rt / 'daemon.sock'}", 5.0)
        assert st is not None, (rt / "daemon.log").read_text()
        assert (st.profile, st.devices, st.partitioner) == (expected.profile, expected.devices, expected.partitioner)
        if not node_info.probe().gpus:
            assert (st.profile, st.devices, st.partitioner) == (CPU_DEFAULT, 1, "cpu")
            assert st.grid == str(resolve(CPU_DEFAULT))
        assert st.idle_exit_s == 600
        trace = Path(st.trace.removeprefix("writing "))
        assert st.trace.startswith("writing ") and trace.parent == rt / "traces" and trace.is_file()
        assert '"event":"node"' in trace.read_text().replace(" ", "")
        assert expected.summary in (rt / "daemon.log").read_text()
    finally:
        jigsaw("daemon", "stop")


# ------------------------------------------------------------------ status and stop

def test_status_and_stop_without_a_daemon(rt, tmp_path):
    status = jigsaw("daemon", "status")
    assert status.returncode == 1 and "no daemon running" in status.stdout, status
    stop = jigsaw("daemon", "stop")
    assert stop.returncode == 0 and "no daemon running" in stop.stdout, stop
    missing = dict(os.environ, JIGSAW_RUNTIME_DIR=str(tmp_path / "none"))
    assert jigsaw("daemon", "status", env=missing).returncode == 1
    assert not (tmp_path / "none").exists()  # status never creates the directory
    flags = jigsaw("daemon", "status", "--devices", "2")
    assert flags.returncode == 2 and "takes no daemon options" in flags.stderr


def test_migrate_moves_a_running_rollout_and_says_why_when_nothing_can_move(node):
    node.start("--devices", "2")
    c = Client("grpo-m", node.ep, owner="job-token")
    job = dict(node.env, JIGSAW_OWNER="job-token")  # an operator of the job (`jigsaw run` keeps it for them too)
    try:
        refused = jigsaw("daemon", "migrate", "--pipeline", "grpo-m", "--source-rank", "1", "--target-rank", "0",
                         env=job)
        assert refused.returncode == 1 and "no rollout running on DP rank 1" in refused.stdout, refused
        stranger = jigsaw("daemon", "migrate", "--pipeline", "grpo-m", "--source-rank", "1", "--target-rank", "0",
                          env=node.env)
        assert stranger.returncode == 1 and "belongs to another job" in stranger.stdout, stranger
        with c.substage("rollout_tail", dp_rank=1, step=0) as g:
            out = jigsaw("daemon", "migrate", "--pipeline", "grpo-m", "--source-rank", "1", "--target-rank", "0",
                         env=job)
            wait_until(lambda: g.migrations, HANG_S, "the order at the source's worker (sent like a budget change)")
        assert out.returncode == 0 and "grpo-m/0/r1/rollout_tail/0" in out.stdout, out
        assert [(m.source_rank, m.target_rank) for m in g.migrations] == [(1, 0)]
    finally:
        c.close()
    usage = jigsaw("daemon", "migrate", "--pipeline", "grpo-m", env=node.env)
    assert usage.returncode == 2 and "needs --pipeline, --source-rank and --target-rank" in usage.stderr
    assert [e["substage"] for e in node.events() if e["event"] == "migration"] == ["grpo-m/0/r1/rollout_tail/0"]


def test_status_shows_the_running_daemon(node):
    node.start("--policy", "greedy", "--devices", "2")
    c = connect(pipeline="grpo-a", endpoint=node.ep)
    try:
        with c.substage("training", step=0):
            out = jigsaw("daemon", "status", env=node.env)
    finally:
        c.close()
    assert out.returncode == 0, out
    text = out.stdout
    assert f"jigsaw daemon {node.daemon.pid} at {node.ep}, up " in text
    assert re.search(r"devices +2 \(partitioner advisory\)", text) and re.search(r"policy +greedy", text)
    assert re.search(r"profile +\(default\): analytic prior", text)
    assert f"writing {node.trace}" in text and re.search(r"idle exit +never", text)
    assert "grpo-a: 1 client(s), step 0, sub-stages asked 1, granted 1, running 1, waiting 0" in text


def test_stop_stops_the_daemon_and_leaves_no_socket_or_lock(node):
    node.start()
    out = jigsaw("daemon", "stop", env=node.env)
    assert out.returncode == 0 and f"stopped jigsaw daemon {node.daemon.pid}" in out.stdout, out
    assert node.daemon.wait(10) == 0
    assert left_behind(node.dir) == []
    assert "stop requested" in node.log.read_text()
    again = jigsaw("daemon", "stop", env=node.env)
    assert again.returncode == 0 and "no daemon running" in again.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_leaves_no_socket_or_lock(node, sig):
    node.start()
    assert left_behind(node.dir) == ["daemon.sock", "daemon.lock"]
    node.daemon.send_signal(sig)
    assert node.daemon.wait(20) == 0
    assert left_behind(node.dir) == []


def test_a_leaving_daemon_removes_only_files_that_are_still_its_own(tmp_path):
    directory = tmp_path / "rt"
    directory.mkdir(mode=0o700)
    home = housekeeping.Home(directory)
    listener = home.listen(directory, lambda: b"", lambda n: b"", time.monotonic)
    (directory / "daemon.sock").unlink()  # another daemon's socket and lock now stand there
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(directory / "daemon.sock"))
    (directory / "daemon.lock").unlink()
    (directory / "daemon.lock").write_text("12345")
    try:
        home.close(listener)
        assert (directory / "daemon.sock").is_socket() and (directory / "daemon.lock").read_text() == "12345"
    finally:
        other.close()
    mine = housekeeping.Home(tmp_path / "rt")  # and its own are removed
    mine.close(mine.listen(directory, lambda: b"", lambda n: b"", time.monotonic))
    assert left_behind(directory) == []


# ------------------------------------------------------------------ idle exit

def test_an_idle_daemon_exits_by_itself_and_says_why(rt):
    log = rt.parent / "daemon.log"
    with open(log, "ab") as f:
        d = subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "daemon", "--idle-exit-s", "1", "--no-trace"],
                             stdout=f, stderr=f, cwd=ROOT)
    try:
        assert d.wait(60) == 0
    finally:
        if d.poll() is None:
            d.kill()
    assert "no pipeline registered for 1 s (idle_exit_s): exiting" in log.read_text()
    assert left_behind(rt) == [] and not (rt / "traces").exists()


def test_idle_exit_waits_for_the_last_pipeline_to_leave(tmp_path):
    d = Recorder(tmp_path, idle_exit_s=1.0, lease_s=100.0)
    session = d.register("A")
    d.run_for(5.0)
    assert not d.stopping  # a registered pipeline keeps it, however long it is quiet
    d.ask(pr.Unregister(session=session, pipeline_done=True))
    d.run_for(0.9)
    assert not d.stopping
    d.run_for(0.2)
    assert d.stopping


def test_idle_exit_is_off_by_default(tmp_path):
    d = Recorder(tmp_path)
    d.run_for(5.0)
    assert not d.stopping


def test_status_counts_each_pipelines_requests_and_grants(tmp_path):
    d = Recorder(tmp_path, devices=1)
    a, _ = d.register("A"), d.register("B")
    (grant,) = d.ask(pr.Admit(session=a, kind="training", dp_rank=0, step=0, req=5))
    assert isinstance(grant, pr.Grant)
    (st,) = d.ask(pr.Status(req=6))
    counts = {p.name: (p.requested, p.granted) for p in st.pipelines}
    assert counts == {"A": (1, 1), "B": (0, 0)}
    assert (st.policy, st.devices, st.profile, st.idle_exit_s) == ("jigsaw", 1, "", None)


def test_a_status_reply_of_an_older_daemon_decodes_with_defaults():
    old = {"type": "status_reply", "v": 3, "req": 1, "pid": 7, "refused": 0, "errors": 0, "trace": "off",
           "pipelines": [{"name": "A", "clients": 1, "step": 0, "running": [], "pending": []}]}
    import msgspec

    st = pr.decode_reply(msgspec.msgpack.encode(old))
    assert st.pipelines[0].requested == 0 and st.devices == 0 and st.idle_exit_s is None


# ------------------------------------------------------------------ the default trace

def test_trace_rotation_keeps_the_newest_20_and_touches_nothing_else(tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    for i in range(25):
        p = traces / f"daemon-2026010{i // 10}-0000{i % 10:02d}-{100 + i}.jsonl"
        p.write_text("{}\n")
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
    others = [traces / "notes.txt", traces / "node.jsonl", traces / "daemon-x.json"]
    for p in others:
        p.write_text("keep")
    by_age = sorted(traces.glob("daemon-*.jsonl"), key=lambda p: p.stat().st_mtime)
    gone = housekeeping.prune_traces(tmp_path, 20)
    assert sorted(gone) == sorted(by_age[:5])
    assert sorted(traces.glob("daemon-*.jsonl")) == sorted(by_age[5:])
    assert all(p.read_text() == "keep" for p in others)
    new = housekeeping.fresh_trace(tmp_path)  # a new daemon's trace counts among the 20
    assert new.parent == traces and not new.exists()
    assert sorted(traces.glob("daemon-*.jsonl")) == sorted(by_age[6:])


def test_a_daemon_without_trace_options_writes_a_fresh_trace(node):
    node.trace = None
    with open(node.log, "ab") as log:  # Node.start names a trace: start this one without
        node.daemon = subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "daemon"], env=node.env,
                                       stdout=log, stderr=log, cwd=ROOT)
    wait_until(node.status, HANG_S, "the daemon answering a status request")
    st = node.status(2.0)
    written = list((node.dir / "traces").glob("daemon-*.jsonl"))
    assert len(written) == 1 and st.trace == f"writing {written[0]}"
    node.stop()
    assert left_behind(node.dir) == [] and written[0].is_file()  # the trace stays


# ------------------------------------------------------------------ jigsaw run: unscheduled pipelines

WARNED = "asked the jigsaw daemon for no sub-stage"
UNTIL_WARNED = f"""
import pathlib, sys, time
said, deadline = pathlib.Path(sys.argv[1]), time.monotonic() + {HANG_S}
while {WARNED!r} not in said.read_text():  # running until jigsaw run has checked, however late
    assert time.monotonic() < deadline, "jigsaw run never warned"
    time.sleep(0.01)
time.sleep(2)  # the scenario: running on for two more --warn-unscheduled-s, in which a second warning would come
"""


def test_run_warns_once_when_the_command_asks_for_no_sub_stage(node, tmp_path):
    node.start()
    said = tmp_path / "run.stderr"  # jigsaw run's stderr, which the command reads
    with open(said, "w") as err:
        out = subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "run", "--name", "quiet",
                              "--warn-unscheduled-s", "1", "--", sys.executable, "-c", UNTIL_WARNED, str(said)],
                             env=node.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, timeout=90)
    stderr = said.read_text()
    assert out.returncode == 0, stderr
    assert stderr.count(WARNED) == 1, stderr
    assert "quiet" in stderr and "runs unscheduled" in stderr and "client API" in stderr


def test_run_says_nothing_when_the_command_admits_a_sub_stage(node, tmp_path):
    node.start()
    example = re.search(r"```py\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    script = tmp_path / "example.py"
    # The scenario: the example asks for its sub-stages within a second of its start (it admits
    # nothing else first), jigsaw run checks at 5 s, and the command sleeps on to 7 s.  jigsaw
    # run's check has no observable of its own when it finds nothing to say.
    script.write_text(example + "\nimport time\ntime.sleep(7)  # still running when jigsaw run checks\n")
    t0 = time.monotonic()
    out = jigsaw("run", "--name", "ex", "--warn-unscheduled-s", "5", "--", sys.executable, str(script),
                 env=node.env)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 > 5  # ran past the check (a lower bound: load only lengthens it)
    assert "unscheduled" not in out.stderr, out.stderr
    assert any(e["event"] == "grant" and e["pipeline"] == "ex" for e in node.events())


def test_run_names_a_framework_without_an_integration_at_start(node):
    node.start()
    out = jigsaw("run", "--name", "v", "--warn-unscheduled-s", "1", "--", sys.executable, "-c",
                 "import time; time.sleep(2)", "sglang.launch_server", env=node.env)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "unscheduled" in ln]
    assert len(lines) == 1 and "sglang has no jigsaw integration in this version" in lines[0], out.stderr


def test_run_hands_a_verl_job_rays_runtime_env_hook(node):
    """A verl command gets the hook that gives every Ray worker jigsaw's env; a command that
    is not verl does not, and a hook the user set is kept."""
    node.start()
    show = "import os; print('HOOK=' + os.environ.get('RAY_RUNTIME_ENV_HOOK', '-'))"
    verl = jigsaw("run", "--name", "v", "--warn-unscheduled-s", "0", "--", sys.executable, "-c", show,
                  "verl.trainer.main_ppo", env=node.env)
    plain = jigsaw("run", "--name", "p", "--warn-unscheduled-s", "0", "--", sys.executable, "-c", show, env=node.env)
    own = jigsaw("run", "--name", "o", "--framework", "verl", "--warn-unscheduled-s", "0", "--", sys.executable,
                 "-c", show, env={**node.env, "RAY_RUNTIME_ENV_HOOK": "mine.hook"})
    assert "HOOK=jigsaw.integrations.verl.ray_env.runtime_env_hook" in verl.stdout, verl.stderr
    assert "HOOK=-" in plain.stdout and "HOOK=mine.hook" in own.stdout, own.stderr
    assert "already 'mine.hook'" in own.stderr, own.stderr


@pytest.mark.parametrize("argv, framework", [
    (("python", "-m", "verl.trainer.main_ppo", "data.train_batch_size=8"), "verl"),
    (("python3", "/opt/verl/trainer/main_ppo.py"), "verl"),
    (("python", "-m", "sglang.launch_server", "--model", "x"), "sglang"),
    (("python", "train.py", "actor_rollout_ref.rollout.name=sglang"), None),
    (("python", "reverl.py", "--verl-like"), None),
])
def test_frameworks_are_recognised_from_argv(argv, framework):
    from jigsaw.cli.run import recognise

    assert recognise(argv) == framework
