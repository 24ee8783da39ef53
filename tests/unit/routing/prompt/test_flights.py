"""Tokenizing flights: requests that need a text being tokenized wait for its leader."""

from __future__ import annotations

import asyncio

import pytest

from routing.prompt.flights import TokenizeFlights

KEY = ("a long system prompt", False)


async def test_followers_wake_when_the_leader_leaves_and_not_before() -> None:
    """A follower of a led text waits until the leader leaves its flight; then the text
    has no flight and the next request to need it would lead."""
    flights = TokenizeFlights()
    done = asyncio.Event()
    woke: list[str] = []

    async def leader() -> None:
        with flights.lead(KEY):
            await done.wait()  # the tokenizing, gated

    async def follower(name: str) -> None:
        flight = flights.pending(KEY)
        assert flight is not None
        await asyncio.shield(flight)
        woke.append(name)

    lead = asyncio.create_task(leader())
    await asyncio.sleep(0)  # the leader enters its flight
    followers = [asyncio.create_task(follower(n)) for n in ("b", "c")]
    await asyncio.sleep(0)
    assert woke == [] and flights.pending(KEY) is not None and len(flights) == 1
    assert flights.pending(("another text", False)) is None
    done.set()
    await asyncio.gather(lead, *followers)
    assert sorted(woke) == ["b", "c"] and flights.pending(KEY) is None and len(flights) == 0


async def test_a_failed_leader_still_wakes_its_followers() -> None:
    """A leader that fails (the library raised) wakes its followers: they go on and
    tokenize the text themselves."""
    flights = TokenizeFlights()
    with pytest.raises(ValueError), flights.lead(KEY):
        flight = flights.pending(KEY)
        assert flight is not None
        raise ValueError("tokenizer failed")
    assert flight.done() and flights.pending(KEY) is None


async def test_a_cancelled_follower_does_not_wake_the_others() -> None:
    """One follower cancelled (its client gone, the gateway stopping) leaves the flight,
    and the other followers, waiting for the leader."""
    flights = TokenizeFlights()
    with flights.lead(KEY):
        flight = flights.pending(KEY)
        assert flight is not None

        async def follow() -> None:
            await asyncio.shield(flight)

        gone, stays = asyncio.create_task(follow()), asyncio.create_task(follow())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert gone.cancelled() and not stays.done() and not flight.done()
    await stays
    assert stays.done() and not stays.cancelled()


async def test_one_text_has_one_leader() -> None:
    """Leading a text that already has a leader is a bug in the caller, said at once."""
    flights = TokenizeFlights()
    with flights.lead(KEY), pytest.raises(RuntimeError), flights.lead(KEY):
        pass
