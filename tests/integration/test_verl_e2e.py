"""Two unmodified verl 0.9.1 GRPO jobs under `jigsaw run`, one CPU-partitioning daemon (verl venv):
a sync one and an asynchronous one (verl's colocate_async trainer).

    assets: tiny Qwen3 + GSM8K-format parquet of prompts it answers long (48+ tokens:
            every rollout is mid-generation for a while), made here
    daemon: --partitioner cpu --devices 2 (a device per core, as a GPU per replica), the
            one-core grid ─► trace
    jigsaw run --name verl-s1 -- python -m verl.trainer.main_ppo <CPU overrides, seed 1, greedy>
    jigsaw run --name verl-s2 -- python -m verl.trainer.main_ppo <CPU overrides, seed 2, greedy,
                                  trainer.v1.trainer_mode=colocate_async, staleness bound 2>
        2 rollout replicas each (jigsaw's engine), 2 trainer ranks each: replica / rank i is
        DP rank i on device i; verl writes every step's prompts and responses (rollout dump)
    while they run: Cpus_allowed_list of every granted pid (binding.Sampler), the summed RSS
    (PSS) of both jobs' process trees, and `jigsaw daemon migrate` of verl-s1's rank-1
    rollout to rank 0 until a replica reports requests in flight moved
    the same two jobs again, their daemon SIGKILLed at their first grant: they fall open and
    run every step without jigsaw, nothing in them moved: the unmigrated outputs
    a third pair: verl's experimental mains, verl-s3 (one_step_off_policy) and verl-s4
    (fully_async_policy, bound 2), one trainer rank and one rollout replica of their own each,
    weights through the checkpoint engine "jigsaw"

Checked: both exit 0; every verl stage of every step of both jobs was requested under its
verl name and granted, each trainer stage as a gang of both ranks; the jobs held the same
core at once on split budgets; the workers' real affinity matched their grants; requests
moved mid-generation (prompt + partial prefilled on the target, only the rest generated) and
every step's responses of verl-s1 are token-identical to the unmigrated run's (verl-s2's are not
reproducible: where a weight update interrupts its rollouts depends on timing); verl-s2 ran as
its job's two sides, the training side registered with the bound, and verl trained within it,
on samples of older weights; the pair fits in this machine's memory.  The second pair, whose
daemon died mid-run, still finishes and says so.  The experimental mains train every step
with every stage and weight sync gated on their training sides, registered with their bounds.
(One pair serves as both the reference and the fault: a verl pair starts in minutes here.)
"""

from __future__ import annotations

import json
import os
import re
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
from waiting import wait_until  # noqa: E402

from jigsaw import protocol as pr  # noqa: E402
from jigsaw.runtime.client import ask  # noqa: E402
from jigsaw.runtime.paths import owner_file  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.timeout(900)]

STEPS = 4
PROMPTS = 4
RESPONSE_TOKENS = 48
"""Every prompt's greedy answer runs to this cap (`long_rows`): a rollout takes about 0.5 s."""
STAGES = ("gen", "old_log_prob", "ref", "update_actor", "update_weights")
"""verl's stage names (its `marked_timer` names) each step of these jobs runs."""
TRAINER_STAGES = STAGES[1:]
MODES = {1: "sync", 2: "colocate_async", 3: "one_step_off", 4: "fully_async"}
"""verl-s2 runs verl's asynchronous colocated trainer: its rollouts run a batch ahead of its
training, interrupted at each weight update and resumed (an asynchronous job beside a sync one).
verl-s3 and verl-s4 run verl's experimental mains, a rollout device of their own each."""
SEPARATE = {3: ("one-step-off", 1), 4: ("fully-async", 2)}
"""The experimental jobs: what each is to jigsaw, and the bound its trainer registers."""
STALENESS = 2
"""verl-s2's `max_off_policy_threshold`."""
SIDES = {"verl-s1": dict.fromkeys(STAGES, "verl-s1"),
         "verl-s2": {"gen": "verl-s2", **dict.fromkeys(TRAINER_STAGES, "verl-s2.train")}}
"""Where each stage of each job is asked: the async job's training stages on its training side."""
DEVICES = 2
"""One per rollout replica (and trainer rank), each a core: the DP workers can trade requests."""
MEM_LIMIT_BYTES = 20 * 2**30
"""Both jobs together, leaving room for the test runner on this 24 GiB machine."""
JOB_TIMEOUT_S = 600
RANK1_ROLLOUT = re.compile(r"verl-s1/(\d+)/r1/rollout_")
MOVED = re.compile(r"\(jigsaw\) replica (\d+) handed (\d+) request\(s\) in flight to replica (\d+), "
                   r"carrying ([\d ]+) tokens")
RESUMED = re.compile(r"\(jigsaw\) replica (\d+) finished (\S+), migrated here: (\d+) tokens carried, "
                     r"(\d+) prefilled, (\d+) generated")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, Path]:
    from jigsaw.integrations.verl.assets import long_rows, make_gsm8k, make_model

    tmp = tmp_path_factory.mktemp("verl-assets")
    model = make_model(tmp / "model")
    make_gsm8k(tmp / "data", train_rows=long_rows(model, STEPS * PROMPTS, min_tokens=RESPONSE_TOKENS))
    return model, tmp / "data"


def command(assets, seed: int, tmp: Path) -> list[str]:
    from jigsaw.integrations.verl.job import JobConfig, grpo_command

    model, data = assets
    return grpo_command(JobConfig(model=model, data=data, seed=seed, steps=STEPS, prompts=PROMPTS, temperature=0.0,
                                  response_tokens=RESPONSE_TOKENS, out=tmp / f"out-s{seed}",
                                  rollout_dump=None if seed == 3 else tmp / f"dump-s{seed}", trainer_mode=MODES[seed],
                                  staleness=SEPARATE.get(seed, (None, STALENESS))[1],
                                  replicas=1 if seed in SEPARATE else DEVICES))


def start(cmd: list[str], env: dict, tmp: Path, seed: int) -> subprocess.Popen:
    from jigsaw.integrations.verl.job import cpu_env

    log = open(tmp / f"verl-s{seed}.log", "wb")  # noqa: SIM115 - closed with the process below
    return subprocess.Popen(cmd, env=cpu_env(env), cwd=tmp, stdout=log, stderr=subprocess.STDOUT)


class PeakMemory(threading.Thread):
    """The largest summed PSS of the given processes and all their descendants (RSS would
    count the pages they share, torch's libraries above all, once per process)."""

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
                        total += q.memory_full_info().pss
                except psutil.Error:
                    continue
            self.peak_bytes = max(self.peak_bytes, total)
            self.stop.wait(0.5)


class Drain(threading.Thread):
    """`Migrate` verl-s1's rank-1 rollout to rank 0 (what `jigsaw daemon migrate` sends) part-way
    through, until its log says a replica handed requests over with tokens generated.  The pace
    is the job's own: the order goes at `frac` of the last whole rank-1 rollout (grant to
    release; step 1 runs whole), so it lands mid-generation however loaded the machine is; an
    order that moved requests with no tokens yet goes later the next step, one that came as the
    rollout ended (refused: nothing to migrate, or moved nothing), earlier.  Orders and
    refusals are kept, to tell what happened."""

    def __init__(self, node: Node, log: Path):
        super().__init__(daemon=True)
        self.node, self.log, self.stop = node, log, threading.Event()
        self.orders: list[tuple[int, float, str]] = []
        self.refused: list[str] = []
        self.moved_at: set[int] = set()
        """Steps whose rank-1 rollout lost requests to an order: not a whole rollout's pace."""

    def run(self) -> None:
        frac, tried = 0.5, set()
        while not self.stop.wait(0.02):
            step = self._due(frac, tried)
            if step is None:
                continue
            tried.add(step)
            before = len(self._moved())
            owner = owner_file(self.node.ep, "verl-s1").read_text()  # as `jigsaw daemon migrate` finds it
            order = pr.Migrate(pipeline="verl-s1", source_rank=1, target_rank=0, owner=owner, req=9)
            reply = ask(self.node.ep, order, 2.0)
            if not isinstance(reply, pr.Migrated):  # the rollout ended before the order: earlier
                self.refused.append(repr(reply))
                frac = max(0.1, frac - 0.2)
                continue
            self.moved_at.add(step)
            self.orders.append((step, frac, reply.source))
            moved = self._said_after(before)
            if any(c > 0 for cs in moved for c in cs):
                return
            frac = min(0.9, frac + 0.2) if moved else max(0.1, frac - 0.2)

    def _due(self, frac: float, tried: set[int]) -> int | None:
        """The running step whose rank-1 rollout has run `frac` of the last whole one (first
        grant to last release, a later step begun), if any."""
        ev = self.node.events()
        t0 = next((e["data"]["clock_t0_s"] for e in ev if e["event"] == "node"), None)
        span: dict[int, list[float]] = {}
        open_: dict[int, set[str]] = {}
        for e in ev:
            if e["pipeline"] != "verl-s1" or not (m := RANK1_ROLLOUT.match(e["substage"])):
                continue
            step = int(m[1])
            if e["event"] == "grant":
                span.setdefault(step, [e["t_s"], e["t_s"]])
                open_.setdefault(step, set()).add(e["substage"])
            elif e["event"] in ("release", "migration") and step in span:
                span[step][1] = e["t_s"]
                open_[step].discard(e["substage"])
        paces = [b - a for s, (a, b) in sorted(span.items())
                 if not open_[s] and s < max(span) and s not in self.moved_at]
        running = [s for s in span if open_[s] and s not in tried]
        if t0 is None or not paces or not running:
            return None
        step = max(running)
        ran_s = time.monotonic() - t0 - span[step][0]
        return step if ran_s >= frac * paces[-1] else None

    def _moved(self) -> list[list[int]]:
        return [[int(c) for c in cs.split()] for *_, cs in MOVED.findall(self.log.read_text(errors="replace"))]

    def _said_after(self, before: int) -> list[list[int]]:
        """The hand-overs the log says after the first `before` (Ray forwards a worker's lines
        late: up to 5 s; none by then, the order came as the rollout ended)."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not self.stop.is_set():
            if len(said := self._moved()) > before:
                return said[before:]
            self.stop.wait(0.1)
        return []


def run_pair(tmp: Path, assets, kill_daemon_at_step: int | None = None, drain: bool = False,
             seeds: tuple[int, int] = (1, 2)) -> dict:
    node = Node(tmp)
    node.start("--partitioner", "cpu", "--profile", "cpu/tiny-qwen3-1c", "--devices", str(DEVICES))
    sampler = Sampler(node)
    sampler.start()
    wrap = [sys.executable, "-m", "jigsaw.cli.main", "run", "--no-start-daemon", "--name"]
    procs = [start([*wrap, f"verl-s{s}", "--", *command(assets, s, tmp)], node.env, tmp, s) for s in seeds]
    memory, drainer = PeakMemory(procs), Drain(node, tmp / "verl-s1.log")
    memory.start()
    if drain:
        drainer.start()
    try:
        if kill_daemon_at_step is not None:
            _kill_at(node, kill_daemon_at_step, procs)
        rcs = [p.wait(JOB_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for t in (sampler, memory, drainer):
            t.stop.set()
        sampler.join(5)
        node.stop()
    logs = [(tmp / f"verl-s{s}.log").read_text(errors="replace") for s in seeds]
    return {"rcs": rcs, "events": node.events(), "samples": sampler.samples, "peak_bytes": memory.peak_bytes,
            "logs": logs, "dumps": [_dump(tmp / f"dump-s{s}") for s in seeds], "orders": drainer.orders,
            "refused": drainer.refused}


def _dump(folder: Path) -> dict[int, list[tuple[str, str]]]:
    """verl's rollout dump: per step, every (prompt, response) text, in a stable order."""
    out = {}
    for f in sorted(folder.glob("*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        out[int(f.stem)] = sorted((r["input"], r["output"]) for r in rows)
    return out


def _kill_at(node: Node, step: int, procs) -> None:
    """SIGKILL the daemon once a job has a grant of `step`, both jobs still running."""

    def reached() -> bool:
        assert all(p.poll() is None for p in procs), f"a job ended before step {step}"
        return any(e["event"] == "grant" and f"/{step}/" in e["substage"] for e in node.events())

    wait_until(reached, JOB_TIMEOUT_S, f"a grant of step {step}")
    assert all(p.poll() is None for p in procs), "a job ended before the daemon was killed"
    node.daemon.send_signal(signal.SIGKILL)
    node.daemon.wait(10)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, assets) -> dict:
    if len(os.sched_getaffinity(0)) < DEVICES:
        pytest.skip("a device per core needs two cores")
    return run_pair(tmp_path_factory.mktemp("verl-pair"), assets, drain=True)


@pytest.fixture(scope="module")
def unmigrated(tmp_path_factory, assets) -> dict:
    """The same two greedy jobs, their daemon killed at the first grant of step 1 (both jobs
    running): nothing is moved in them, every later step runs without jigsaw."""
    if len(os.sched_getaffinity(0)) < DEVICES:
        pytest.skip("a device per core needs two cores")
    run = run_pair(tmp_path_factory.mktemp("verl-killed"), assets, kill_daemon_at_step=1)
    assert run["rcs"] == [0, 0], _tail(run)
    assert not any(MOVED.search(log) for log in run["logs"]), "the reference run moved requests"
    return run


@pytest.fixture(scope="module")
def separate(tmp_path_factory, assets) -> dict:
    """verl's two experimental asynchronous mains side by side under one daemon, each a trainer
    rank and a rollout replica of its own, their weights through the checkpoint engine "jigsaw"."""
    if len(os.sched_getaffinity(0)) < DEVICES:
        pytest.skip("a device per core needs two cores")
    return run_pair(tmp_path_factory.mktemp("verl-separate"), assets, seeds=tuple(SEPARATE))


def _tail(run: dict) -> str:
    return "\n---\n".join(log[-3000:] for log in run["logs"])


def test_both_verl_jobs_exit_0(pair):
    assert pair["rcs"] == [0, 0], _tail(pair)


def test_every_verl_stage_of_every_step_was_granted_under_its_name(pair):
    ev = pair["events"]
    granted = {e["substage"] for e in ev if e["event"] == "grant"}
    asked = {(e["pipeline"], e["data"]["step"], e["data"]["label"]) for e in ev
             if e["event"] == "request" and e["substage"] in granted}
    missing = [(p, s, st) for p in SIDES for s in range(1, STEPS + 1) for st in STAGES
               if (SIDES[p][st], s, st) not in asked and (p, st) != ("verl-s2", "gen")]
    assert not missing, f"never granted: {missing}"
    ungranted = [e["substage"] for e in ev if e["event"] == "request" and e["substage"] not in granted]
    assert not ungranted, ungranted
    gangs = {}
    for e in ev:  # a trainer stage: one sub-stage per rank, each on its own device
        if e["event"] == "request" and e["data"]["label"] in TRAINER_STAGES:
            gangs.setdefault((e["pipeline"], e["data"]["step"], e["data"]["label"]), []).append(e["data"]["rank"])
    assert gangs and all(sorted(ranks) == [0, 1] for ranks in gangs.values()), gangs


def test_the_two_jobs_held_the_same_core_at_once_with_split_budgets(pair):
    """Some moment when a sub-stage of each job held the same core, each on a partial budget."""
    held = holdings(pair["events"])
    pipeline = {e["substage"]: e["pipeline"] for e in pair["events"] if e["event"] == "grant"}
    split = [h for h in held if h.sm_frac < 1.0]
    overlaps = [(a, b) for a in split for b in split if pipeline[a.substage] == "verl-s1"
                and pipeline[b.substage].startswith("verl-s2") and a.start_s < b.end_s and b.start_s < a.end_s
                and a.cores == b.cores]
    assert overlaps, f"no moment with both jobs on one core's split budgets ({len(split)} split holdings)"


def test_verl_worker_processes_ran_on_their_granted_cores(pair):
    held = holdings(pair["events"])
    roles = {h.role for h in held}
    assert roles == {"rollout", "trainer"}, roles  # replicas and trainer ranks were both bound
    wrong = off_cores(held, pair["samples"])
    assert not wrong, [(h.substage, h.pid, h.cores, seen[:3]) for h, seen in wrong[:5]]
    checked = {h.pid for h in held if any(p == h.pid for _, p, _ in pair["samples"])}
    assert len(checked) >= 6, checked  # 2 jobs × (2 trainer ranks + 2 replicas)
    assert {h.cores for h in held} == {str(c) for c in sorted(os.sched_getaffinity(0))[:DEVICES]}  # a core each


def test_requests_moved_mid_generation_and_every_response_is_token_identical(pair, unmigrated):
    log = pair["logs"][0]
    print(f"orders (step, frac, source): {pair['orders']}; refused: {pair['refused']}")
    # Every migration the daemon ordered in verl-s1, as (source rank, target rank): the
    # operator's drain of replica 1, and any tail merge of the policy's own plan.
    # (An order to a rank whose rollout has ended names no target sub-stage, only the rank.)
    ordered = {(e["data"]["source_rank"], e["data"]["target_rank"]) for e in pair["events"]
               if e["event"] == "migration" and e["pipeline"] == "verl-s1"}
    assert pair["orders"] and (1, 0) in ordered, (ordered, pair["refused"][-5:])
    handed = [(int(src), int(n), int(dst), [int(c) for c in carried.split()])
              for src, n, dst, carried in MOVED.findall(log)]
    assert any((src, dst) == (1, 0) for src, _, dst, _ in handed), handed  # the drain moved requests
    assert all((src, dst) in ordered and len(c) == n > 0 for src, n, dst, c in handed), (handed, ordered)
    carried = sorted((dst, c) for _, _, dst, cs in handed for c in cs if c > 0)
    resumed = [(int(r), rid, int(c), int(p), int(g)) for r, rid, c, p, g in RESUMED.findall(log)]
    # each resumed once, on the replica it was handed to
    assert carried and sorted((r, c) for r, _, c, _, _ in resumed) == carried, (handed, resumed)
    assert any(g > 0 for *_, g in resumed), resumed  # some went on generating where they landed
    for _, _, c, prefilled, generated in resumed:  # a migration, not a restart: prompt + partial
        if generated:  # prefilled, only the rest of the budget made
            assert prefilled > c and c + generated <= RESPONSE_TOKENS, (c, prefilled, generated)
        else:  # it had said EOS before the hand-over: nothing to compute again
            assert prefilled == 0, (c, prefilled)
    got, plain = pair["dumps"][0], unmigrated["dumps"][0]  # verl-s1: sync and greedy, so reproducible
    assert sorted(got) == list(range(1, STEPS + 1)) and sorted(plain) == sorted(got), got.keys()
    for step in got:
        assert got[step] == plain[step], f"verl-s1 step {step}: responses differ from the unmigrated run"


def test_the_async_verl_job_ran_as_two_sides_within_its_bound(pair):
    """verl-s2 (colocate_async): its trainer registered its job's training side with the bound,
    its replicas' regimes are its rollout side, and verl trained within that bound, some steps
    on samples of older weights (it ran asynchronously)."""
    ev = pair["events"]
    # a side whose lease ran out under load registers again and says its coupling again: once or more
    said = {(e["pipeline"], tuple(sorted(e["data"].items()))) for e in ev if e["event"] == "job"}
    assert said == {("verl-s2.train", (("job", "verl-s2"), ("mode", "fully-async"), ("staleness", STALENESS)))}, said
    gen = {e["data"]["step"] for e in ev if e["event"] == "request" and e["pipeline"] == "verl-s2"}
    assert gen and gen <= set(range(1, STEPS + 2)), gen  # a batch may be prefetched past the last step
    spans = [int(s) for s in re.findall(r"training/off_policy/trajectory_staleness/max:np\.int64\((\d+)\)",
                                        pair["logs"][1])]
    assert len(spans) == STEPS and max(spans) <= STALENESS and max(spans) >= 1, spans
    assert sorted(pair["dumps"][1]) == list(range(1, STEPS + 1)), pair["dumps"][1].keys()


def test_two_verl_jobs_fit_in_this_machines_memory(pair):
    print(f"peak summed PSS of both verl jobs: {pair['peak_bytes'] / 2**30:.1f} GiB")
    assert 0 < pair["peak_bytes"] < MEM_LIMIT_BYTES


def test_killing_the_daemon_mid_run_leaves_both_verl_jobs_finishing(unmigrated):
    for log in unmigrated["logs"]:
        assert "runs without it" in log, log[-3000:]  # said, not silent
    steps = {(e["pipeline"], e["data"]["step"]) for e in unmigrated["events"] if e["event"] == "request"}
    assert steps and all(step <= 2 for _, step in steps), steps  # the last steps ran without it
    for seed, dump in enumerate(unmigrated["dumps"], 1):
        assert sorted(dump) == list(range(1, STEPS + 1)), (seed, dump.keys())  # and every step ran


def test_verls_experimental_async_mains_run_with_every_stage_gated_on_their_training_side(separate):
    """one_step_off_policy and fully_async_policy, unmodified, under `jigsaw run`: both train
    every step under a grant; every trainer stage verl timed and every weight sync was asked on
    `<job>.train` and granted; their replicas' regimes are the rollout side; each trainer
    registered its mode and bound.  (verl-s3 writes no rollout dump: verl 0.9.1's
    OneStepOffRayTrainer never makes the executor `trainer.rollout_data_dir` writes with.)"""
    assert separate["rcs"] == [0, 0], _tail(separate)
    ev = separate["events"]
    granted = {e["substage"] for e in ev if e["event"] == "grant"}
    asked = [e for e in ev if e["event"] == "request"]
    assert all(e["substage"] in granted for e in asked), [e["substage"] for e in asked if e["substage"] not in granted]
    said = sorted({(e["pipeline"], e["data"]["mode"], e["data"]["staleness"]) for e in ev if e["event"] == "job"})
    assert said == [(f"verl-s{s}.train", mode, bound) for s, (mode, bound) in SEPARATE.items()], said
    for seed, log in zip(SEPARATE, separate["logs"], strict=True):
        job = f"verl-s{seed}"
        ran = set(re.findall(r"timing_s/(ref|update_actor|old_log_prob|update_weights):", log))
        assert {"ref", "update_actor"} <= ran, (job, ran)  # what verl timed, jigsaw must have gated
        train = {(e["data"]["step"], e["data"]["label"]) for e in asked if e["pipeline"] == f"{job}.train"}
        trained = {s for s, st in train if st == "update_actor"}
        assert trained == set(range(1, STEPS + 1)), (job, trained, log[-3000:])
        missing = [(s, st) for s in range(1, STEPS + 1) for st in ran & set(TRAINER_STAGES) if (s, st) not in train]
        assert not missing, (job, missing)
        syncs = sorted(s for s, st in train if st == "update_weights")
        assert syncs[0] == 0 and len(syncs) >= STEPS, (job, syncs)  # the sync before step 1, then each step's
        gen = {e["data"]["step"] for e in asked if e["pipeline"] == job}
        assert gen and gen <= set(range(1, STEPS + 2)), (job, gen)


def test_the_verl_plugin_is_what_verl_loads():
    """verl's own entry-point discovery finds jigsaw's plugin (installed with the package)."""
    from importlib.metadata import entry_points

    eps = [ep.value for ep in entry_points(group="verl.plugins") if ep.name == "jigsaw"]
    assert eps == ["jigsaw.integrations.verl.plugin"]
    assert ROOT.joinpath("jigsaw/integrations/verl/plugin.py").exists()
