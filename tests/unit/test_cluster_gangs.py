"""Gangs across nodes admitted whole or not at all, whatever the order nodes ask in
(jigsaw/cluster/gangs.py), and the controller's node book and placement on concrete nodes
(jigsaw/cluster/controller.py) without Ray: the actor's body is plain Python."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from nodes import Clock

from jigsaw.cluster.controller import Controller, NodeInfo
from jigsaw.cluster.gangs import Gates
from jigsaw.cluster.placement import place
from jigsaw.cluster.simulate import PLACERS, ClusterConfig, estimator
from jigsaw.cluster.spec import NodeKind
from jigsaw.sim.run import SimConfig

CROSSED = {"g1": frozenset("AB"), "g2": frozenset("BC"), "g3": frozenset("CA"), "g4": frozenset("AB")}
"""Four gangs over three nodes, each pair of nodes shared by two of them: where a node that
waited holding its devices for the first gang it saw would deadlock with the others."""


def _run(gangs: dict[str, frozenset], order: list[tuple[str, str]], rng: random.Random) -> list[str]:
    """Nodes that ask for their gangs in `order`, run one gang at a time, finish it, and ask
    again for the rest; the order in which gangs were admitted (each checked whole)."""
    gates, busy, admitted = Gates(), {}, []
    wants = {n: [g for g, members in gangs.items() if n in members] for n in "ABC"}
    for gang, node in order:
        gates.ready(gang, node, gangs[gang])
    for _ in range(50):  # a deadline in rounds: every gang must be through long before
        for gang in gates.admit():
            assert all(node not in busy for node in gangs[gang]), "a node started two gangs at once"
            busy.update({node: gang for node in gangs[gang]})
            admitted.append(gang)
        for node in "ABC":
            told = gates.take(node)
            assert all(why == "" for _, why in told)
            assert {g for g, _ in told} <= {busy.get(node)}
        if not busy and len(admitted) == len(gangs):
            return admitted
        finished = rng.choice(sorted(set(busy.values()))) if busy else None
        if finished:
            gates.done(finished)
            for node in gangs[finished]:
                del busy[node]
                wants[node].remove(finished)
                for g in wants[node]:  # idle again: it could start any of its other gangs now
                    if g not in gates.running:
                        gates.ready(g, node, gangs[g])
    raise AssertionError(f"deadlock: admitted {admitted}, waiting {sorted(gates.waiting)}")


def test_crossed_gangs_all_run_whole_in_every_arrival_order():
    asks = [(g, n) for g, members in CROSSED.items() for n in sorted(members)]
    rng = random.Random(0)
    for k, order in enumerate(itertools.permutations(asks)):
        if k % 97:  # 8! orders: every 97th, about 400 of them
            continue
        assert sorted(_run(CROSSED, list(order), rng)) == sorted(CROSSED)


def test_a_gang_waits_for_every_member_and_starts_on_all_at_once():
    gates = Gates()
    gates.ready("g", "A", frozenset("AB"))
    assert gates.admit() == [] and gates.take("A") == []  # half the gang: nothing starts
    gates.ready("g", "B", frozenset("AB"))
    assert gates.admit() == ["g"]
    assert gates.take("A") == [("g", "")] and gates.take("B") == [("g", "")]
    assert gates.take("A") == []  # told once
    gates.ready("g", "A", frozenset("AB"))  # an offer its admission crossed on the way: nothing new
    assert gates.admit() == [] and gates.take("A") == [] and "g" not in gates.waiting


def test_a_lost_member_refuses_its_waiting_gangs_to_the_others_and_a_rejoin_clears_it():
    gates = Gates()
    gates.ready("g", "A", frozenset("AB"))
    gates.ready("h", "A", frozenset("AC"))
    assert gates.leave("B") == ["g"]
    assert gates.take("A") == [("g", "node 'B' left the cluster")]  # A runs that piece alone
    gates.ready("g2", "A", frozenset("AB"))  # asked after the loss: refused at once
    assert gates.take("A") == [("g2", "node(s) ['B'] left the cluster")]
    gates.rejoin("B")
    gates.ready("g3", "A", frozenset("AB"))
    gates.ready("g3", "B", frozenset("AB"))
    assert gates.admit() == ["g3"] and "h" in gates.waiting  # the gang with C still waits for C


def test_requests_that_do_not_add_up_are_refused_with_the_reason():
    gates = Gates()
    with pytest.raises(ValueError, match="not a member"):
        gates.ready("g", "C", frozenset("AB"))
    gates.ready("g", "A", frozenset("AB"))
    with pytest.raises(ValueError, match="another said"):
        gates.ready("g", "B", frozenset("ABC"))
    gates.withdraw("g", "A")  # it started other work: a later B alone admits nothing
    gates.ready("g", "B", frozenset("AB"))
    assert gates.admit() == []
    assert gates.take("stranger") == []


def test_a_silent_node_leaves_and_its_waiting_gang_is_refused():
    clock = Clock()
    c = Controller(node_timeout_s=5.0, clock=clock)
    for n in "AB":
        c.join(NodeInfo(node_id=n, kind="h100", gpus=1))
    c.ready("g", "A", ("A", "B"))
    clock.t = 4.0
    assert c.heartbeat("A")
    clock.t = 7.0  # B last heard at 0
    assert [n.node_id for n in c.nodes()] == ["A"]
    assert c.take("A") == [("g", "node 'B' left the cluster")]
    assert not c.heartbeat("B")  # forgotten: it must join again
    c.join(NodeInfo(node_id="B", kind="h100", gpus=1))
    assert sorted(n.node_id for n in c.nodes()) == ["A", "B"]


def test_a_gang_whose_missing_member_is_free_and_silent_for_the_wait_is_refused_but_not_while_it_is_busy():
    gates = Gates()
    gates.ready("h", "B", frozenset("BC"), now_s=0.0)
    gates.ready("h", "C", frozenset("BC"), now_s=0.0)
    assert gates.admit() == ["h"]  # B busy with h
    gates.ready("g", "A", frozenset("AB"), now_s=1.0)
    gates.ready("w", "A", frozenset("AC"), now_s=1.0)
    gates.withdraw("w", "A")  # nobody asks for w any more: nothing to refuse to anyone
    assert gates.overdue(now_s=100.0, wait_s=10.0) == []  # B is still in h: it may ask after it
    gates.done("h", now_s=100.0)
    assert gates.overdue(now_s=109.0, wait_s=10.0) == []  # free for 9 s only
    assert gates.overdue(now_s=110.0, wait_s=10.0) == ["g"]
    why = "node(s) ['B'] did not ask for their part within 10 s"
    assert gates.take("A") == [("g", why)] and gates.take("B") == [("h", ""), ("g", why)]
    assert "g" not in gates.waiting and "w" in gates.waiting


def test_the_controller_refuses_a_gang_a_live_member_never_asks_for_once_the_wait_is_over():
    clock = Clock()
    c = Controller(node_timeout_s=100.0, clock=clock, gang_wait_s=30.0)
    for n in "AB":
        c.join(NodeInfo(node_id=n, kind="h100", gpus=1))
    c.ready("g", "A", ("A", "B"))
    clock.t = 29.0
    assert c.heartbeat("A") and c.heartbeat("B") and c.take("A") == []
    clock.t = 30.0
    assert c.take("A") == [("g", "node(s) ['B'] did not ask for their part within 30 s")]
    assert sorted(n.node_id for n in c.nodes()) == ["A", "B"]


def test_the_controller_places_on_concrete_nodes_what_the_search_predicts():
    c = Controller()
    for n, kind in (("n1", "h100"), ("n2", "a100"), ("n3", "h100")):
        c.join(NodeInfo(node_id=n, kind=kind, gpus=1))
    c.submit("math", "qwen3-0.6b-math")
    c.submit("gsm8k", "qwen3-0.6b-gsm8k")
    with pytest.raises(ValueError, match="already submitted"):
        c.submit("math", "qwen3-0.6b-math")
    got = c.place(steps=2, trial_steps=1, policy="hetrl")
    # the same search over the same cluster, outside the actor
    sim = SimConfig(workload=("qwen3-0.6b-gsm8k", "qwen3-0.6b-math"), steps=2, trace=False)
    want = place(2, (NodeKind(kind="h100", count=2, gpus=1), NodeKind(kind="a100", count=1, gpus=1)),
                 estimator(sim, ClusterConfig(cluster_trial_steps=1), PLACERS["hetrl"].node_policy), 1)
    assert got.groups == want.groups and got.predicted_s == pytest.approx(want.predicted_s)
    kinds = {"n1": "h100", "n2": "a100", "n3": "h100"}
    names = ["gsm8k", "math"]
    for g in got.groups:
        for i in g.pipelines:
            assert len(got.nodes[names[i]]) == g.nodes
            assert all(kinds[n] == g.kind for n in got.nodes[names[i]])
    every = [n for g in got.groups for n in got.nodes[names[g.pipelines[0]]]]
    assert len(every) == len(set(every))  # no node given twice
    assert math.isfinite(max(got.predicted_s))


def test_a_batch_placement_is_booked_so_arrivals_and_later_batches_get_only_free_nodes():
    c = Controller()
    for n, kind in (("h1", "h100"), ("h2", "h100"), ("a1", "a100"), ("a2", "a100")):
        c.join(NodeInfo(node_id=n, kind=kind, gpus=1))
    c.submit("a", "qwen3-0.6b-math")
    a = set(c.place(steps=2, trial_steps=1, policy="hetrl").nodes["a"])
    assert len(a) == 2 and len({n[0] for n in a}) == 1  # one kind's two nodes
    b = set(_arrive(c, "b", "qwen3-0.6b-gsm8k", "hetrl"))
    assert len(b) == 1 and not a & b  # the arrival sees the batch's nodes held: the fewest of the other kind
    c.submit("d", "qwen3-0.6b-gsm8k")
    d = c.place(steps=2, trial_steps=1, policy="hetrl").nodes
    assert sorted(d) == ["d"] and len(d["d"]) == 1 and not set(d["d"]) & (a | b)  # only d: a and b run on
    c.submit("e", "qwen3-0.6b-math")
    with pytest.raises(ValueError, match="no free node: running pipelines hold all 4"):
        c.place(steps=2, trial_steps=1, policy="hetrl")
    c.ended("a")
    assert set(c.place(steps=2, trial_steps=1, policy="hetrl").nodes["e"]) == a  # on a's nodes, given back
    for name in "bde":
        c.ended(name)
    assert c.running == [] and c.workloads == {}
    with pytest.raises(ValueError, match="no pipeline submitted"):
        c.place(steps=2, trial_steps=1, policy="hetrl")


def _arrive(c: Controller, name: str, workload: str, policy: str) -> tuple[str, ...]:
    ask = c.arriving(name, workload, steps=2, trial_steps=1, policy=policy)
    return c.arrived(ask, ask.decide())


def test_pipelines_arriving_one_at_a_time_get_free_nodes_or_pack_beside_a_running_group_and_give_them_back():
    c = Controller()
    for n in ("n1", "n2", "n3"):
        c.join(NodeInfo(node_id=n, kind="h100", gpus=1))
    a = _arrive(c, "a", "qwen3-0.6b-math", "hetrl")
    b = _arrive(c, "b", "qwen3-0.6b-gsm8k", "hetrl")
    assert len(a) >= 1 and len(b) >= 1 and not set(a) & set(b)  # hetrl: nodes of its own, none held twice
    with pytest.raises(ValueError, match="already in the cluster"):
        c.arriving("a", "qwen3-0.6b-math")
    with pytest.raises(ValueError, match="unknown"):
        c.arriving("z", "qwen3-0.6b-math", policy="nope")
    free = {"n1", "n2", "n3"} - set(a) - set(b)
    if not free:  # every node held: hetrl packs nothing, so nothing fits
        with pytest.raises(ValueError, match="fits no node"):
            _arrive(c, "c", "qwen3-0.6b-math", "hetrl")
    # jigsaw packs the next beside a running group where jigsaw's trial keeps the pair within 2x
    # each alone, else it takes free nodes: either way the booking is what the decision said
    ask = c.arriving("d", "qwen3-0.6b-math", steps=2, trial_steps=1, policy="jigsaw")
    k, group = ask.decide()
    d = c.arrived(ask, (k, group))
    if k is None:
        assert set(d) <= free and len(d) == group.nodes
    else:
        assert d == c.running[k].node_ids and "d" in c.running[k].names and len(group.pipelines) == 2
    for name in ("a", "b", "d"):
        c.ended(name)
    assert c.running == [] and "a" not in c.workloads
    # every node is free again: three pipelines on nodes of their own fit
    got = [_arrive(c, f"e{i}", "qwen3-0.6b-math", "hetrl") for i in range(3)]
    assert sorted(n for ids in got for n in ids) == ["n1", "n2", "n3"]
