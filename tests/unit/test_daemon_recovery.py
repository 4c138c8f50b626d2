"""Issue 31: faults a production node sees, driven message by message on scripted clocks
(the real Daemon, its socket replaced by a list of what it sent: tests/recorder.py)."""

import msgspec
import pytest
from recorder import Recorder, admit

from jigsaw import protocol as pr
from jigsaw.graph.policies import NAMES
from jigsaw.trace import Trace

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def d(tmp_path):
    return Recorder(tmp_path, devices=2)


# ------------------------------------------------------------------ item 3: tokens as bytes


@pytest.mark.parametrize("stranger", ["jöb-b", "\u00e9" * 32, ""])
def test_a_non_ascii_owner_token_is_refused_as_a_stranger_and_the_owner_still_joins(d, stranger):
    """compare_digest raises on a str that is not ASCII: the daemon answered `internal` and
    the pipeline could not be joined again, even with the right token."""
    owner = "jöb-a-token"
    mine = d.register("A", owner=owner)
    (g,) = d.ask(admit(mine, "training", req=1))
    (r,) = d.ask(pr.Register(pipeline="A", pid=1, owner=stranger, req=2))
    assert isinstance(r, pr.Error) and r.code == "name-taken", r
    assert d.register("A", owner=owner)  # the job's own worker joins
    assert list(d.state.pipelines["A"].running) == [g.substage]


# ------------------------------------------------------------------ item 2: every request answered


def frame(**fields) -> bytes:
    """A request frame as a stranger (or a buggy client) writes it, bounds unchecked."""
    return msgspec.msgpack.encode({"v": pr.PROTOCOL_VERSION, **fields})


@pytest.mark.parametrize("bad", [{"step": 10**12}, {"dp_rank": -1}, {"mem_bytes": -5}, {"elapsed_s": float("nan")}])
def test_a_refused_admit_is_answered_with_its_own_request_id(d, bad):
    """The input checks answered with req=0, and a client waits for the reply with its own id."""
    s = d.register("A")
    fields = {"type": "admit", "session": s, "kind": "training", "dp_rank": 0, "step": 0, "req": 41, **bad}
    (r,) = d.receive(frame(**fields))
    assert isinstance(r, pr.Error) and r.code == "bad-message" and r.req == 41, r
    assert not d.state.pipelines["A"].waiting and not d.state.pipelines["A"].running


@pytest.mark.parametrize("bad", [{"batch_size": float("nan")}, {"num_tokens": -1}, {"flops": float("inf")}])
def test_a_done_refused_for_its_report_still_gives_its_grant_back(tmp_path, bad):
    """A refused Done left its sub-stage running until the client left: the waiting pipeline
    waited on a ghost.  The report is dropped, the release is not."""
    d = Recorder(tmp_path, devices=1, policy="serial", max_wait_s=None)
    a, b = d.register("A"), d.register("B")
    (g,) = d.ask(admit(a, "training", req=1))
    assert isinstance(g, pr.Grant)
    assert d.ask(admit(b, "training", req=2)) == []  # B waits for A's device
    replies = d.receive(frame(type="done", session=a, substage=g.substage, req=3, **bad))
    err = next(r for r in replies if isinstance(r, pr.Error))
    assert err.req == 3 and err.code == "bad-message"
    assert g.substage not in d.state.pipelines["A"].running
    assert any(isinstance(r, pr.Grant) and r.req == 2 for r in replies)  # B starts at once
    assert d.state.pipelines["A"].finished[g.substage].num_tokens == 0  # no numbers were taken


def test_a_refused_done_of_a_stranger_releases_nothing(d):
    a, b = d.register("A", devices=(0,)), d.register("B", devices=(1,))
    (g,) = d.ask(admit(a, "training", req=1))
    (r,) = d.receive(frame(type="done", session=b, substage=g.substage, req=9, flops=float("nan")))
    assert isinstance(r, pr.Error) and r.req == 9
    assert g.substage in d.state.pipelines["A"].running


# ------------------------------------------------------------------ item 8: max-wait, every policy


@pytest.mark.parametrize("policy", NAMES)
def test_a_request_is_admitted_by_max_wait_under_every_policy(tmp_path, policy):
    """Under `serial` B's request waited for A's whole turn (4.0 s with --max-wait-s 2)."""
    d = Recorder(tmp_path, devices=1, policy=policy, max_wait_s=2.0)
    a, b = d.register("A"), d.register("B")
    (g,) = d.ask(admit(a, "training", req=1))
    assert isinstance(g, pr.Grant)
    asked_s = d.time.t
    d.ask(admit(b, "rollout_decode", req=2))
    granted = lambda: any(isinstance(r, pr.Grant) and r.req == 2 for _, r in d.sent)  # noqa: E731
    while not granted() and d.time.t - asked_s < 2.0 + 0.2:
        d.run_for(0.05, beating=(a, b))
    assert granted(), f"{policy}: B still waits {d.time.t - asked_s:.2f} s after asking"
    assert g.substage in d.state.pipelines["A"].running  # A was not preempted for it


# ------------------------------------------------------------------ item 1: steps from what workers ran


def test_a_step_run_without_the_daemon_moves_the_pipeline_on_and_an_absurd_admit_still_does_not(d):
    s = d.register("A")
    (g,) = d.ask(admit(s, "training", step=0, req=1))
    d.ask(pr.Done(session=s, substage=g.substage, req=2))
    (r,) = d.ask(admit(s, "rollout_decode", step=7, req=3))  # nothing says the pipeline got there
    assert isinstance(r, pr.Error) and "jumps ahead" in r.message
    ran = pr.Opened(session=s, kind="training", dp_rank=0, step=6, reason="unreachable", req=4)
    assert d.ask(ran) == [pr.Ok(req=4)]
    (g,) = d.ask(admit(s, "rollout_decode", step=7, req=5))
    assert isinstance(g, pr.Grant) and g.substage == "A/7/r0/rollout_decode/0"
    assert d.ask(pr.Opened(session=s, kind="training", dp_rank=0, step=2, reason="lost", req=6)) == [pr.Ok(req=6)]
    assert d.state.pipelines["A"].step == 7  # an old step's report moves nothing back


def test_a_request_its_worker_gave_up_on_is_withdrawn_when_the_worker_says_it_ran_without_it(tmp_path):
    """A stalled daemon read an Admit its client had given up on (it ran the piece open) and
    granted it to nobody: the grant held its device for the rest of the job."""
    d = Recorder(tmp_path, devices=1, policy="serial", max_wait_s=None, trace=tmp_path / "trace.jsonl")
    a, b = d.register("A"), d.register("B")
    (g,) = d.ask(admit(a, "training", step=0, req=1))  # A's turn: granted, the worker runs it
    ran = pr.Opened(session=a, kind="training", dp_rank=0, step=0, reason="unreachable", req=2)
    replies = d.deliver([admit(b, "training", step=0, req=3), ran])  # ... and says it ran it open
    assert pr.Ok(req=2) in replies and g.substage not in d.state.pipelines["A"].running
    assert any(isinstance(r, pr.Grant) and r.req == 3 for r in replies)  # B gets the device at once
    d.ask(admit(a, "reference", step=0, req=4), tick=False)  # waits behind B ...
    late = pr.Opened(session=a, kind="reference", dp_rank=0, step=0, reason="unreachable", req=5)
    d.ask(late)  # ... until its worker gives up and runs it open
    assert not d.state.pipelines["A"].waiting
    d.trace_writer.close()
    drops = [e for e in Trace.read(tmp_path / "trace.jsonl").events if e.event == "drop"]
    assert [e.data["withdrawn"] for e in drops] == [[g.substage], ["A/0/r0/reference/0"]]
