"""How a prefill/decode pair serves a request: ``PdPairing``, the exchange's ``Pairing``.

    place ─┬─ no pair to be had (not tokenized, a migrated stream, a pool empty): one worker
           ├─ --pd-mode auto: one leg to the decode sidecar, which drives the prefill
           │    └ its reply is kv_transfer_failed → counted; fallback: re-run aggregated
           └─ --pd-mode sglang: a drained prefill leg and a relayed decode leg, one room

The exchange (``exchange.Exchange``) asks its pairing at each step where a pair differs
from one worker; the pairing keeps what the pair holds and acts through the exchange's
steps (``run_leg``, ``dispatch``, ``refuse`` ...).

The pair's load is counted on both workers: the prefill worker's until the first token is
out (auto) or its leg answers (sglang), the decode worker's until the end. Its decode room
(``PdCoordinator``) is held until the end. When the decode pool is full the request waits
for room in a task (the only one it may have), bounded by ``--pd-queue-timeout-s``.
"""

from __future__ import annotations

import asyncio

import orjson
import structlog

from kvcore.requests import TRANSFER_FAILED
from routing.pd.coordinator import FailurePolicy, PdCoordinator, PdMode, PdPair
from routing.pipeline.exchange import Exchange
from routing.pipeline.legs import Drain, Leg
from routing.pipeline.place import place_rerun
from routing.placement.refusal import Refusal

__all__ = ["PdPairing"]

log = structlog.get_logger("routing.pipeline", component="gateway")

_TRANSFER_FAILED_BYTES = b'"code":"%s"' % TRANSFER_FAILED.encode()


class PdPairing:
    """One request's prefill/decode variant: the pair it holds, if any, and its steps."""

    __slots__ = ("_transfer_failed", "_waiting", "pair", "pd", "side")

    def __init__(self, pd: PdCoordinator) -> None:
        self.pd = pd
        self.pair: PdPair | None = None
        self.side: Leg | None = None  # the drained prefill leg of --pd-mode sglang
        self._transfer_failed = False
        self._waiting: asyncio.Task[None] | None = None

    # --- place ---------------------------------------------------------------------------

    def place(self, exchange: Exchange) -> bool:
        self._transfer_failed = False
        target = exchange.target
        if (not target.token_path or target.continuation is not None
                or not self.pd.takes(exchange.prompt)):
            # The pair's legs speak token ids only; a migrated stream resumes on one worker.
            return False
        placed = self.pd.place(exchange.prompt, exchange.request.max_tokens)
        if isinstance(placed, Refusal) and placed.busy:  # the decode pool is full: wait
            self._waiting = exchange.ctx.spawn(self._wait_for_pair(exchange))
            return True
        self._placed(exchange, placed)
        return True

    async def _wait_for_pair(self, exchange: Exchange) -> None:
        placed = await self.pd.place_waiting(exchange.prompt, exchange.request.max_tokens)
        self._waiting = None
        if not exchange.done:
            self._placed(exchange, placed)
        elif isinstance(placed, PdPair):
            self.pd.release(placed)

    def _placed(self, exchange: Exchange, placed: PdPair | Refusal) -> None:
        pd = self.pd
        exchange.observe_placement()
        if isinstance(placed, Refusal):
            exchange.refuse(placed)
            return
        self.pair = pair = placed
        pd.metrics.requests += 1
        record, target = exchange.record, exchange.target
        record.placement = pair.prefill_placement  # the prefill worker serves the prompt
        record.worker_ids = (pair.prefill.worker_id, pair.decode.worker_id)
        if pd.mode is PdMode.AUTO:
            # The decode sidecar drives the prefill leg: the prefill worker's load is ours to
            # count until the first token is out.
            exchange.count(Leg(pair.prefill, pair.prefill_placement, record.key + "/p"))
            decode = target.for_worker(pair.decode, handoff=pd.handoff(pair))
            exchange.run_leg(pair.decode, pair.decode_placement, "d", decode)
            return
        legs = pd.bootstrap(pair)
        if isinstance(legs, Refusal):
            exchange.refuse(legs)
            return
        side = self.side = Leg(pair.prefill, pair.prefill_placement, record.key + "/p")
        side.request = target.for_worker(pair.prefill, bootstrap=legs[0], stream=False)
        exchange.dispatch(side, Drain(exchange, side))
        decode = target.for_worker(pair.decode, bootstrap=legs[1])
        exchange.run_leg(pair.decode, pair.decode_placement, "d", decode)

    # --- the relayed leg's reply ---------------------------------------------------------

    def holds_errors(self) -> bool:
        return self.pair is not None and self.pd.mode is PdMode.AUTO

    def held_error(self, exchange: Exchange, raw: bytes) -> bool:
        """The decode sidecar answered an error: a failed handoff is re-run (True), or
        relayed like any other error (False)."""
        pd, pair, record = self.pd, self.pair, exchange.record
        if pair is None or not self.holds_errors():  # served alone: as any error
            return False
        error = _error_of(raw)
        if record.status != 502 or error.get("code") != TRANSFER_FAILED:
            return False
        message = str(error.get("message") or raw[:200].decode(errors="replace"))
        pd.metrics.transfer_failures[pd.policy.value] += 1
        log.warning("kv_transfer_failed",
                    request_id=record.request_id.decode(errors="replace"),
                    prefill=pair.prefill.worker_id, decode=pair.decode.worker_id,
                    policy=pd.policy.value, error=message)
        if pd.policy is FailurePolicy.FAIL:
            return False
        exchange.release(exchange.leg)
        self.end(exchange)
        placed = place_rerun(exchange.ctx, exchange.prompt, message)
        if isinstance(placed, Refusal):
            pd.metrics.fallbacks["no_worker"] += 1
            exchange.refuse(placed)
            return True
        pd.metrics.fallbacks["rerun"] += 1
        worker, placement = placed
        record.placement, record.worker_ids = placement, (worker.worker_id,)
        record.status = 0
        exchange.run_leg(worker, placement, "f")
        return True

    def relayed(self, exchange: Exchange, pieces: list[bytes], first: bool) -> None:
        if first and self.side is None:
            self._release_prefill(exchange)  # the prefill is done once the first token is out
        if not self._transfer_failed and exchange.relay.sse:
            self._transfer_failed = any(_TRANSFER_FAILED_BYTES in p for p in pieces)

    def completed(self, exchange: Exchange) -> None:
        if self._transfer_failed:  # after the first token: the stream carried the error
            self.pd.metrics.transfer_failures[self.pd.policy.value] += 1
        elif exchange.record.status == 200:
            self.pd.metrics.completed += 1

    def side_failed(self, leg: Leg, why: str) -> None:
        log.warning("pd_prefill_failed", worker_id=leg.worker.worker_id, error=why)

    # --- endings -------------------------------------------------------------------------

    def abandon(self) -> None:
        if self._waiting is not None:
            self._waiting.cancel()
            self._waiting = None
        if self.side is not None:
            self.side.abandon()

    def end(self, exchange: Exchange) -> None:
        pair, self.pair = self.pair, None
        if pair is None:
            return
        self._release_prefill(exchange)
        side, self.side = self.side, None
        if side is not None:
            side.abandon()
            exchange.release(side)
        self.pd.release(pair)

    def _release_prefill(self, exchange: Exchange) -> None:
        exchange.ctx.router.load.finish_if_known(exchange.record.key + "/p")

    def who(self) -> str:
        return "the worker" if self.pair is None else "the prefill/decode pair"


def _error_of(raw: bytes) -> dict[str, object]:
    """The ``error`` object of an OpenAI-shaped error body ({} if there is none)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else {}
