"""Admission control's parts: what makes a worker busy, the waiting queue's order and
deadlines, the priority header, and session affinity's TTL and bound."""

from __future__ import annotations

import pytest

from kvcore.stream import EngineLoad
from routing.pipeline.admission import AdmissionQueue, Admit, Busy, parse_priority
from routing.placement.active_load import ActiveLoad
from routing.placement.sessions import SessionAffinity
from routing.vocabulary import QueueOrder
from tests.support.polling import wait_for


def test_each_threshold_makes_a_worker_busy() -> None:
    load = ActiveLoad(block_size=16)
    load.set_capacity("a", 100)
    load.set_capacity("b", 100)
    load.add("r1", "a", list(range(60)), prompt_tokens=960)  # 60 blocks, 960 to prefill
    load.add("r2", "b", list(range(1000, 1010)), prompt_tokens=160)
    assert Busy(max_in_flight=1).of(load, ["a", "b", "c"]) == ["a", "b"]
    assert Busy(max_in_flight=2).of(load, ["a", "b"]) == []
    assert Busy(kv_fraction=0.5).of(load, ["a", "b", "c"]) == ["a"]  # c reports no capacity
    assert Busy(prefill_tokens=500).of(load, ["a", "b"]) == ["a"]
    load.first_token("r1")  # prefilled: its tokens no longer wait
    assert Busy(prefill_tokens=500).of(load, ["a", "b"]) == []
    # The engine's own report counts what other clients put there.
    load.set_engine_load("b", EngineLoad(running=1, queued=3, kv_used_tokens=16 * 90,
                                         kv_capacity_tokens=1600, queued_prefill_tokens=4000))
    assert Busy(kv_fraction=0.8).of(load, ["a", "b"]) == ["b"]
    assert Busy(prefill_tokens=500).of(load, ["a", "b"]) == ["b"]
    assert not Busy().any and Busy(prefill_tokens=1).any
    with pytest.raises(ValueError, match="busy-kv-fraction"):
        Busy(kv_fraction=1.5)


def test_priority_header() -> None:
    assert parse_priority(None) == 0 and parse_priority(b"-7") == -7
    for bad in (b"high", b"1.5", b"100000"):
        with pytest.raises(ValueError, match="x-kvsidecar-priority"):
            parse_priority(bad)


class _Waiter:
    """``room``: a worker it may go to is free; ``holder_busy``: a busy one holds its prefix."""

    def __init__(self, name: str, priority: int, log: list[str], tenant: str = "",
                 cost: int = 100, weight: float = 1.0, holder_busy: bool = False) -> None:
        self.name, self.priority, self.done, self.log = name, priority, False, log
        self.tenant, self.cost, self.weight = tenant, cost, weight
        self.room = False
        self.holder_busy = holder_busy
        self.tries = 0

    def admit_waiting(self, keep_prefix: bool = False) -> Admit:
        self.tries += 1
        if not self.room:
            return Admit.BUSY
        if keep_prefix and self.holder_busy:
            return Admit.ELSEWHERE
        self.done = True
        self.log.append(self.name)
        return Admit.PLACED

    def wait_expired(self, waited_s: float) -> None:
        self.done = True
        self.log.append(f"{self.name} expired")

    def wait_shed(self, tenant_ahead: str) -> None:
        self.done = True
        self.log.append(f"{self.name} shed for {tenant_ahead}")


async def test_the_queue_admits_by_priority_then_arrival_and_expires_the_rest() -> None:
    log: list[str] = []
    now = [0.0]  # the queue's clock: nothing expires before the test says, however slow it runs
    queue = AdmissionQueue(timeout_s=0.3, max_waiting=3, clock=lambda: now[0])
    waiters = [_Waiter("a", 0, log), _Waiter("b", 2, log), _Waiter("c", 0, log)]
    assert all(queue.offer(w) for w in waiters)
    assert not queue.offer(_Waiter("d", -1, log)) and queue.num_full == 1  # ranks last
    queue.wake()
    await wait_for(lambda: waiters[1].tries, "a pass over the queue")  # its head: priority 2
    assert log == [] and len(queue) == 3  # every worker still busy: nobody admitted
    waiters[1].room = waiters[0].room = True  # room for two: b (priority 2), then a
    queue.wake()
    await wait_for(lambda: len(queue) == 1, "two admitted")
    assert log == ["b", "a"]
    now[0] = 0.3
    await wait_for(lambda: not len(queue), "c to expire")
    assert log == ["b", "a", "c expired"] and queue.num_expired == 1
    assert (queue.num_queued, queue.num_admitted) == (3, 2)
    queue.close()


async def test_a_gone_client_leaves_the_queue_unanswered() -> None:
    log: list[str] = []
    queue = AdmissionQueue(timeout_s=30, max_waiting=2)
    gone = _Waiter("gone", 0, log)
    assert queue.offer(gone)
    gone.done = True  # its client went away (answered 499 by the exchange)
    queue.wake()
    await wait_for(lambda: not len(queue), "the gone request dropped")
    assert log == [] and queue.num_admitted == 0
    queue.close()


async def test_a_flooding_tenant_waits_behind_its_own_requests() -> None:
    """Within a priority, each tenant's requests are tagged by its tokens served and
    queued, over its weight: a quiet tenant's request passes the flood's backlog."""
    log: list[str] = []
    queue = AdmissionQueue(timeout_s=30, max_waiting=16)
    flood = [_Waiter(f"f{i}", 0, log, tenant="flood") for i in range(6)]
    quiet = [_Waiter("q0", 0, log, tenant="quiet"), _Waiter("q1", 0, log, tenant="quiet")]
    heavy = _Waiter("h0", 0, log, tenant="heavy", weight=2.0, cost=200)  # = 100 of weight 1
    urgent = _Waiter("u", 5, log, tenant="flood")
    for w in (*flood, quiet[0], heavy, quiet[1], urgent):
        assert queue.offer(w)
    for w in (*flood, *quiet, heavy, urgent):
        w.room = True
    queue.wake()
    await wait_for(lambda: not len(queue), "every request admitted")
    # The priority band first; then by start tag (flood: 0, 100, 200 ...; quiet: 0, 100;
    # heavy: 0), ties in arrival order.
    assert log == ["u", "f0", "q0", "h0", "f1", "q1", "f2", "f3", "f4", "f5"]
    queue.close()


async def test_first_come_first_served_ignores_tenants() -> None:
    log: list[str] = []
    queue = AdmissionQueue(timeout_s=30, max_waiting=16, order=QueueOrder.FCFS)
    waiters = [_Waiter("f0", 0, log, "flood"), _Waiter("f1", 0, log, "flood"),
               _Waiter("q0", 0, log, "quiet")]
    for w in waiters:
        assert queue.offer(w)
        w.room = True
    queue.wake()
    await wait_for(lambda: not len(queue), "every request admitted")
    assert log == ["f0", "f1", "q0"]
    queue.close()


async def test_a_full_queue_sheds_the_request_ranking_last() -> None:
    """A newcomer ranking ahead of the full queue's last takes its place; the shed one is
    answered (429 fair_share) and its tenant's charge for it given back."""
    log: list[str] = []
    queue = AdmissionQueue(timeout_s=30, max_waiting=3)
    for i in range(3):
        assert queue.offer(_Waiter(f"f{i}", 0, log, "flood"))
    assert queue.offer(_Waiter("q0", 0, log, "quiet"))  # start 0 < f2's 200: f2 is shed
    assert log == ["f2 shed for quiet"] and queue.num_shed == 1 and len(queue) == 3
    assert not queue.offer(_Waiter("f3", 0, log, "flood"))  # start 200: ranks last
    assert queue.num_full == 1
    queue.close()
    fcfs = AdmissionQueue(timeout_s=30, max_waiting=1, order=QueueOrder.FCFS)
    assert fcfs.offer(_Waiter("a", 0, log)) and not fcfs.offer(_Waiter("b", 0, log, "x"))
    fcfs.close()


async def test_a_freed_slot_goes_to_a_request_whose_prefix_it_holds() -> None:
    """With look-ahead, a request behind the head whose prefix a free worker holds goes
    first while a busy worker holds the head's; the head is passed over at most
    ``lookahead`` times, then placed where there is room; a request waiting for its holder
    when nothing behind it fits is placed at once (no free slot stays idle)."""
    log: list[str] = []
    queue = AdmissionQueue(timeout_s=30, max_waiting=16, lookahead=2)
    head = _Waiter("head", 0, log, holder_busy=True)
    waiters = [head, _Waiter("b", 0, log, holder_busy=True), _Waiter("c", 0, log),
               _Waiter("d", 0, log), _Waiter("e", 0, log)]
    for w in waiters:
        assert queue.offer(w)
        w.room = True
    queue.wake()
    await wait_for(lambda: not len(queue), "every request admitted")
    # c, then d (each within two behind the head) fit; the head, passed over twice, goes
    # next; b, now the head, waits for its holder while e goes, then goes itself: nothing
    # is left behind it.
    assert log == ["c", "d", "head", "e", "b"]
    assert queue.num_for_prefix == 3 and queue.num_admitted == 5
    queue.close()


async def test_look_ahead_keeps_priority_bands_and_stops_when_all_are_busy() -> None:
    """A lower band never goes before the head; every worker busy: nobody is tried behind it."""
    log: list[str] = []
    queue = AdmissionQueue(timeout_s=30, max_waiting=16, lookahead=4)
    urgent = _Waiter("urgent", 5, log, holder_busy=True)
    low = _Waiter("low", 0, log)
    assert queue.offer(urgent) and queue.offer(low)
    queue.wake()
    await wait_for(lambda: urgent.tries, "a pass over the queue")
    assert low.tries == 0 and log == []  # no room anywhere
    urgent.room = low.room = True
    queue.wake()
    await wait_for(lambda: not len(queue), "both admitted")
    assert log == ["urgent", "low"] and queue.num_for_prefix == 0
    queue.close()


def test_sessions_expire_and_stay_bounded() -> None:
    sessions = SessionAffinity(ttl_s=10, max_sessions=2)
    sessions.placed(b"s1", "w1", now=0)
    sessions.placed(b"s2", "w2", now=1)
    assert sessions.worker_of(b"s1", now=5) == "w1"
    sessions.placed(b"s1", "w1", now=5)  # placed there again: the most recent now
    sessions.placed(b"s3", "w1", now=6)  # past the bound: the least recent (s2) goes
    assert sessions.worker_of(b"s2", now=6) is None and len(sessions) == 2
    assert sessions.worker_of(b"s1", now=16) is None  # past the TTL
