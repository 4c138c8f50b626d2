"""jigsaw's CPU GRPO recipe submitted to a local multi-node Ray cluster (`ray.cluster_utils.Cluster`:
several raylets on this machine, loopback only), each raylet with a real node daemon joined to
the controller (`DaemonConfig.cluster`; the CPU nodes join as h100 nodes, a stand-in named as
such, because placement prices GPU kinds), placed by the controller and run where placed
(cluster/launch.py).

Checked: every pipeline ran on the nodes the controller placed it on, and only there (each
daemon's trace); one of them spans two nodes, its training and reference a gang across both
(admitted by the controller on both, started on both); every sub-stage exactly once and no
sample lost; a node's daemon killed mid-run, and separately its raylet removed, the pipeline
spanning it still ends with every sample of every step, its pieces there run without the daemon;
`jigsaw run --cluster`: two pipelines arriving at once are booked a node each and run there,
CMD's exit code comes back, and the nodes are given back when they end; a third, with every
node held, is refused with the controller's reason and runs nothing; an arrival whose node's
daemon is lost is stopped, placed again on a live node, and goes on from its checkpoint there,
every step once; one watched while the controller itself is lost runs on, untouched."""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the [cluster] extra (Ray) is part of [dev]")
pytest.importorskip("transformers", reason="the CPU recipe needs the [cpu] extra")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from jigsaw.cluster.controller import NAMESPACE, get_or_start, stop  # noqa: E402
from jigsaw.cluster.launch import LaunchConfig, Submitted, arrive, launch, start  # noqa: E402
from jigsaw.graph.ids import SubStageId  # noqa: E402

pytestmark = pytest.mark.timeout(600)
STEPS, PROMPTS, GROUP = 2, 2, 2


@ray.remote(num_cpus=0, max_concurrency=4)
class NodeDaemon:
    """A node's `jigsaw daemon --cluster auto --cluster-kind h100`, on its own raylet."""

    def __init__(self, directory: str):
        import threading

        from jigsaw.runtime.daemon import Daemon, DaemonConfig

        config = DaemonConfig(devices=1, policy="jigsaw", cluster="auto", cluster_kind="h100",
                              trace=Path(directory) / "trace.jsonl")
        self.d = Daemon(config, Path(directory))
        threading.Thread(target=self.d.serve, daemon=True).start()

    def book(self) -> dict:
        s = self.d.spanning
        return {"node": getattr(s.link, "node_id", None), "admitted": s.admitted, "refused": s.refused}


def _cluster(nodes: int, tmp_path: Path, head: bool = True, node_timeout_s: float = 30.0):
    """A cluster of `nodes` raylets with a daemon each (`head`: the head is one of them, else
    one more, without a daemon: a node that may be lost must not be the head).  A node silent
    for `node_timeout_s` leaves: short only where a test loses one, as a heartbeat late on a
    loaded machine would otherwise refuse a gang."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    raylets = [cluster.head_node] + [cluster.add_node(num_cpus=1) for _ in range(nodes - head)]
    raylets = raylets if head else raylets[1:]
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    cluster.wait_for_nodes()
    ray.get(get_or_start(node_timeout_s=node_timeout_s).nodes.remote(), timeout=120)  # answering before any joins
    ids = [r.node_id for r in raylets]
    daemons, dirs = [], []
    for k, node in enumerate(ids):
        d = tmp_path / f"n{k}"
        d.mkdir(mode=0o700)
        dirs.append(d)
        daemons.append(NodeDaemon.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                       .remote(str(d)))
    deadline = time.monotonic() + 120
    while [b["node"] for b in ray.get([d.book.remote() for d in daemons], timeout=60)] != ids:
        assert time.monotonic() < deadline, "the daemons never joined the cluster"
        time.sleep(0.2)
    return cluster, raylets, ids, daemons, dirs


def _recipe(name: str, seed: int, tmp_path: Path) -> Submitted:
    cmd = (sys.executable, "-m", "jigsaw.recipes.grpo", "--steps", str(STEPS), "--prompts", str(PROMPTS),
           "--group", str(GROUP), "--max-new-tokens", "12", "--seed", str(seed), "--threads", "1",
           "--dp", "{gpus}", "--train-ranks", "{gpus}", "--result", str(tmp_path / f"{name}.json"))
    return Submitted(name=name, workload="qwen3-0.6b-math" if seed % 2 else "qwen3-0.6b-gsm8k", cmd=cmd)


def _samples(tmp_path: Path, name: str) -> list[int]:
    """Samples trained in each step of `name`'s run."""
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    return [len(s["lengths"]) for s in doc["steps"]]


def _grants(directory: Path) -> list[SubStageId]:
    events = [json.loads(line) for line in (directory / "trace.jsonl").read_text().splitlines() if line.strip()]
    return [SubStageId.parse(e["substage"]) for e in events if e.get("event") == "grant"]


def _stop(cluster) -> None:
    stop()
    ray.shutdown()
    cluster.shutdown()


def test_recipes_submitted_to_the_cluster_run_where_placed_a_gang_across_two_nodes_exactly_once(tmp_path):
    cluster, _, ids, daemons, dirs = _cluster(3, tmp_path)
    try:
        subs = [_recipe("p0", 0, tmp_path), _recipe("p1", 1, tmp_path)]
        placed, futures, where = start(subs, LaunchConfig(policy="hetrl", steps=2, trial_steps=1))
        got = ray.get(futures, timeout=480)
        assert [rc for rc, _ in got] == [0, 0], [out for _, out in got]
        assert {p.name: tuple(placed.nodes[p.name]) for p in subs} == dict(zip(["p0", "p1"], where))
        spanning = [p for p in subs if len(placed.nodes[p.name]) == 2]
        assert len(spanning) == 1, f"the placement spans no two nodes: {placed.nodes}"
        for p in subs:
            assert _samples(tmp_path, p.name) == [PROMPTS * GROUP] * STEPS  # no sample lost or doubled
            assert json.loads((tmp_path / f"{p.name}.json").read_text())["fell_open"] == []
        books = ray.get([d.book.remote() for d in daemons], timeout=60)
        for k, (node, d) in enumerate(zip(ids, dirs)):
            here = {p.name for p in subs if node in placed.nodes[p.name]}
            grants = _grants(d)
            assert {g.pipeline for g in grants} == here  # each daemon granted the pipelines placed on it, only those
            for name in here:  # every collective piece once a step on each of its nodes
                pieces = Counter((g.step, g.kind.value) for g in grants if g.pipeline == name
                                 and g.kind.value in ("reference", "training"))
                assert pieces == Counter({(s, kind): 1 for s in range(STEPS) for kind in ("reference", "training")})
            assert len(grants) == len({str(g) for g in grants})  # no sub-stage granted twice
            span = spanning[0].name in here
            assert books[k]["admitted"] == (2 * STEPS if span else 0) and books[k]["refused"] == 0
    finally:
        _stop(cluster)


@pytest.mark.parametrize("lose", ["daemon", "raylet"])
def test_a_node_lost_mid_run_loses_no_sample_of_the_pipeline_spanning_it(tmp_path, lose):
    cluster, raylets, ids, daemons, dirs = _cluster(2, tmp_path, head=False, node_timeout_s=3.0)
    try:
        sub = _recipe("span", 0, tmp_path)
        placed, (future,), (where,) = start([sub], LaunchConfig(policy="hetrl", steps=2, trial_steps=1))
        assert sorted(where) == sorted(ids), f"the pipeline was not placed across both nodes: {placed.nodes}"
        keep, gone = ids.index(where[0]), ids.index(where[1])  # its driver runs on the first
        deadline = time.monotonic() + 240
        while ray.get(daemons[gone].book.remote(), timeout=60)["admitted"] < 2:  # step 0's two gangs ran
            assert time.monotonic() < deadline, "step 0's gangs never started on the node to lose"
            time.sleep(0.1)
        if lose == "daemon":
            ray.kill(daemons[gone])
        else:
            cluster.remove_node(raylets[gone])
        rc, out = ray.get(future, timeout=480)
        assert rc == 0, out
        assert _samples(tmp_path, "span") == [PROMPTS * GROUP] * STEPS
        doc = json.loads((tmp_path / "span.json").read_text())
        assert doc["fell_open"], "node 1's pieces after the loss ran without its daemon"
        book = ray.get(daemons[keep].book.remote(), timeout=60)
        assert book["refused"] >= 1  # its part of a gang with the lost node: refused, run there alone
        trained = Counter((g.step, g.kind.value) for g in _grants(dirs[keep]) if g.kind.value == "training")
        assert trained == Counter({(s, "training"): 1 for s in range(STEPS)})  # the node kept trained every step once
    finally:
        _stop(cluster)


def test_jigsaw_run_cluster_books_each_arriving_pipeline_nodes_and_runs_it_there(tmp_path):
    import subprocess

    cluster, _, ids, _, dirs = _cluster(2, tmp_path)
    try:
        go = tmp_path / "go"
        show = ("import os, sys, time\n"
                "while not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"  # both held at once
                "print('ran on', os.environ['JIGSAW_ENDPOINT'], 'as', os.environ['JIGSAW_PIPELINE'], flush=True)\n"
                "print('owner', os.environ['JIGSAW_OWNER'], 'hook', os.environ.get('RAY_RUNTIME_ENV_HOOK'))\n"
                "sys.exit(int(sys.argv[2]))")

        def arrive(name: str, rc: int, *extra: str) -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-m", "jigsaw.cli.main", "run", "--cluster", cluster.address, "--name", name,
                 "--workload", "qwen3-0.6b-math", "--cluster-policy", "hetrl", *extra, "--",
                 sys.executable, "-c", show, str(go), str(rc)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        runs = {"a": arrive("a", 0), "b": arrive("b", 3, "--framework", "verl")}
        ctrl = get_or_start()
        deadline = time.monotonic() + 180
        while len(ray.get(ctrl.arrivals.remote(), timeout=60)) < 2:
            assert time.monotonic() < deadline, "the two arrivals were never both booked"
            assert all(p.poll() is None for p in runs.values()), [p.communicate()[0] for p in runs.values()]
            time.sleep(0.2)
        shown = subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "cluster", "--address", cluster.address],
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr
        booked = ray.get(ctrl.arrivals.remote(), timeout=60)
        for name, (node,) in booked.items():  # `jigsaw cluster` shows each booked node with its pipeline
            assert any(node[:12] in line and name in line for line in shown.stdout.splitlines()), shown.stdout
        third = arrive("c", 0)  # every node held, and hetrl packs nothing: refused, nothing runs
        out = third.communicate(timeout=180)[0]
        assert third.returncode == 2 and "c: pipeline 2 fits no node" in out and "Traceback" not in out, out
        assert "ran on" not in out
        go.touch()
        outs = {n: p.communicate(timeout=180)[0] for n, p in runs.items()}
        assert runs["a"].returncode == 0 and runs["b"].returncode == 3, outs  # CMD's exit code
        endpoints = {f"ipc://{d}/daemon.sock" for d in dirs}
        ran = {n: [w for w in endpoints if f"ran on {w} as {n}" in out] for n, out in outs.items()}
        assert all(len(v) == 1 for v in ran.values()) and ran["a"] != ran["b"], outs  # a node each, its own
        assert all("placed on 1 h100 node(s)" in out for out in outs.values()), outs
        # each its own owner token (its processes register as one pipeline); verl's workers get the hook
        told = {n: re.search(r"owner ([0-9a-f]{32}) hook (\S+)", out).groups() for n, out in outs.items()}
        assert told["a"][0] != told["b"][0], told
        assert told["a"][1] == "None" and told["b"][1] == "jigsaw.integrations.verl.ray_env.runtime_env_hook", told
        assert ray.get(ctrl.arrivals.remote(), timeout=60) == {}  # given back
    finally:
        _stop(cluster)


def _error(call):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the test looks at which one
        return exc


def test_an_arrival_whose_node_is_lost_is_placed_again_and_goes_on_from_its_checkpoint(tmp_path):
    import threading

    from jigsaw.recipes.start_gate import ENV as GATE

    cluster, _, ids, daemons, dirs = _cluster(2, tmp_path, head=False, node_timeout_s=3.0)
    try:
        steps, gate, ckpt = 3, tmp_path / "gate", tmp_path / "ckpt"
        gate.mkdir()
        # before step 1 the run waits for a second arrival at the gate: the first run, stopped
        # there, cannot end before its loss is seen; the run placed again is that second arrival
        sub = _recipe("re", 0, tmp_path)
        sub = Submitted(name="re", workload=sub.workload, cmd=("env", f"{GATE}={gate}:2:1", *sub.cmd[:4], str(steps),
                                                                *sub.cmd[5:], "--checkpoint-dir", str(ckpt)))
        said, got = [], {}
        placing = LaunchConfig(policy="hetrl", steps=2, trial_steps=1, replace_on_loss=1)
        t = threading.Thread(target=lambda: got.update(ran=arrive(sub, placing, timeout_s=400, say=said.append)),
                             daemon=True)
        t.start()
        deadline = time.monotonic() + 300
        while not any(gate.iterdir()):  # step 0 trained and saved, waiting before step 1
            assert time.monotonic() < deadline and t.is_alive(), f"the first run never reached step 1: {said} {got}"
            time.sleep(0.2)
        (first,) = ray.get(get_or_start().arrivals.remote(), timeout=60)["re"]
        ray.kill(daemons[ids.index(first)])
        t.join(420)
        ran = got["ran"]
        assert ran.returncode == 0, (said, ran.output)
        (other,) = set(ids) - {first}
        assert ran.before == ((first,),) and ran.nodes == (other,), said
        doc = json.loads((tmp_path / "re.json").read_text())
        assert doc["resumed_steps"] == 1 and [s["step"] for s in doc["steps"]] == list(range(steps))
        assert _samples(tmp_path, "re") == [PROMPTS * GROUP] * steps  # every step once, none lost
        trained = sorted(g.step for g in _grants(dirs[ids.index(other)]) if g.kind.value == "training")
        assert trained == list(range(1, steps))  # the steps after the checkpoint, on the node placed again
        assert sorted(p.name for p in ckpt.iterdir()) == [f"step-{steps - 2}", f"step-{steps - 1}"]
        assert ray.get(get_or_start().arrivals.remote(), timeout=60) == {}

        # the last node lost too: stopped, and nowhere to go: said, with where it was stopped
        hold = Submitted(name="last", workload=sub.workload, cmd=("sleep", "300"))
        quick = LaunchConfig(policy="hetrl", steps=2, trial_steps=1, replace_on_loss=1, stop_grace_s=5.0)
        t = threading.Thread(target=lambda: got.update(last=_error(lambda: arrive(hold, quick, timeout_s=400,
                                                                                   say=said.append))), daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while "last" not in ray.get(get_or_start().arrivals.remote(), timeout=60):
            assert time.monotonic() < deadline and t.is_alive(), (said, got)
            time.sleep(0.2)
        ray.kill(daemons[ids.index(other)])
        t.join(240)
        assert isinstance(got.get("last"), ValueError), (said, got, t.is_alive())
        assert f"it was stopped on node(s) {other} after losing one" in str(got["last"]), got["last"]
    finally:
        _stop(cluster)


def test_an_arrival_watched_for_lost_nodes_runs_on_when_the_controller_itself_is_lost(tmp_path):
    import threading

    cluster, _, _, _, _ = _cluster(1, tmp_path, head=False)
    try:
        go = tmp_path / "go"
        wait_go = ("import os, sys, time\n"
                   "while not os.path.exists(sys.argv[1]): time.sleep(0.05)\n")
        sub = Submitted(name="on", workload="qwen3-0.6b-math", cmd=(sys.executable, "-c", wait_go, str(go)))
        got = {}
        placing = LaunchConfig(policy="hetrl", steps=2, trial_steps=1, replace_on_loss=1)
        t = threading.Thread(target=lambda: got.update(ran=_error(lambda: arrive(sub, placing, timeout_s=300))),
                             daemon=True)
        t.start()
        deadline = time.monotonic() + 120
        while "on" not in ray.get(get_or_start().arrivals.remote(), timeout=60):
            assert time.monotonic() < deadline and t.is_alive(), got
            time.sleep(0.2)
        stop()  # the controller gone: no node is known lost, the run is not stopped
        time.sleep(3)  # a few polls of the watch against no controller
        go.touch()
        t.join(120)
        assert not isinstance(got["ran"], Exception), got["ran"]
        assert got["ran"].returncode == 0 and got["ran"].before == (), got
    finally:
        _stop(cluster)


def test_a_batch_pipeline_whose_node_is_lost_is_placed_again_and_the_other_runs_on(tmp_path):
    """launch() with replace_on_loss: the pipeline of the lost node stopped and placed again as
    an arrival (on what is left), the other untouched; every node given back at the end."""
    import threading

    cluster, _, ids, daemons, _ = _cluster(3, tmp_path, head=False, node_timeout_s=3.0)
    try:
        go = tmp_path / "go"
        show = ("import os, sys, time\n"
                "open(sys.argv[2], 'a').write(os.environ['JIGSAW_ENDPOINT'] + '\\n')\n"
                "while not os.path.exists(sys.argv[1]): time.sleep(0.05)\n")

        def ran(name: str) -> list[str]:
            path = tmp_path / f"{name}.ran"
            return path.read_text().split() if path.exists() else []

        subs = [Submitted(name=n, workload="qwen3-0.6b-math",
                          cmd=(sys.executable, "-c", show, str(go), str(tmp_path / f"{n}.ran"))) for n in "ab"]
        placing = LaunchConfig(policy="hetrl", steps=2, trial_steps=1, replace_on_loss=1, stop_grace_s=5.0)
        got = {}
        t = threading.Thread(target=lambda: got.update(done=_error(lambda: launch(subs, placing=placing,
                                                                                  timeout_s=300))), daemon=True)
        t.start()
        deadline = time.monotonic() + 180
        while not (ran("a") and ran("b")):
            assert time.monotonic() < deadline and t.is_alive(), got
            time.sleep(0.2)
        booked = ray.get(get_or_start().arrivals.remote(), timeout=60)
        moved = max("ab", key=lambda n: len(booked[n]))  # a node of its own is left to it, or the third is free
        still = ({"a", "b"} - {moved}).pop()
        lost = booked[moved][0]
        ray.kill(daemons[ids.index(lost)])
        while len(ran(moved)) < 2:  # stopped, placed again, started again
            assert time.monotonic() < deadline + 120 and t.is_alive(), got
            time.sleep(0.2)
        go.touch()
        t.join(240)
        done = got["done"]
        assert not isinstance(done, Exception), done
        by = {r.name: r for r in done.ran}
        assert by[moved].returncode == 0 and by[moved].before == (booked[moved],) and lost not in by[moved].nodes
        assert by[still].returncode == 0 and by[still].before == () and by[still].nodes == booked[still]
        assert ran(still) == [f"ipc://{tmp_path}/n{ids.index(booked[still][0])}/daemon.sock"]  # started once
        assert ran(moved)[0] != ran(moved)[1]  # the second start: on another node's daemon
        assert ray.get(get_or_start().arrivals.remote(), timeout=60) == {}
    finally:
        _stop(cluster)
