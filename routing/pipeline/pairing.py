"""What an exchange asks of its prefill/decode variant: the ``Pairing`` protocol
(``pair.PdPairing`` implements it; ``exchange.Exchange`` calls it). Generic in the exchange
it is handed, so that this module needs no import of ``exchange`` (which imports it)."""

from __future__ import annotations

from typing import Protocol, TypeVar

from routing.pipeline.legs import Leg

__all__ = ["Pairing"]

ExchangeT_contra = TypeVar("ExchangeT_contra", contravariant=True)  # ``exchange.Exchange``


class Pairing(Protocol[ExchangeT_contra]):
    """The prefill/decode variant of an exchange (``pair.PdPairing``): what the exchange asks
    at each step where a pair differs from one worker."""

    @property
    def pair(self) -> object | None:
        """The pair it holds (None: one worker serves the request, and the relayed body and
        its end are none of the pairing's business: ``relayed`` and ``completed`` are not
        called, which spares each chunk a call)."""
        ...

    def place(self, exchange: ExchangeT_contra) -> bool:
        """Place a pair, or start waiting for one (False: no pair to be had for this
        request: the exchange places it on one worker)."""
        ...

    def holds_errors(self) -> bool:
        """Hold the relayed leg's error reply for ``held_error``, whatever its status?"""
        ...

    def held_error(self, exchange: ExchangeT_contra, raw: bytes) -> bool:
        """A held error reply: True when the pairing dealt with it (a failed handoff re-run),
        False for the exchange to relay it."""
        ...

    def relayed(self, exchange: ExchangeT_contra, pieces: list[bytes], first: bool) -> None:
        """Body pieces of the relayed leg went to the client (``first``: its first ones;
        only while it holds a pair)."""
        ...

    def completed(self, exchange: ExchangeT_contra) -> None:
        """The relayed leg's reply went to the client whole (only while it holds a pair)."""
        ...

    def side_failed(self, leg: Leg, why: str) -> None:
        """A drained leg (a prefill the pair sent besides the relayed one) failed."""
        ...

    def abandon(self) -> None:
        """Drop what the pair has on its way (a wait for room, a drained leg)."""
        ...

    def end(self, exchange: ExchangeT_contra) -> None:
        """The pair is done with (finished, or placed again): free its load and room."""
        ...

    def who(self) -> str:
        """Who did not answer in time."""
        ...
