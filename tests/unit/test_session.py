"""A session's budget changes on their way to the worker: shrinks at once, grows after a
settle time unless taken back, a parked heartbeat answered when one falls due."""

import pytest

from jigsaw import protocol as pr
from jigsaw.mux.partition.partitioners import Cpu
from jigsaw.runtime.session import Session

pytestmark = pytest.mark.timeout(30)
SID = "A/0/r0/training/0"


def _grant(frac: float, cores: tuple[int, ...], req: int = 0) -> pr.Grant:
    return pr.Grant(substage=SID, device=0, sm_frac=frac, mem_bytes=0, partition=Cpu(cores=cores, threads=len(cores)),
                    req=req)


def test_a_shrink_goes_at_once_a_grow_waits_and_a_grow_taken_back_is_never_sent():
    s = Session(pipeline="A", last_seen=0.0)
    s.admitted(_grant(0.5, (0,), req=3))
    s.queue(_grant(1.0, (0, 1)), now_s=10.0, settle_s=0.02)  # the partner ended: grow, later
    assert not s.due(10.0) and s.next_due_s() == pytest.approx(10.02)
    s.queue(_grant(0.5, (0,)), now_s=10.005, settle_s=0.02)  # its next sub-stage asked: back to what A holds
    assert s.next_due_s() is None and s.take(11.0) == ()
    s.queue(_grant(1.0, (0, 1)), now_s=12.0, settle_s=0.02)
    assert s.take(12.01) == () and [g.sm_frac for g in s.take(12.02)] == [1.0]
    s.queue(_grant(0.5, (1,)), now_s=13.0, settle_s=0.02)  # a shrink: the partner starts on core 1 now
    assert s.due(13.0) and [g.partition.cores for g in s.take(13.0)] == [(1,)]


def test_a_parked_heartbeat_is_answered_when_a_change_falls_due_or_its_time_is_up():
    s = Session(pipeline="A", last_seen=0.0)
    s.admitted(_grant(0.5, (0,)))
    s.park(conn=7, req=41, until_s=5.0)
    assert s.reply(1.0) is None
    s.queue(_grant(1.0, (0, 1)), now_s=1.0, settle_s=0.5)
    assert s.reply(1.2) is None  # the grow is not due yet
    conn, beat = s.reply(1.5)
    assert conn == 7 and beat.req == 41 and [g.sm_frac for g in beat.grants] == [1.0] and s.parked is None
    s.park(conn=7, req=42, until_s=6.0)
    assert s.reply(5.9) is None and s.reply(6.0)[1].grants == ()
    s.park(conn=7, req=43, until_s=9.0)
    assert s.reply(7.0, force=True)[1].req == 43  # the session ends: never left to time out
    s.ended(SID)
    assert s.holds == {} and s.pending == {}
