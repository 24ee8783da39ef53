"""A request a prefill/decode pair may serve: ``PairExchange``, the exchange with a pair's
placement and legs.

    place ─┬─ no pair to be had (PD off, not tokenized, a pool empty): as any exchange
           ├─ --pd-mode auto: one leg to the decode sidecar, which drives the prefill
           │    └ its reply is kv_transfer_failed → counted; fallback: re-run aggregated
           └─ --pd-mode sglang: a drained prefill leg and a relayed decode leg, one room

The pair's load is counted on both workers: the prefill worker's until the first token is
out (auto) or its leg answers (sglang), the decode worker's until the end. Its decode room
(``PdCoordinator``) is held until the end. When the decode pool is full the request waits
for room in a task (the only one it may have), bounded by ``--pd-queue-timeout-s``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import structlog

from kvcore.requests import TRANSFER_FAILED
from routing.pd.coordinator import FailurePolicy, PdCoordinator, PdMode, PdPair
from routing.pipeline.exchange import Exchange
from routing.pipeline.legs import Drain, Leg
from routing.pipeline.place import place_rerun
from routing.placement.refusal import Refusal

__all__ = ["PairExchange"]

log = structlog.get_logger("routing.pipeline", component="gateway")

_TRANSFER_FAILED_BYTES = b'"code":"%s"' % TRANSFER_FAILED.encode()


class PairExchange(Exchange):
    """An exchange whose request goes to a prefill/decode pair when the fleet has both."""

    __slots__ = ("_transfer_failed", "_waiting", "pair", "side")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pair: PdPair | None = None
        self.side: Leg | None = None  # the drained prefill leg of --pd-mode sglang
        self._transfer_failed = False
        self._waiting: asyncio.Task[None] | None = None

    @property
    def pd(self) -> PdCoordinator:
        pd = self.ctx.pd
        assert pd is not None  # a PairExchange is made only where the gateway has one
        return pd

    def _place(self) -> None:
        self._transfer_failed = False
        if (not self.target.token_path or self.target.continuation is not None
                or not self.pd.takes(self.prompt)):
            # The pair's legs speak token ids only; a migrated stream resumes on one worker.
            self._place_aggregated()
            return
        placed = self.pd.place(self.prompt, self.request.max_tokens)
        if isinstance(placed, Refusal) and placed.busy:  # the decode pool is full: wait
            self._waiting = self.ctx.spawn(self._wait_for_pair())
            return
        self._pair_placed(placed)

    async def _wait_for_pair(self) -> None:
        placed = await self.pd.place_waiting(self.prompt, self.request.max_tokens)
        self._waiting = None
        if not self.done:
            self._pair_placed(placed)
        elif isinstance(placed, PdPair):
            self.pd.release(placed)

    def _pair_placed(self, placed: PdPair | Refusal) -> None:
        pd = self.pd
        self._placed()
        if isinstance(placed, Refusal):
            self._refuse(placed)
            return
        self.pair = pair = placed
        pd.metrics.requests += 1
        record = self.record
        record.placement = pair.prefill_placement  # the prefill worker serves the prompt
        record.worker_ids = (pair.prefill.worker_id, pair.decode.worker_id)
        if pd.mode is PdMode.AUTO:
            # The decode sidecar drives the prefill leg: the prefill worker's load is ours to
            # count until the first token is out.
            self._count(Leg(pair.prefill, pair.prefill_placement, record.key + "/p"))
            decode = self.target.for_worker(pair.decode, handoff=pd.handoff(pair))
            self._run_leg(pair.decode, pair.decode_placement, "d", decode)
            return
        legs = pd.bootstrap(pair)
        if isinstance(legs, Refusal):
            self._refuse(legs)
            return
        side = self.side = Leg(pair.prefill, pair.prefill_placement, record.key + "/p")
        side.request = self.target.for_worker(pair.prefill, bootstrap=legs[0], stream=False)
        self._dispatch(side, Drain(self, side))
        decode = self.target.for_worker(pair.decode, bootstrap=legs[1])
        self._run_leg(pair.decode, pair.decode_placement, "d", decode)

    # --- the hooks ---------------------------------------------------------------------------

    def _holds_errors(self) -> bool:
        return self.pair is not None and self.pd.mode is PdMode.AUTO

    def _held_error(self, raw: bytes) -> None:
        """The decode sidecar answered an error: relay it, or re-run a failed handoff."""
        pd, pair, status = self.pd, self.pair, self.record.status
        if pair is None or not self._holds_errors():  # served alone: as any error
            self._relay_error(raw)
            return
        error = _error_of(raw)
        if status != 502 or error.get("code") != TRANSFER_FAILED:
            self._relay_error(raw)
            return
        message = str(error.get("message") or raw[:200].decode(errors="replace"))
        pd.metrics.transfer_failures[pd.policy.value] += 1
        log.warning("kv_transfer_failed",
                    request_id=self.record.request_id.decode(errors="replace"),
                    prefill=pair.prefill.worker_id, decode=pair.decode.worker_id,
                    policy=pd.policy.value, error=message)
        if pd.policy is FailurePolicy.FAIL:
            self._relay_error(raw)
            return
        self._release(self.leg)
        self._end_pair()
        placed = place_rerun(self.ctx, self.prompt, message)
        if isinstance(placed, Refusal):
            pd.metrics.fallbacks["no_worker"] += 1
            self._refuse(placed)
            return
        pd.metrics.fallbacks["rerun"] += 1
        worker, placement = placed
        self.record.placement, self.record.worker_ids = placement, (worker.worker_id,)
        self.record.status = 0
        self._run_leg(worker, placement, "f")

    def upstream_body(self, pieces: list[bytes]) -> None:
        first = not self.record.t_first
        super().upstream_body(pieces)
        if self.pair is None or self._error_parts is not None:
            return
        if first and self.side is None:
            self._release_prefill()  # the prefill is done once the first token is out
        if not self._transfer_failed and self.relay.sse:
            self._transfer_failed = any(_TRANSFER_FAILED_BYTES in p for p in pieces)

    def upstream_complete(self) -> None:
        pair, relayed = self.pair, self._error_parts is None
        super().upstream_complete()
        if pair is None or not relayed:
            return
        if self._transfer_failed:  # after the first token: the stream carried the error
            self.pd.metrics.transfer_failures[self.pd.policy.value] += 1
        elif self.record.status == 200:
            self.pd.metrics.completed += 1

    def _finish(self, status: int) -> None:
        self._end_pair()
        super()._finish(status)

    def _side_failed(self, leg: Leg, why: str) -> None:
        log.warning("pd_prefill_failed", worker_id=leg.worker.worker_id, error=why)

    def _abandon(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None
        if self.side is not None:
            self.side.abandon()
        super()._abandon()

    def _end_pair(self) -> None:
        """The pair is done with (finished, or being re-run): free its load and room."""
        pair, self.pair = self.pair, None
        if pair is None:
            return
        self._release_prefill()
        side, self.side = self.side, None
        if side is not None:
            side.abandon()
            self._release(side)
        self.pd.release(pair)

    def _release_prefill(self) -> None:
        self.ctx.router.load.finish_if_known(self.record.key + "/p")

    def _who(self) -> str:
        return "the worker" if self.pair is None else "the prefill/decode pair"


def _error_of(raw: bytes) -> dict[str, object]:
    """The ``error`` object of an OpenAI-shaped error body ({} if there is none)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else {}
