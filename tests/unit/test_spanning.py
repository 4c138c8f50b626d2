"""Gangs that span nodes, as node daemons hold them (jigsaw/runtime/spanning.py) against the
cluster controller's real body (cluster/controller.py, in process: tests/nodes.InProcessLink).

Checked: whatever order the ranks of two pipelines that both span nodes A and B ask in, no
node starts one gang while the other node starts the other (the half-admission that deadlocks
two FSDP jobs), each Admit is taken exactly once and admitted urgent; a gang is offered only
whole; a member node that leaves gets the gang refused and the others decide it alone, as
does a live member that never asks for its part (and its ranks that ask after the refusal); a
lost controller releases everything held, as it came, and holds nothing until it answers."""

from __future__ import annotations

import itertools
import threading
from collections import Counter

import pytest
from nodes import Clock, InProcessLink

from jigsaw import protocol as pr
from jigsaw.cluster.controller import Controller
from jigsaw.runtime.spanning import Held, Spanning

pytestmark = pytest.mark.timeout(60)
NODES = ("A", "B")


def _cluster(pipelines=("X", "Y"), ranks: int = 1, node_timeout_s: float = 60.0, clock=None):
    body = Controller(node_timeout_s=node_timeout_s, gang_wait_s=10.0, **({"clock": clock} if clock else {}))
    lock = threading.Lock()
    links = {n: InProcessLink(body, n, lock) for n in NODES}
    nodes = {n: Spanning(links[n]) for n in NODES}
    for n in NODES:
        for p in pipelines:
            nodes[n].span(p, NODES, ranks)
    return body, links, nodes


def _admit(p: str, node: str, rank: int = 0, kind: str = "training", step: int = 0, ordinal: int = -1) -> Held:
    msg = pr.Admit(session=f"{p}@{node}", kind=kind, dp_rank=rank, step=step, ordinal=ordinal)
    return Held(msg, f"{p}@{node}", 0, 0.0)


@pytest.mark.parametrize("order", list(itertools.permutations([(p, n) for p in "XY" for n in NODES])))
def test_two_spanning_gangs_start_on_both_nodes_or_neither_whatever_the_arrival_order(order):
    _, _, nodes = _cluster()
    for p, n in order:
        assert nodes[n].hold(p, _admit(p, n))  # held: no node state sees it yet
    running: dict[str, set[str]] = {n: set() for n in NODES}
    taken: Counter = Counter()
    for _ in range(20):  # rounds of the daemons' loops; every gang is through long before
        for n in NODES:
            for gang, held, admitted in nodes[n].released():
                assert admitted  # urgent: started at once, as on every other member
                running[n].add(gang)
                taken[(gang, held.session)] += 1
                nodes[n].started(gang, held.session[0], f"{gang}@{n}")
        for gang in running["A"] & running["B"]:  # started on both: the collective completes
            for n in NODES:
                nodes[n].finished(gang.split("/")[0], f"{gang}@{n}")
                running[n].discard(gang)
        if len(taken) == 4 and not any(running.values()):
            break
    # A part started on one node only waits in its collective forever: none may be left.
    assert running == {"A": set(), "B": set()}, f"half-admitted: {running}"
    assert taken == {(f"{p}/0/training/0", f"{p}@{n}"): 1 for p in "XY" for n in NODES}
    assert all(not s.held and not s.running for s in nodes.values())


def test_a_gang_is_offered_only_once_every_local_rank_asked_and_ordinals_match_across_nodes():
    body, _, nodes = _cluster(pipelines=("X",), ranks=2)
    assert nodes["A"].hold("X", _admit("X", "A", rank=0))
    assert nodes["B"].hold("X", _admit("X", "B", rank=0))
    nodes["B"].hold("X", _admit("X", "B", rank=1))
    assert list(body.gates.waiting["X/0/training/0"].ready) == ["B"]  # A's part is not whole yet
    assert nodes["A"].released() == []
    nodes["A"].hold("X", _admit("X", "A", rank=1))
    got = {n: nodes[n].released() for n in NODES}
    assert all(len(v) == 2 and all(adm for _, _, adm in v) for v in got.values())
    assert not nodes["A"].hold("X", _admit("X", "A", kind="rollout_decode"))  # not collective: the node decides
    assert nodes["A"].hold("X", _admit("X", "A", kind="reference"))  # the step's first reference, then its second
    assert nodes["A"].hold("X", _admit("X", "A", kind="reference"))
    assert sorted(nodes["A"].held) == ["X/0/reference/0", "X/0/reference/1"]
    with pytest.raises(pr.ProtocolError, match="asked twice"):
        nodes["A"].hold("X", _admit("X", "A", kind="reference", ordinal=1))


def test_a_member_node_that_leaves_gets_the_gang_refused_and_the_other_decides_it_alone():
    body, _, nodes = _cluster(pipelines=("X",))
    assert nodes["A"].hold("X", _admit("X", "A"))
    body.leave("B")  # B's daemon lost (the controller stopped hearing it)
    (gang, held, admitted), = nodes["A"].released()
    assert gang == "X/0/training/0" and held.session == "X@A" and not admitted
    assert nodes["A"].refused == 1 and not nodes["A"].held


def test_a_live_member_that_never_asks_gets_the_gang_refused_and_its_ranks_asking_later_run_alone():
    clock = Clock()
    body, _, nodes = _cluster(pipelines=("X",), ranks=2, clock=clock)
    assert nodes["A"].hold("X", _admit("X", "A", rank=0)) and nodes["A"].hold("X", _admit("X", "A", rank=1))
    assert nodes["B"].hold("X", _admit("X", "B", rank=0))  # B's rank 1 runs without its daemon: B never offers
    clock.t = 9.0
    assert nodes["A"].released() == [] and nodes["B"].released() == []  # within the wait: held, heartbeats go on
    clock.t = 10.0
    out = nodes["A"].released()
    assert [(h.msg.dp_rank, adm) for _, h, adm in out] == [(0, False), (1, False)] and nodes["A"].refused == 1
    assert [(h.msg.dp_rank, adm) for _, h, adm in nodes["B"].released()] == [(0, False)]
    assert not nodes["B"].hold("X", _admit("X", "B", rank=1))  # asks after the refusal: decided at B alone
    assert nodes["B"].hold("X", _admit("X", "B", rank=0, step=1))  # the next gang waits for the cluster again
    assert sorted(body.members) == ["A", "B"]  # nobody left: B is alive, only silent about that gang


def test_a_lost_controller_releases_everything_held_as_it_came_and_nothing_is_held_until_it_answers():
    _, links, nodes = _cluster()
    for p in "XY":
        assert nodes["A"].hold(p, _admit(p, "A"))
    links["A"].lost = True
    out = nodes["A"].released()
    assert sorted(h.session for _, h, _ in out) == ["X@A", "Y@A"] and not any(adm for _, _, adm in out)
    assert not nodes["A"].hold("X", _admit("X", "A", step=1))  # decided here while the controller is lost
    links["A"].lost = False
    assert nodes["A"].released() == [] and not nodes["A"].lost
    assert nodes["A"].hold("X", _admit("X", "A", step=2))


def test_a_client_gone_withdraws_its_offer_and_a_node_outside_the_span_is_refused():
    body, _, nodes = _cluster(pipelines=("X",))
    assert nodes["A"].hold("X", _admit("X", "A"))
    assert body.gates.waiting["X/0/training/0"].ready == {"A"}
    nodes["A"].forget({"X@A"})
    assert body.gates.waiting["X/0/training/0"].ready == set() and not nodes["A"].held
    with pytest.raises(pr.ProtocolError, match="not this one"):
        nodes["A"].span("Z", ("B", "C"), 1)
