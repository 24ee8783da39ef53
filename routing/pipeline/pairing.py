"""What an exchange asks of its prefill/decode variant: the ``Pairing`` protocol
(``pair.PdPairing`` implements it; ``exchange.Exchange`` calls it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from routing.pipeline.exchange import Exchange
    from routing.pipeline.legs import Leg

__all__ = ["Pairing"]


class Pairing(Protocol):
    """The prefill/decode variant of an exchange (``pair.PdPairing``): what the exchange asks
    at each step where a pair differs from one worker."""

    @property
    def pair(self) -> object | None:
        """The pair it holds (None: one worker serves the request, and the relayed body and
        its end are none of the pairing's business: ``relayed`` and ``completed`` are not
        called, which spares each chunk a call)."""
        ...

    def place(self, exchange: Exchange) -> bool:
        """Place a pair, or start waiting for one (False: no pair to be had for this
        request: the exchange places it on one worker)."""
        ...

    def holds_errors(self) -> bool:
        """Hold the relayed leg's error reply for ``held_error``, whatever its status?"""
        ...

    def held_error(self, exchange: Exchange, raw: bytes) -> bool:
        """A held error reply: True when the pairing dealt with it (a failed handoff re-run),
        False for the exchange to relay it."""
        ...

    def relayed(self, exchange: Exchange, pieces: list[bytes], first: bool) -> None:
        """Body pieces of the relayed leg went to the client (``first``: its first ones;
        only while it holds a pair)."""
        ...

    def completed(self, exchange: Exchange) -> None:
        """The relayed leg's reply went to the client whole (only while it holds a pair)."""
        ...

    def side_failed(self, leg: Leg, why: str) -> None:
        """A drained leg (a prefill the pair sent besides the relayed one) failed."""
        ...

    def abandon(self) -> None:
        """Drop what the pair has on its way (a wait for room, a drained leg)."""
        ...

    def end(self, exchange: Exchange) -> None:
        """The pair is done with (finished, or placed again): free its load and room."""
        ...

    def who(self) -> str:
        """Who did not answer in time."""
        ...
