"""One disaggregated request on its way through a prefill/decode pair (``disagg.py``).

``--pd-mode auto``: one call to the decode worker's sidecar (``POST /v1/kvsidecar/pd/generate``
with the prefill sidecar named in ``extra.kvsidecar_pd``); that sidecar runs the prefill leg,
pulls the blocks and streams the whole answer, first token (the prefill's) included. A reply
``502 kv_transfer_failed`` (nothing was streamed yet) meets the failure policy: ``fail``
passes the error on, ``fallback`` re-runs the request on an aggregated worker.

``--pd-mode sglang``: the same request, with SGLang's bootstrap fields, to both workers'
sidecars (``/v1/kvsidecar/generate``); the prefill answer is drained, the decode answer
streamed to the client.

The client's reply is written as it arrives (chunked); the pair's load is counted in the
router on both workers (prefill released at the first byte) until the request ends.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import structlog

from kvcore.errors import OpenAIError
from routing.pipeline.sidecar_body import tokenized_body
from routing.placement.scorer import Pool

if TYPE_CHECKING:
    from routing.pd.coordinator import PdCoordinator, PdPair
    from routing.prompt.openai_api import OpenAIRequest
    from routing.prompt.preparer import PreparedPrompt
    from routing.serve.http_server import ServerConnection
    from routing.workers.discovery import SidecarWorker

__all__ = ["PD_FIELD", "TRANSFER_FAILED", "PdRequest"]

log = structlog.get_logger("routing.pd.coordinator").bind(component="gateway")

# The sidecar wire protocol (sidecar/disagg.py): the extra field naming the prefill side, and
# the error code of a failed handoff.
PD_FIELD = "kvsidecar_pd"
TRANSFER_FAILED = "kv_transfer_failed"
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default
_TRAILER = b"0\r\n\r\n"
_TRANSFER_FAILED_BYTES = b'"code":"kv_transfer_failed"'
_rng = random.SystemRandom()


class _Reply(Exception):
    """Answer the client with an error and stop."""

    def __init__(self, status: int, message: str, type_: str, headers: bytes = b"") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers


class PdRequest:
    """A client request served by a prefill/decode pair (``InFlight`` for its connection)."""

    def __init__(
        self,
        pd: PdCoordinator,
        client: ServerConnection,
        key: str,
        request_id: bytes,
        label: str,
        parsed: OpenAIRequest,
        prepared: PreparedPrompt,
        t_start: float,
    ) -> None:
        self.pd = pd
        self.gw = pd.gw
        self.client = client
        self.key = key
        self.request_id = request_id
        self.label = label
        self.parsed = parsed
        self.prepared = prepared
        self.t_start = t_start
        self.task: asyncio.Task[None] | None = None
        self.status = 0
        self.events = 0
        self.t_first = 0.0
        self.t_last = 0.0
        self.last_activity = t_start  # the gateway's sweep times out silent requests
        self.writable = asyncio.Event()
        self.writable.set()
        self._loads: dict[str, str] = {}  # router load key → worker id
        self._done = False

    # --- InFlight -------------------------------------------------------------------------

    def on_client_lost(self) -> None:
        if not self._done and self.task is not None:
            self.gw.metrics.client_aborts += 1
            self.task.cancel()

    def on_pause(self) -> None:
        self.writable.clear()

    def on_resume(self) -> None:
        self.writable.set()

    def timed_out(self) -> None:
        """No byte from the pair for ``--upstream-timeout-s`` (the gateway's sweep)."""
        if self._done:
            return
        self.gw.metrics.upstream_timeouts += 1
        if self.status:
            self._finish(504)
            self.client.abort()
        else:
            self._error(504, "the prefill/decode pair did not answer in time", "timeout")
        if self.task is not None:
            self.task.cancel()

    # --- the flow ---------------------------------------------------------------------------

    async def run(self) -> None:
        pair: PdPair | None = None
        try:
            p = self.prepared
            placed = await self.pd.place_pair(list(p.block_hashes), p.prompt_tokens,
                                              self.parsed.max_tokens)
            if isinstance(placed, str):
                raise _Reply(503, placed, "service_unavailable", b"retry-after: 1\r\n")
            pair = placed
            self.pd.metrics.requests += 1
            self._dispatch("p", pair.prefill, pair.prefill_placement)
            self._dispatch("d", pair.decode, pair.decode_placement)
            self.gw.metrics.placement.observe(time.monotonic() - self.t_start)
            if self.pd.mode.value == "sglang":
                await self._native(pair)
            else:
                await self._handoff(pair)
        except _Reply as exc:
            self._error(exc.status, exc.message, exc.type, exc.headers)
        except asyncio.CancelledError:
            self._finish(499)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            if self.status:  # the reply is cut: the client must see the connection end
                self._finish(502)
                self.client.abort()
            else:
                self._error(502, f"worker failed: {exc!r}", "bad_gateway")
        finally:
            self._release_all()
            if pair is not None:
                self.pd.release(pair)

    async def _handoff(self, pair: PdPair) -> None:
        extra = {PD_FIELD: {
            "prefill_url": pair.prefill.sidecar_url,
            "prefill_dp_rank": pair.prefill.dp_rank,
            "transport": self._transport(pair),
            "transfer_timeout_s": self.pd.transfer_timeout_s,
            # Without a fallback nothing waits on the handoff's outcome: the first token is
            # streamed as soon as the prefill has it, a failure ends the stream with an error.
            "early_first_token": self.pd.policy.value == "fail",
        }}
        url = f"{pair.decode.sidecar_url}/v1/kvsidecar/pd/generate"
        body = self._body(pair.decode, extra)
        async with self._post(url, body) as resp:
            if resp.status == 200:
                if await self._relay(resp):
                    self.pd.metrics.completed += 1
                else:  # the handoff failed after the first token was streamed
                    self.pd.metrics.transfer_failures[self.pd.policy.value] += 1
                return
            raw = await resp.read()
            if resp.status != 502 or _error_code(raw) != TRANSFER_FAILED:
                self._relay_error(resp.status, raw)
                return
        message = _error_message(raw)
        self.pd.metrics.transfer_failures[self.pd.policy.value] += 1
        log.warning("kv_transfer_failed", request_id=self.request_id.decode(errors="replace"),
                    prefill=pair.prefill.worker_id, decode=pair.decode.worker_id,
                    policy=self.pd.policy.value, error=message)
        if self.pd.policy.value == "fail":
            self._relay_error(502, raw)
            return
        self._release_all()
        await self._fallback(message)

    async def _fallback(self, why: str) -> None:
        """Re-run the request on an aggregated sidecar worker."""
        pd = self.pd
        candidates = pd.pool("agg")
        p = self.prepared
        placement = self.gw.router.place(list(p.block_hashes), p.prompt_tokens,
                                         [w.worker_id for w in candidates], Pool.AGGREGATED)
        if placement is None:
            pd.metrics.fallbacks["no_worker"] += 1
            raise _Reply(503, f"{why}; no aggregated worker is available to re-run the request",
                         "service_unavailable", b"retry-after: 1\r\n")
        worker = next(w for w in candidates if w.worker_id == placement.worker_id)
        pd.metrics.fallbacks["rerun"] += 1
        self._dispatch("f", worker, placement)
        async with self._post(worker.generate_url, self._body(worker, None)) as resp:
            if resp.status != 200:
                self._relay_error(resp.status, await resp.read())
                return
            await self._relay(resp)

    async def _native(self, pair: PdPair) -> None:
        """SGLang's PD: both workers get the request with one bootstrap room."""
        info = await self.pd.info(pair.prefill)
        extra = {
            "bootstrap_host": info.bootstrap_host or _host(pair.prefill),
            "bootstrap_port": info.bootstrap_port or SGLANG_DEFAULT_BOOTSTRAP_PORT,
            "bootstrap_room": _rng.getrandbits(63),
        }
        prefill = self.gw.spawn(self._drain_prefill(pair.prefill, extra))
        try:
            async with self._post(pair.decode.generate_url, self._body(pair.decode, extra)) as r:
                if r.status != 200:
                    self._relay_error(r.status, await r.read())
                    return
                await self._relay(r)
                self.pd.metrics.completed += 1
        except asyncio.CancelledError:  # the client left: the prefill leg goes too
            prefill.cancel()
            raise

    async def _drain_prefill(self, worker: SidecarWorker, extra: dict[str, Any]) -> None:
        body = self._body(worker, extra, stream=False)
        try:
            async with self._post(worker.generate_url, body) as resp:
                await resp.read()
                if resp.status != 200:
                    log.warning("pd_prefill_failed", worker_id=worker.worker_id,
                                status=resp.status)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("pd_prefill_failed", worker_id=worker.worker_id, error=repr(exc))
        finally:
            self._release("p")

    def _transport(self, pair: PdPair) -> str:
        chosen = self.gw.cfg.kv_transport
        if chosen != "auto":
            return chosen
        return "shm" if _host(pair.prefill) == _host(pair.decode) else "nixl"

    # --- upstream ---------------------------------------------------------------------------

    def _body(self, worker: SidecarWorker, extra: dict[str, Any] | None,
              stream: bool | None = None) -> bytes:
        try:
            raw = tokenized_body(self.parsed, self.prepared.token_ids or [],
                                 self.request_id.decode(), worker.dp_rank)
        except OpenAIError as exc:
            raise _Reply(exc.status, exc.message, exc.type) from exc
        if extra is None and stream is None:
            return raw
        body = orjson.loads(raw)
        if extra:
            body["extra"] = {**body.get("extra", {}), **extra}
        if stream is not None:
            body["stream"] = stream
        return orjson.dumps(body)

    def _post(self, url: str, body: bytes) -> Any:
        session = self.gw._session
        assert session is not None
        timeout = aiohttp.ClientTimeout(total=None, connect=self.gw.cfg.connect_timeout_s,
                                        sock_read=self.gw.cfg.upstream_timeout_s)
        return session.post(url, data=body, timeout=timeout, headers={
            "content-type": "application/json", "x-request-id": self.request_id.decode()})

    async def _relay(self, resp: aiohttp.ClientResponse) -> bool:
        """Stream the worker's 200 reply to the client (chunked); False if the stream carried
        a failed handoff's error event."""
        failed = False
        self.status = 200
        sse = resp.content_type == "text/event-stream"
        head = (b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n"
                b"x-request-id: %s\r\nx-kvsidecar-worker: %s\r\n%s\r\n"
                % (resp.headers.get("content-type", "application/json").encode(),
                   self.request_id, self._worker_header().encode(),
                   b"cache-control: no-cache\r\n" if sse else b""))
        self.client.write(head)
        async for piece in resp.content.iter_any():
            now = self.last_activity = time.monotonic()
            if not self.t_first:
                self.t_first = now
                self.gw.metrics.ttft.observe(now - self.t_start)
                self._release("p")  # the prefill is done once the first token is out
            self.t_last = now
            if sse:
                events = piece.count(b"data:")
                self.events += events
                if events and self._key("d") in self._loads:
                    self.gw.router.load.tokens_generated(self._key("d"), events)
                failed = failed or _TRANSFER_FAILED_BYTES in piece
            await self.writable.wait()
            self.client.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.client.write(_TRAILER)
        self._finish(200)
        self.client.finish()
        return not failed

    def _relay_error(self, status: int, raw: bytes) -> None:
        self._finish(status)
        headers = b"x-request-id: %s\r\n" % self.request_id
        self.client.respond(status, raw, extra_headers=headers)

    def _error(self, status: int, message: str, type_: str, headers: bytes = b"") -> None:
        if self._done:
            return
        self._finish(status)
        extra = b"x-request-id: %s\r\n%s" % (self.request_id, headers)
        self.client.respond(status, OpenAIError(status, message, type_).body(), extra_headers=extra)

    # --- load bookkeeping -----------------------------------------------------------------------

    def _key(self, leg: str) -> str:
        return f"{self.key}/{leg}"

    def _dispatch(self, leg: str, worker: SidecarWorker, placement: Any) -> None:
        p = self.prepared
        self.gw.router.dispatch(self._key(leg), placement, p.block_hashes, p.prompt_tokens)
        self._loads[self._key(leg)] = worker.worker_id
        gw_worker = self.gw.workers.workers.get(worker.worker_id)
        if gw_worker is not None:
            gw_worker.in_flight += 1
            gw_worker.requests += 1

    def _release(self, leg: str) -> None:
        key = self._key(leg)
        worker_id = self._loads.pop(key, None)
        if worker_id is None:
            return
        try:
            self.gw.router.load.finish(key)
        except KeyError:  # the worker left meanwhile and its accounting with it
            pass
        gw_worker = self.gw.workers.workers.get(worker_id)
        if gw_worker is not None:
            gw_worker.in_flight -= 1

    def _release_all(self) -> None:
        for key in list(self._loads):
            self._release(key.rsplit("/", 1)[1])

    def _worker_header(self) -> str:
        return ",".join(self._loads.values())

    def _finish(self, status: int) -> None:
        if self._done:
            return
        self._done = True
        self.gw.exchanges.pop(self.key, None)
        m = self.gw.metrics
        m.count_response(self.label, status)
        m.latency.observe(time.monotonic() - self.t_start)
        if self.events:
            m.completion_tokens += self.events
            if self.events > 1:
                m.itl.observe((self.t_last - self.t_first) / (self.events - 1))


def _host(worker: SidecarWorker) -> str:
    return worker.sidecar_url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]


def _error_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else {}


def _error_code(raw: bytes) -> Any:
    return _error_body(raw).get("code")


def _error_message(raw: bytes) -> str:
    return str(_error_body(raw).get("message") or raw[:200].decode(errors="replace"))
