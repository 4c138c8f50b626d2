"""Grants take effect on a GPU: checked on a FAKE GPU (jigsaw.mux.partition.fake_gpu), named as such.

Two GPU-recipe pipelines (jigsaw.recipes.gpu_grpo, the tiny model on the CPU) run under a real
daemon whose green partitioner splits a fake 132-SM device; every forward and micro-batch the
recipe launches goes through bind.on_stream, which on the fake device logs the side it ran on.
The daemon's trace says which partition each pipeline held when.  A launch must have run on a
partition its pipeline held then, or one it held until a heartbeat before (a re-bind arrives with
the next heartbeat reply; the recipe follows it at the next forward), and once a budget change
was delivered, the worker's launches from a moment later on must be on the new side, and some
worker must be seen moving to a change's SMs while its sub-stage runs.  The demo starts the
pipelines' first steps together (recipes/start_gate.py): they overlap however slowly each loads.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from jigsaw.mux.partition import fake_gpu
from jigsaw.mux.partition.fake_gpu import FakeGreenPartitions
from jigsaw.mux.partition.smsplit import PARTITION_LEVELS

SLACK_S = 0.5
"""How long after a grant is replaced a launch may still run on it (a heartbeat reply's way)."""
FOLLOW_S = 0.1
"""A budget change goes to its running worker in a heartbeat reply sent when it is made (the trace's
`delivered`); this long after, every launch of the worker must be on the new side."""
NUM_SMS = 132


def _ids(partition: dict) -> tuple[int, int]:
    """[first, last + 1) SM ids of a trace grant's green partition on the fake device."""
    parts = FakeGreenPartitions(PARTITION_LEVELS, fake_gpu.hopper(NUM_SMS))
    side = parts.full if partition["budget"] >= 1.0 else parts.pair(partition["budget"])[partition["side"]]
    return side.stream.first_sm, side.stream.first_sm + side.num_sms


def _clock_t0_s(trace: list[dict]) -> float:
    """The daemon's time.monotonic() at its trace's t_s = 0 (the fake GPU logs on that clock)."""
    return next(ev for ev in trace if ev["event"] == "node")["data"]["clock_t0_s"]


def _held(trace: list[dict], clock_t0_s: float) -> dict[str, list[tuple[float, float, tuple[int, int]]]]:
    """pipeline -> [(from, until, SM ids)] of every green grant, on time.monotonic()."""
    held: dict[str, list[tuple[float, float, tuple[int, int]]]] = {}
    open_: dict[str, tuple[float, tuple[int, int], str]] = {}
    for ev in trace:
        t, sid = ev["t_s"] + clock_t0_s, ev["substage"]
        if sid in open_ and ev["event"] in ("grant", "release"):
            start, ids, pipe = open_.pop(sid)
            held.setdefault(pipe, []).append((start, t, ids))
        if ev["event"] == "grant" and (ev["data"].get("partition") or {}).get("kind") == "green":
            open_[sid] = (t, _ids(ev["data"]["partition"]), ev["pipeline"])
    for start, ids, pipe in open_.values():
        held.setdefault(pipe, []).append((start, float("inf"), ids))
    return held


MODES = ("jigsaw", "static-live", "engines")
"""The GPU recipe under the daemon's own choice of budgets, and under half the device each
(sides 0 and 1 of one split); and the CPU recipe's engines (DP rollout workers and trainer
ranks, each its own process following the grant its client posts) under the daemon's choice."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], list[dict], Path]]:
    """mode -> (the daemon's trace, the fake GPU's launches, the demo's output directory)."""
    from jigsaw.recipes.demo import GPU_PROFILE, DemoConfig, run_demo

    got = {}
    for mode in MODES:
        out = tmp_path_factory.mktemp(f"gpu-grants-{mode}")
        log = out / "launches.jsonl"
        live = "jigsaw" if mode == "engines" else mode
        if mode == "engines":
            # the fake device is a Hopper: planned with a GPU grid, whose uneven splits change
            # while a rollout or training runs (the CPU grid's stay at halves)
            cfg = DemoConfig(framework="jigsaw", partitioner="green", profile=GPU_PROFILE, max_new_tokens=128)
        else:
            cfg = DemoConfig(framework="gpu", max_new_tokens=128,
                             recipe_args="--device cpu --model tiny --layers 2 --prompt-tokens 8")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(fake_gpu.ENV_SMS, str(NUM_SMS))
            mp.setenv(fake_gpu.ENV_LOG, str(log))
            run_demo(replace(cfg, modes=(live,), repeats=1, steps=2, warmup_steps=1, prompts=4, group=2, out_dir=out),
                     say=lambda _: None)
        trace = [json.loads(line) for line in (out / f"{live}-trace.jsonl").read_text().splitlines()]
        got[mode] = (trace, fake_gpu.read_log(log), out)
    return got


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_every_launch_ran_on_a_partition_its_pipeline_held(runs, mode):
    trace, launches, _ = runs[mode]
    held = _held(trace, _clock_t0_s(trace))
    pipelines = {ev["pipeline"] for ev in trace if ev["event"] == "pipeline"}
    assert {ln["pipeline"] for ln in launches} == pipelines, "a pipeline launched nothing on its partitions"
    assert any(ln["budget"] < 1.0 for ln in launches), "no launch ran on a partition smaller than the device"
    wrong = [ln for ln in launches if not _on_held(ln, held.get(ln["pipeline"], ()))]
    assert not wrong, f"{len(wrong)} of {len(launches)} launches ran outside their grants, first: {wrong[0]}"


def _on_held(launch: dict, held: list[tuple[float, float, tuple[int, int]]]) -> bool:
    """On SMs its pipeline held then, or until a heartbeat before, or held last: between a
    regime's release and its next's grant (an Admit's round trip and a plan, longer on a loaded
    machine) the engine goes on where it was, and its pipeline was granted nothing else since."""
    t, ids = launch["t_s"], tuple(launch["sm_ids"])
    if any(start <= t <= until + SLACK_S and ids == held_ids for start, until, held_ids in held):
        return True
    return any(until <= t and ids == held_ids and not any(until < later <= t for later, _, _ in held)
               for _, until, held_ids in held)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_two_pipelines_held_disjoint_sms_whenever_both_held_a_partition(runs, mode):
    trace, _, _ = runs[mode]
    held = _held(trace, _clock_t0_s(trace))
    (a, spans_a), (b, spans_b) = sorted(held.items())
    for sa, ua, (lo_a, hi_a) in spans_a:
        for sb, ub, (lo_b, hi_b) in spans_b:
            both = min(ua, ub) - max(sa, sb)
            if both > SLACK_S:  # a partner is granted before the other's shrink lands: a heartbeat's overlap
                assert hi_a <= lo_b or hi_b <= lo_a, f"{a} [{lo_a}, {hi_a}), {b} [{lo_b}, {hi_b}) for {both:.2f} s"


def _changes(trace: list[dict], clock_t0_s: float) -> list[tuple[str, float, float, tuple[int, int], tuple[int, int]]]:
    """(pipeline, delivered at, until, SM ids, the sub-stage's first SM ids) of every budget
    change sent to a running sub-stage, until that sub-stage's next change or its release, on
    time.monotonic()."""
    latest: dict[str, dict] = {}
    first: dict[str, tuple[int, int]] = {}
    out: list[list] = []
    for ev in trace:
        t, sid = ev["t_s"] + clock_t0_s, ev["substage"]
        if ev["event"] in ("delivered", "release", "grant"):
            for change in out:
                if change[0] == sid and change[3] == float("inf") and ev["event"] != "grant":
                    change[3] = t  # the next change or the end closes this one
        if ev["event"] == "grant" and (ev["data"].get("partition") or {}).get("kind") == "green":
            latest[sid] = ev["data"]["partition"]
            first.setdefault(sid, _ids(latest[sid]))
        elif ev["event"] == "delivered" and sid in latest:
            out.append([sid, ev["pipeline"], t, float("inf"), _ids(latest[sid]), first[sid]])
    return [tuple(change[1:]) for change in out]


def _moved(launches: list[dict], pipe: str, t: float, until: float, ids: tuple[int, int],
           first: tuple[int, int]) -> bool:
    """A worker of `pipe` launched on the SMs of the change at `t` before the next one, where its
    sub-stage began elsewhere and the worker launches elsewhere at other times: a worker that
    keeps its sub-stage's first stream never does, nor one that keeps its very first."""
    if ids == first:
        return False
    there = {ln["pid"] for ln in launches if ln["pipeline"] == pipe and t < ln["t_s"] < until
             and tuple(ln["sm_ids"]) == ids}
    return any(ln["pid"] in there and tuple(ln["sm_ids"]) != ids for ln in launches)


@pytest.mark.timeout(240)
def test_every_rollout_worker_and_trainer_rank_launches_on_its_own_grant(runs):
    """The engines' processes apply the grants themselves: the client can only post them."""
    _, launches, out = runs["engines"]
    results = [json.loads(f.read_text()) for f in out.glob("jigsaw-seed*.json")]
    assert len(results) == 2
    for doc in results:
        mine = {ln["pid"] for ln in launches if ln["pipeline"] == doc["name"]}
        rollout, trainer = set(doc["pids"]["rollout"]), set(doc["pids"]["trainer"])
        assert mine == rollout | trainer, f"{doc['name']}: launches from {mine}, workers {rollout} and ranks {trainer}"
    works = {ln.get("work") for ln in launches}
    assert {"ref_logprobs", "train"} <= works and any("kv_tokens" in ln for ln in launches), works


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["jigsaw", "engines"])
def test_a_budget_change_is_followed_by_the_next_launches(runs, mode):
    """Two checks: a worker moves to the SMs of a change in the running sub-stage (so a worker that
    keeps an earlier stream fails, however short the sub-stages), and no launch FOLLOW_S after a
    change is on the old side (so one that follows late fails, where a change lasts)."""
    trace, launches, _ = runs[mode]
    changes = _changes(trace, _clock_t0_s(trace))
    moved = [change for change in changes if _moved(launches, *change)]
    assert moved, f"no worker moved to the SMs of any of {len(changes)} budget changes while its sub-stage ran"
    after = [(ln, ids) for pipe, t, until, ids, _ in changes for ln in launches
             if ln["pipeline"] == pipe and t + FOLLOW_S <= ln["t_s"] < until]
    stale = [ln for ln, ids in after if tuple(ln["sm_ids"]) != ids]
    assert not stale, f"{len(stale)} of {len(after)} launches after a budget change ran on the old side: {stale[0]}"


def test_the_fake_gpu_is_off_unless_named(monkeypatch):
    monkeypatch.delenv(fake_gpu.ENV_SMS, raising=False)
    assert fake_gpu.resource() is None
    monkeypatch.setenv(fake_gpu.ENV_SMS, "12")
    with pytest.raises(ValueError, match="SM count"):
        fake_gpu.resource()


def test_opposite_sides_of_one_split_are_disjoint_in_two_processes(tmp_path):
    """What two workers of two pipelines do: open the same split, take the sides their grants name."""
    import subprocess
    import sys

    code = ("import json,sys; from jigsaw.mux.partition.fake_gpu import FakeGreenPartitions as F;"
            "s=F((0.25, 0.5, 0.75)).pair(float(sys.argv[1]))[int(sys.argv[2])].stream;"
            "print(json.dumps([s.first_sm, s.first_sm + s.num_sms]))")
    env = {**__import__("os").environ, fake_gpu.ENV_SMS: str(NUM_SMS)}
    for frac in (0.25, 0.5, 0.75):
        got = [json.loads(subprocess.run([sys.executable, "-c", code, str(frac), str(side)], env=env, check=True,
                                         capture_output=True, text=True, timeout=60).stdout) for side in (0, 1)]
        (lo_a, hi_a), (lo_b, hi_b) = got
        assert hi_a <= lo_b or hi_b <= lo_a, f"σ={frac}: sides {got} overlap"
        assert (hi_a - lo_a) + (hi_b - lo_b) <= NUM_SMS
