"""The canary: a prompt of fresh tokens sent to the engine to see its KV events flow.

``SilenceDetector`` (``sidecar.health``) says when one is due: silence is suspected, or the
worker is unroutable and re-checked. ``CanaryLoop`` asks it every tick, sends the canary
through the adapter (``translate_request``: no engine's paths or fields here) with
``max_tokens`` 1, and tells the detector the engine answered, so the canary's blocks must now
show up as stored events. One canary at a time; the detector rate-limits them.

The prompt is ``_CANARY_BLOCKS`` blocks and one token of random ids, so no engine has it
cached and it stores exactly those blocks. The ids come from a low range that every
vocabulary we serve has (the shipped tiny model has 1,024 tokens).
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import structlog

from adapters.base import EngineAdapter
from kvcore.requests import RequestKind, TokenizedRequest
from sidecar.health import SilenceDetector

__all__ = ["CanaryLoop", "canary_request"]

log = structlog.get_logger(component="canary")
_CANARY_BLOCKS = 2
_TOKEN_IDS = range(16, 1000)
_MAX_TICK_S = 1.0


def canary_request(model_id: str, block_size: int, rng: random.Random) -> TokenizedRequest:
    """A completion of ``_CANARY_BLOCKS`` blocks and one token of fresh ids, one token out."""
    tokens = [rng.choice(_TOKEN_IDS) for _ in range(_CANARY_BLOCKS * block_size + 1)]
    return TokenizedRequest(
        request_id=f"kvs-canary-{secrets.token_hex(4)}",
        model=model_id,
        kind=RequestKind.COMPLETION,
        prompt_token_ids=tokens,
        max_tokens=1,
        temperature=0.0,
    )


class CanaryLoop:
    """Sends the detector's canaries to the engine, one at a time, while ``may_send()``."""

    def __init__(
        self,
        detector: SilenceDetector,
        adapter: EngineAdapter,
        session: aiohttp.ClientSession,
        *,
        engine_url: str,
        model_id: str,
        block_size: int,
        timeout_s: float,
        may_send: Callable[[], bool],
    ) -> None:
        self._detector = detector
        self._adapter = adapter
        self._session = session
        self._engine_url = engine_url.rstrip("/")
        self._model_id = model_id
        self._block_size = block_size
        self._timeout_s = timeout_s
        self._may_send = may_send
        self._rng = random.Random(secrets.randbits(64))
        self.tick_s = min(detector.silent_after_s / 4, _MAX_TICK_S)

    async def run(self) -> None:
        """Check the detector every tick, send the canaries it asks for; until cancelled."""
        routable = True
        while True:
            await asyncio.sleep(self.tick_s)
            detector = self._detector
            detector.check()
            health = detector.health()
            if health.routable != routable:
                routable = health.routable
                if routable:
                    log.info("kv_events_resumed")
                else:
                    log.warning("kv_events_silent", reason=health.reason)
            if detector.canary_due() and self._may_send():
                await self.send()

    async def send(self) -> bool:
        """Send one canary; whether the engine answered it."""
        request = canary_request(self._model_id, self._block_size, self._rng)
        rid = request.request_id
        self._detector.canary_sent()
        try:
            native = self._adapter.translate_request(request)
            status, head = await self._post(native.path, native.body, rid)
        except (ValueError, aiohttp.ClientError, TimeoutError) as exc:
            status, head = None, repr(exc)
        if status != 200:
            self._detector.canary_failed()
            log.warning("canary_failed", request_id=rid, status=status, error=head)
            return False
        self._detector.canary_answered()
        log.info("canary_answered", request_id=rid, prompt_tokens=len(request.prompt_token_ids))
        return True

    async def _post(self, path: str, body: dict[str, Any], rid: str) -> tuple[int, str]:
        async with asyncio.timeout(self._timeout_s):
            async with self._session.post(
                self._engine_url + path,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json", "x-request-id": rid},
            ) as resp:
                raw = await resp.read()
                return resp.status, raw[:200].decode(errors="replace")
