"""``StreamTokens``: whole events only, id comments out, and what a migration needs."""

from __future__ import annotations

from routing.pipeline.stream_tokens import StreamTokens

E1 = b'data: {"id":"c","created":1700000000,"choices":[{"text":"a","finish_reason":null}]}\n\n'
E2 = b'data: {"id":"c","created":1700000000,"choices":[{"text":"b","finish_reason":null}]}\n\n'
END = b'data: {"id":"c","created":1700000000,"choices":[{"text":"","finish_reason":"length"}]}\n\n'


def test_whole_events_pass_without_their_comments() -> None:
    t = StreamTokens()
    assert t.feed([b": kvs-ids 5,6\n" + E1]) == E1
    assert t.ids == [5, 6] and t.events == 1 and t.created == 1700000000
    assert t.resumable and not t.finished


def test_a_half_event_waits_for_its_end() -> None:
    """A worker that dies mid-event leaves nothing half-written with the client."""
    t = StreamTokens()
    whole = b": kvs-ids 1\n" + E1 + b": kvs-ids 2\n" + E2
    cut = len(whole) - 10
    assert t.feed([whole[:5], whole[5:cut]]) == E1
    assert t.ids == [1] and t.tail
    assert t.feed([whole[cut:]]) == E2
    assert t.ids == [1, 2] and not t.tail


def test_events_without_ids_are_not_resumable_until_the_finish() -> None:
    t = StreamTokens()
    t.feed([E1])
    assert not t.resumable
    t = StreamTokens()
    t.feed([b": kvs-ids 3\n" + E1, END + b"data: [DONE]\n\n"])
    assert t.finished and t.resumable and t.events == 3


def test_ids_alone_are_kept_and_other_comments_pass() -> None:
    t = StreamTokens()
    assert t.feed([b": kvs-ids 9\n\n", b": keep-alive\n\n"]) == b": keep-alive\n\n"
    assert t.ids == [9] and t.events == 0
