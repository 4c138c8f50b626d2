"""A pipeline's client across the nodes it was placed on (runtime/across.py) and the launch's
environment (cluster/launch.py), without daemons: every client falls open, which shows which
node's client each rank's sub-stage went to.  With daemons and a Ray cluster:
tests/integration/test_cluster_launch.py."""

import json
import os

import pytest

from jigsaw.cluster.controller import NodeInfo
from jigsaw.cluster.launch import command, environment
from jigsaw.runtime.across import Across, parse_nodes
from jigsaw.runtime.client import Client, connect
from jigsaw.runtime.paths import ENV_ENDPOINT, ENV_NODES, ENV_PIPELINE

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


def test_the_launch_environment_is_what_connect_reads(monkeypatch):
    nodes = [NodeInfo(node_id="na", kind="h100", gpus=2, endpoint="ipc:///tmp/a/daemon.sock"),
             NodeInfo(node_id="nb", kind="h100", gpus=1, endpoint="ipc:///tmp/b/daemon.sock")]
    env = environment("p", nodes)
    assert env[ENV_PIPELINE] == "p" and env[ENV_ENDPOINT] == nodes[0].endpoint
    assert parse_nodes(env[ENV_NODES]) == [("na", nodes[0].endpoint, 2), ("nb", nodes[1].endpoint, 1)]
    assert ENV_NODES not in environment("p", nodes[:1])  # one node: a plain client
    with pytest.raises(ValueError, match="without a daemon endpoint"):
        environment("p", [NodeInfo(node_id="nc", kind="h100", gpus=1)])
    assert command(("x", "--dp", "{gpus}", "--ranks={gpus}"), 3) == ["x", "--dp", "3", "--ranks=3"]
    monkeypatch.setenv(ENV_NODES, json.dumps([["na", "", 2], ["nb", "", 1]]))
    client = connect("p")
    assert isinstance(client, Across) and [c.devices for c in client.clients] == [(0, 1), (0,)]
    client.close()


@pytest.mark.parametrize("text", ["not json", "[[1, 2]]", '[["a", "ipc:///x", 0]]'])
def test_a_malformed_nodes_variable_is_a_clear_error(text):
    with pytest.raises(ValueError, match="JIGSAW_NODES"):
        parse_nodes(text)
