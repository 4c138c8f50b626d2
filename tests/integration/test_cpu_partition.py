"""CPU partitions: core splits, the daemon's typed descriptors, and the worker-side bind."""

import contextlib
import json
import os
import subprocess
import sys
import threading

import msgspec
import pytest

from jigsaw.mux.partition.bind import Binder, affinity, follow_threads
from jigsaw.mux.partition.cpu import cpu_levels, split_cores
from jigsaw.mux.partition.partitioners import Advisory, AdvisoryPartitioner, Cpu, CpuPartitioner, Green, Partition


def test_levels_are_shares_a_core_split_can_give():
    assert cpu_levels(1) == (0.5, 1.0)  # one core: two time-sharing sub-stages get half of it each
    assert cpu_levels(2) == (0.5, 1.0)
    assert cpu_levels(4) == (0.25, 0.5, 0.75, 1.0)
    assert cpu_levels(16) == (0.0625, 0.5, 0.9375, 1.0)


def test_split_cores_is_disjoint_and_never_empty():
    assert split_cores((0, 1), 0.25) == ((0,), (1,))
    assert split_cores(tuple(range(8)), 0.75) == ((0, 1, 2, 3, 4, 5), (6, 7))
    for n in range(2, 9):
        for frac in (0.1, 0.25, 0.5, 0.75, 0.9):
            a, b = split_cores(tuple(range(n)), frac)
            assert a and b and not set(a) & set(b) and len(a) + len(b) == n
    with pytest.raises(ValueError, match="cannot split 1"):
        split_cores((0,), 0.5)


def test_partitioner_gives_each_side_of_a_pair_its_own_cores():
    p = CpuPartitioner(num_devices=2, cores=(0, 1, 2, 3))
    assert p.partitions(1, (("a", 1.0),)) == {"a": Cpu(cores=(2, 3), threads=2)}
    pair = p.partitions(0, (("a", 0.5), ("b", 0.5)))
    assert {pair[s].cores for s in "ab"} == {(0,), (1,)}
    big = CpuPartitioner(num_devices=1, cores=tuple(range(8))).partitions(0, (("small", 0.25), ("large", 0.75)))
    assert big == {"large": Cpu(cores=(0, 1, 2, 3, 4, 5), threads=6), "small": Cpu(cores=(6, 7), threads=2)}
    shared = p.partitions(0, (("a", 1.0), ("b", 1.0)))  # unpartitioned sharing: both see every core
    assert shared["a"].cores == shared["b"].cores == (0, 1)
    with pytest.raises(ValueError, match="at most 2"):
        p.partitions(0, (("a", 0.25), ("b", 0.25), ("c", 0.5)))
    with pytest.raises(ValueError, match="cannot make"):
        CpuPartitioner(num_devices=3, cores=(0, 1))
    assert AdvisoryPartitioner().partitions(0, (("a", 0.5),)) == {"a": Advisory()}


def test_a_share_alone_keeps_its_share_and_equal_halves_keep_their_cores():
    p = CpuPartitioner(num_devices=1, cores=(0, 1, 2, 3))
    # a static split: B's half while A's half is idle is still half, not the whole device
    assert p.partitions(0, (("B/0/r0/training/0", 0.5),)) == {"B/0/r0/training/0": Cpu(cores=(0, 1), threads=2)}
    pair = p.partitions(0, (("A/0/r0/rollout_tail/0", 0.5), ("B/0/r0/training/0", 0.5)))
    # by name A would take the first half, but B held it: each keeps the cores it had
    assert pair["B/0/r0/training/0"].cores == (0, 1) and pair["A/0/r0/rollout_tail/0"].cores == (2, 3)
    assert p.partitions(0, (("A/1/r0/rollout_prefill/0", 0.5),))["A/1/r0/rollout_prefill/0"].cores == (2, 3)
    again = p.partitions(0, (("A/1/r0/rollout_prefill/0", 0.5), ("B/1/r0/rollout_decode/0", 0.5)))
    assert again["A/1/r0/rollout_prefill/0"].cores == (2, 3) and again["B/1/r0/rollout_decode/0"].cores == (0, 1)
    # unequal shares go by size, whatever was held before
    big = p.partitions(0, (("A/2/r0/training/0", 0.25), ("B/2/r0/training/0", 0.75)))
    assert big["B/2/r0/training/0"].cores == (0, 1, 2) and big["A/2/r0/training/0"].cores == (3,)
    assert p.partitions(0, (("A/3/r0/training/0", 1.0),))["A/3/r0/training/0"].cores == (0, 1, 2, 3)


def test_partitions_are_a_tagged_union_on_the_wire():
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Partition)
    for part in (Advisory(), Cpu(cores=(0, 3), threads=2), Green(num_sms=64, budget=0.5, side=1, levels=(0.5,))):
        assert dec.decode(enc.encode(part)) == part
    with pytest.raises(msgspec.ValidationError):
        dec.decode(enc.encode({"type": "cpu", "cores": [0], "threads": 1, "shell": "rm -rf /"}))


def _sleeper() -> subprocess.Popen:
    """A process with several threads (a worker the client is told about)."""
    code = ("import threading, time\n"
            "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "print('ready', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_bind_pins_every_thread_of_every_listed_process_and_exclusive_undoes_it():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores to tell a partition from the whole machine")
    procs = [_sleeper(), _sleeper()]
    try:
        pids = [p.pid for p in procs]
        binder = Binder()
        b = binder.bind(Cpu(cores=(cores[0],), threads=1), pids)
        assert b.cores == (cores[0],)
        for pid in pids:
            threads = affinity(pid)
            assert len(threads) >= 4 and set(threads.values()) == {(cores[0],)}  # read back from /proc
        binder.bind(None, pids)  # fell open: the whole machine again
        for pid in pids:
            assert set(affinity(pid).values()) == {tuple(cores)}
        binder.bind(Advisory(), pids)  # advice changes nothing
        assert set(affinity(pids[0]).values()) == {tuple(cores)}
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_bind_of_this_process_pins_existing_threads_and_threads_follow_the_cores():
    torch = pytest.importorskip("torch")
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # a thread that exists before the binding
    other.start()
    try:
        core = min(before)
        Binder().bind(Cpu(cores=(core,), threads=1))
        assert os.sched_getaffinity(0) == {core} and torch.get_num_threads() == 1
        assert os.sched_getaffinity(other.native_id) == {core}
        assert follow_threads(cap=4) == 1  # never more threads than cores
    finally:
        stop.set()
        other.join()
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended since the listing
                os.sched_setaffinity(int(tid), before)
        torch.set_num_threads(threads)
    assert follow_threads() == len(before) and follow_threads(cap=1) == 1
    torch.set_num_threads(threads)


def test_binding_a_process_that_is_gone_is_harmless():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(10)  # exited and reaped: the pid names no process
    Binder().bind(Cpu(cores=(min(os.sched_getaffinity(0)),), threads=1), [p.pid])  # no exception


DRIVER = """
import json, os, subprocess, sys, time
from jigsaw.runtime.client import connect
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
c = connect(pipeline="D", endpoint=sys.argv[1])
out = {"before": sorted(os.sched_getaffinity(0))}
with c.substage("training", step=0, pids=[child.pid]) as g:
    out["granted"] = list(g.partition.cores)
    out["child"] = sorted(os.sched_getaffinity(child.pid))
    out["driver"] = sorted(os.sched_getaffinity(0))
c.close()
child.kill()
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_the_process_holding_the_client_goes_to_its_pipelines_cores(tmp_path):
    from nodes import Node

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to tell a half from the whole machine")
    node = Node(tmp_path)
    node.start("--partitioner", "cpu", "--policy", "static")  # half the cores, even alone
    try:
        res = subprocess.run([sys.executable, "-c", DRIVER, node.ep], capture_output=True, text=True, timeout=90,
                             env=node.env)
    finally:
        node.stop()
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.splitlines()[-1])
    assert len(got["granted"]) == len(got["before"]) // 2
    # the worker is on its partition, and the driver's own Python (batching, rewards) with it
    assert got["child"] == got["granted"] and got["driver"] == got["granted"]


class _Driver:
    """tests/workers/host_driver.py as pipeline `name`: one command, one JSON answer."""

    def __init__(self, node, name: str):
        from nodes import ROOT

        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "workers" / "host_driver.py"), name,
                                      node.ep], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=node.env, cwd=ROOT)

    def __call__(self, line: str) -> dict:
        import select

        from waiting import HANG_S

        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], HANG_S)
        assert ready, f"the driver did not answer {line!r} within {HANG_S:g} s"
        return json.loads(self.proc.stdout.readline())

    def quit(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        assert self.proc.wait(30) == 0


@pytest.mark.timeout(120)
def test_a_tool_that_computes_runs_on_the_cores_no_sub_stage_holds(tmp_path):
    """A code tool run on this CPU (Admit.computes) is CPU work: its processes go where no
    device sub-stage runs, all the cores when nothing does (not the one core its pipeline's
    last grant left its driver on), and they move when a partner's sub-stage takes a core,
    while that partner is held to its half (the tool keeps its pipeline's share)."""
    from nodes import Node
    from waiting import HANG_S, wait_until

    every = sorted(os.sched_getaffinity(0))
    if len(every) < 2:
        pytest.skip("needs two cores to tell a half from the whole machine")
    node = Node(tmp_path)
    node.start("--partitioner", "cpu", "--heartbeat-s", "0.05")
    a, b = _Driver(node, "A"), _Driver(node, "B")
    try:
        b("probe")  # registered: B is in its own Python, and keeps its share of the CPU
        held = a("enter training")
        assert len(held["granted"]) == len(every) // 2 and held["driver"] == held["granted"]
        a("exit")
        tool = a("enter tool computes")
        assert tool["granted"] == every and tool["child"] == every  # nothing else holds a core
        training = b("enter training")["granted"]
        assert len(training) == len(every) // 2  # the tool keeps A's share: B is held to its half
        free = sorted(set(every) - set(training))
        wait_until(lambda: a("probe")["child"] == free, HANG_S, f"A's tool processes moved to {free}")
        a("exit")  # before B's training ends, which would hand the tool every core again (after a delay)
        b("exit")
        a.quit()
        b.quit()
        events = node.left("A")
    finally:
        node.stop()
    [host] = [e for e in events if e["event"] == "host" and "/tool/" in e["substage"]]
    assert host["data"]["computes"] is True and host["data"]["cores"] == free
