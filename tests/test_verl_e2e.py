"""Two unmodified verl 0.9.1 GRPO jobs under `jigsaw run`, one CPU-partitioning daemon (verl venv).

    assets: tiny Qwen3 + GSM8K-format parquet, made here
    daemon (--partitioner cpu, the shipped cpu/tiny-qwen3 grid) ─► trace
    jigsaw run --name verl-s1 -- python -m verl.trainer.main_ppo <CPU overrides, seed 1>
    jigsaw run --name verl-s2 -- python -m verl.trainer.main_ppo <CPU overrides, seed 2>
        2 rollout replicas each (jigsaw's engine), 2 trainer ranks each
    while they run: Cpus_allowed_list of every granted pid (binding.Sampler), and the summed
    RSS of both jobs' process trees

Checked: both exit 0; every verl stage of every step of both jobs was requested under its
verl name and granted; the jobs held the same cores at once with split budgets; the workers'
real affinity matched their grants; the pair fits in this machine's memory.  A second pair
loses its daemon to `kill -9` mid-run and still finishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install -c constraints.txt -e '.[dev,verl]'")

from binding import Sampler, holdings, off_cores  # noqa: E402
from nodes import ROOT, Node  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.timeout(900)]

STEPS = 3
STAGES = ("gen", "old_log_prob", "ref", "update_actor", "update_weights")
"""verl's stage names (its `marked_timer` names) each step of these jobs runs."""
MEM_LIMIT_BYTES = 20 * 2**30
"""Both jobs together, leaving room for the test runner on this 24 GiB machine."""
JOB_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, Path]:
    from jigsaw.integrations.verl.assets import make_gsm8k, make_model

    tmp = tmp_path_factory.mktemp("verl-assets")
    make_gsm8k(tmp / "data")
    return make_model(tmp / "model"), tmp / "data"


def job(node: Node, assets, seed: int, tmp: Path, steps: int = STEPS) -> subprocess.Popen:
    from jigsaw.integrations.verl.job import JobConfig, cpu_env, grpo_command

    model, data = assets
    cmd = grpo_command(JobConfig(model=model, data=data, seed=seed, steps=steps, out=tmp / f"out-s{seed}"))
    log = open(tmp / f"verl-s{seed}.log", "wb")  # noqa: SIM115 - closed with the process below
    return subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "run", "--name", f"verl-s{seed}", "--", *cmd],
                            env=cpu_env(node.env), cwd=tmp, stdout=log, stderr=subprocess.STDOUT)


class PeakMemory(threading.Thread):
    """The largest summed RSS of the given processes and all their descendants."""

    def __init__(self, procs: list[subprocess.Popen]):
        super().__init__(daemon=True)
        self.procs, self.stop, self.peak_bytes = procs, threading.Event(), 0

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            total = 0
            for p in self.procs:
                try:
                    root = psutil.Process(p.pid)
                    for q in (root, *root.children(recursive=True)):
                        total += q.memory_info().rss
                except psutil.Error:
                    continue
            self.peak_bytes = max(self.peak_bytes, total)
            self.stop.wait(0.5)


def run_pair(tmp: Path, assets, kill_daemon_at_step: int | None = None) -> dict:
    node = Node(tmp)
    node.start("--partitioner", "cpu", "--profile", "cpu/tiny-qwen3")
    sampler = Sampler(node)
    sampler.start()
    procs = [job(node, assets, seed, tmp) for seed in (1, 2)]
    memory = PeakMemory(procs)
    memory.start()
    try:
        if kill_daemon_at_step is not None:
            _kill_at(node, kill_daemon_at_step, procs)
        rcs = [p.wait(JOB_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        sampler.stop.set()
        memory.stop.set()
        sampler.join(5)
        node.stop()
    logs = [(tmp / f"verl-s{s}.log").read_text(errors="replace") for s in (1, 2)]
    return {"rcs": rcs, "events": node.events(), "samples": sampler.samples, "peak_bytes": memory.peak_bytes,
            "logs": logs}


def _kill_at(node: Node, step: int, procs) -> None:
    """SIGKILL the daemon once a job has a grant of `step`, both jobs still running."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not any(e["event"] == "grant" and f"/{step}/" in e["substage"] for e in node.events()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no job reached the step"
        time.sleep(0.1)
    assert all(p.poll() is None for p in procs), "a job ended before the daemon was killed"
    node.daemon.send_signal(signal.SIGKILL)
    node.daemon.wait(10)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, assets) -> dict:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("CPU partitions need two cores")
    return run_pair(tmp_path_factory.mktemp("verl-pair"), assets)


def _tail(run: dict) -> str:
    return "\n---\n".join(log[-3000:] for log in run["logs"])


def test_both_verl_jobs_exit_0(pair):
    assert pair["rcs"] == [0, 0], _tail(pair)


def test_every_verl_stage_of_every_step_was_granted_under_its_name(pair):
    ev = pair["events"]
    granted = {e["substage"] for e in ev if e["event"] in ("grant", "host")}  # host: the trainer's wait in gen
    asked = {(e["pipeline"], e["data"]["step"], e["data"]["label"]) for e in ev
             if e["event"] == "request" and e["substage"] in granted}
    missing = [(p, s, st) for p in ("verl-s1", "verl-s2") for s in range(1, STEPS + 1) for st in STAGES
               if (p, s, st) not in asked]
    assert not missing, f"never granted: {missing}"
    ungranted = [e["substage"] for e in ev if e["event"] == "request" and e["substage"] not in granted]
    assert not ungranted, ungranted


def test_the_two_jobs_held_the_same_cores_at_once_with_split_budgets(pair):
    """Some moment when a sub-stage of each job held a partition of the CPU, neither the whole."""
    held = holdings(pair["events"])
    pipeline = {e["substage"]: e["pipeline"] for e in pair["events"] if e["event"] == "grant"}
    split = [h for h in held if h.sm_frac < 1.0]
    overlaps = [(a, b) for a in split for b in split if pipeline[a.substage] == "verl-s1"
                and pipeline[b.substage] == "verl-s2" and a.start_s < b.end_s and b.start_s < a.end_s
                and a.cores != b.cores]
    assert overlaps, f"no moment with both jobs on split budgets ({len(split)} split holdings)"


def test_verl_worker_processes_ran_on_their_granted_cores(pair):
    held = holdings(pair["events"])
    roles = {h.role for h in held}
    assert roles == {"rollout", "trainer"}, roles  # replicas and trainer ranks were both bound
    wrong = off_cores(held, pair["samples"])
    assert not wrong, [(h.substage, h.pid, h.cores, seen[:3]) for h, seen in wrong[:5]]
    checked = {h.pid for h in held if any(p == h.pid for _, p, _ in pair["samples"])}
    assert len(checked) >= 6, checked  # 2 jobs × (2 trainer ranks + 2 replicas)


def test_two_verl_jobs_fit_in_this_machines_memory(pair):
    print(f"peak summed RSS of both verl jobs: {pair['peak_bytes'] / 2**30:.1f} GiB")
    assert 0 < pair["peak_bytes"] < MEM_LIMIT_BYTES


def test_killing_the_daemon_mid_run_leaves_both_verl_jobs_finishing(tmp_path, assets):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("CPU partitions need two cores")
    run = run_pair(tmp_path, assets, kill_daemon_at_step=2)
    assert run["rcs"] == [0, 0], _tail(run)
    for log in run["logs"]:
        assert "runs without it" in log, log[-3000:]  # said, not silent
    steps = {(e["pipeline"], e["data"]["step"]) for e in run["events"] if e["event"] == "request"}
    assert ("verl-s1", STEPS) not in steps and ("verl-s2", STEPS) not in steps  # the last steps ran without it


def test_the_verl_plugin_is_what_verl_loads():
    """verl's own entry-point discovery finds jigsaw's plugin (installed with the package)."""
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="verl.plugins") if ep.name == "jigsaw"]
    assert [ep.value for ep in eps] == ["jigsaw.integrations.verl.plugin"]
    assert ROOT.joinpath("jigsaw/integrations/verl/plugin.py").exists()
