"""A pipeline's client across the nodes it was placed on (runtime/across.py) and the launch's
environment (cluster/launch.py), mostly without daemons: every client falls open, which shows
which node's client each rank's sub-stage went to.  With in-process daemons: what connect()
makes of the environment, and its fall-back to this node alone where the other nodes' daemons
cannot each be reached at an endpoint of their own.  With daemons and a Ray cluster:
tests/integration/test_cluster_launch.py."""

import json
import os
import subprocess
import sys

import pytest

from jigsaw.cluster.controller import NodeInfo
from jigsaw.cluster.launch import command, environment
from jigsaw.runtime.across import Across, parse_nodes
from jigsaw.runtime.client import Client, connect
from jigsaw.runtime.paths import ENV_ENDPOINT, ENV_NODES, ENV_OWNER, ENV_PIPELINE

pytestmark = pytest.mark.timeout(60)


def _across() -> Across:
    return Across("p", [("node-a", "", 2), ("node-b", "", 1)], Client)  # "": no daemon, every client falls open


def test_each_rank_goes_to_the_node_of_its_device_with_its_local_rank():
    a = _across()
    assert [(a.clients.index(c), local, off) for c, local, off in map(a.where, range(3))] == \
        [(0, 0, 0), (0, 1, 0), (1, 0, 2)]
    ro = a.rollout(dp_rank=2, step=0)
    assert ro.client is a.clients[1] and ro.dp_rank == 0 and ro.rank_offset == 2
    a.close()


def test_a_gang_is_asked_of_each_node_for_its_own_ranks_and_comes_back_in_members_order():
    a, me = _across(), os.getpid()
    with a.gang("training", members=[(2, (me,)), (0, ()), (1, (me, me))], step=4) as grants:
        assert [g.pids for g in grants] == [(me,), (), (me, me)]
        assert [g.dp_rank for g in grants] == [0, 0, 1]  # each its node's local rank
    assert [(r["dp_rank"], r["step"]) for r in a.clients[0].fallen_open] == [(0, 4), (1, 4)]
    assert [(r["dp_rank"], r["step"]) for r in a.clients[1].fallen_open] == [(0, 4)]
    assert len(a.fallen_open) == 3
    a.close()


def test_a_collective_stage_as_one_sub_stage_across_nodes_is_refused_host_work_goes_to_the_first():
    a = _across()
    with pytest.raises(ValueError, match="gang of ranks on every node"):
        with a.substage("training", step=0):
            pass
    with a.substage("reward", step=0):
        pass
    assert [r["kind"] for r in a.clients[0].fallen_open] == ["reward"] and not a.clients[1].fallen_open
    a.close()


def test_the_launch_environment_is_what_connect_reads(monkeypatch, tmp_path):
    nodes = [NodeInfo(node_id="na", kind="h100", gpus=2, endpoint="ipc:///tmp/a/daemon.sock"),
             NodeInfo(node_id="nb", kind="h100", gpus=1, endpoint="ipc:///tmp/b/daemon.sock")]
    env = environment("p", nodes, "t0k3n")
    assert env[ENV_PIPELINE] == "p" and env[ENV_ENDPOINT] == nodes[0].endpoint and env[ENV_OWNER] == "t0k3n"
    assert parse_nodes(env[ENV_NODES]) == [("na", nodes[0].endpoint, 2), ("nb", nodes[1].endpoint, 1)]
    assert ENV_NODES not in environment("p", nodes[:1], "t0k3n")  # one node: a plain client
    with pytest.raises(ValueError, match="without a daemon endpoint"):
        environment("p", [NodeInfo(node_id="nc", kind="h100", gpus=1)], "t0k3n")
    assert command(("x", "--dp", "{gpus}", "--ranks={gpus}"), 3) == ["x", "--dp", "3", "--ranks=3"]
    daemons = _daemons(tmp_path, "ab")
    try:
        monkeypatch.setenv(ENV_NODES, json.dumps([["na", daemons[0][1], 2], ["nb", daemons[1][1], 1]]))
        client = connect("p")
        assert isinstance(client, Across) and [c.devices for c in client.clients] == [(0, 1), (0,)]
        assert all(c.connected for c in client.clients)
        client.close()
    finally:
        for node, _ in daemons:
            node.close()


def _daemons(tmp_path, names: str) -> list:
    """A real daemon per name (in-process), serving: (node, endpoint)."""
    from nodes import ThreadNode

    from jigsaw.runtime.paths import endpoint

    out = []
    for n in names:
        node = ThreadNode(tmp_path / n, devices=2)
        node.client("probe")  # returns once the daemon answers
        out.append((node, endpoint(node.dir)))
    return out


_JOIN = ("from jigsaw.runtime.client import connect\n"
         "c = connect('p')\n"
         "print(type(c).__name__, c.connected, flush=True)\n"
         "c.close()")


def test_every_process_of_a_pipeline_placed_across_nodes_joins_it_on_each_node_by_its_token(monkeypatch, tmp_path):
    """A verl job's trainer and its replicas are processes of their own: each registers the
    pipeline on every node; the launch's owner token, not the first process, is its owner."""
    daemons = _daemons(tmp_path, "ab")
    try:
        placed = json.dumps([["na", daemons[0][1], 2], ["nb", daemons[1][1], 2]])
        monkeypatch.setenv(ENV_NODES, placed)
        monkeypatch.setenv(ENV_OWNER, "a" * 32)
        first = connect("p")
        assert isinstance(first, Across) and first.connected

        def joined(token: str) -> str:
            env = {**os.environ, ENV_NODES: placed, ENV_OWNER: token}
            return subprocess.run([sys.executable, "-c", _JOIN], env=env, capture_output=True, text=True,
                                  timeout=60).stdout.strip()

        assert joined("a" * 32) == "Across True"
        assert joined("b" * 32) == "Client False"  # another job's token: refused on every node
        first.close()
    finally:
        for node, _ in daemons:
            node.close()


def test_a_verl_job_placed_across_nodes_gets_every_nodes_ranks_and_its_workers_the_placement(monkeypatch):
    from jigsaw.integrations.verl.placement import node_devices
    from jigsaw.integrations.verl.ray_env import runtime_env_hook

    a = _across()
    assert node_devices(a) == 3  # rank r on the node of the r-th device: replicas and trainer ranks on both
    a.close()
    monkeypatch.setenv(ENV_NODES, '[["na", "ipc:///a", 2], ["nb", "ipc:///b", 1]]')
    assert runtime_env_hook({})["env_vars"][ENV_NODES] == os.environ[ENV_NODES]  # Ray workers connect across too


@pytest.mark.parametrize("case", ["one-endpoint", "unreachable"])
def test_nodes_this_process_cannot_reach_each_at_its_own_endpoint_fall_back_to_this_node_alone(
        monkeypatch, tmp_path, caplog, case):
    """Nodes on other hosts: their ipc paths name this host's daemon, or nothing here.  An
    Across would hold every gang on this node for parts no other node is ever asked for."""
    ((node, ep),) = _daemons(tmp_path, "a")
    try:
        other = ep if case == "one-endpoint" else f"ipc://{tmp_path}/elsewhere/daemon.sock"
        monkeypatch.setenv(ENV_ENDPOINT, ep)
        monkeypatch.setenv(ENV_NODES, json.dumps([["na", ep, 2], ["nb", other, 2]]))
        client = connect("p")
        assert type(client) is Client and client.connected and client.nodes == ()
        assert "scheduled by this node's daemon alone" in caplog.text
        assert ("share daemon endpoints" if case == "one-endpoint" else "['nb'] cannot be reached") in caplog.text
        with client.substage("training", dp_rank=0, step=0) as h:
            assert h.substage  # granted by this node's daemon, not held for a node that never asks
        client.close()
        assert node.daemon.spanning.held == {}
    finally:
        node.close()


@pytest.mark.parametrize("text", ["not json", "[[1, 2]]", '[["a", "ipc:///x", 0]]'])
def test_a_malformed_nodes_variable_is_a_clear_error(text):
    with pytest.raises(ValueError, match="JIGSAW_NODES"):
        parse_nodes(text)
