"""Hash parity: are the gateway's block hashes the engine's?

Placement by prefix is only as good as the gateway hashing what the engine caches: the same
chat template, the same tokenizer, the same page size and namespace. Each sidecar worker is
checked when it joins and every ``--parity-interval-s``:

* **the canary**: a multi-turn conversation (system, user, assistant, user, non-ASCII text)
  rendered and tokenized by the gateway, and by the engine (through its sidecar,
  ``POST /v1/kvsidecar/tokenize``: SGLang's ``/v1/tokenize``); the token ids must be equal;
* **the engines' reports**: the cached tokens the engine reported in usage since the last
  check, against what the gateway predicted at placement; far fewer means its blocks are
  not what the gateway thinks;
* **the stream**: a page size or model that does not match is refused by the event feed, and
  the worker is placed by load alone.

Each worker is ``exact``, ``degraded`` (it is routed, but cache predictions are wrong),
``falling_back`` (placed by load only) or ``unverified``, with the reason, in ``/v1/workers``
and ``/metrics``. A worker that turns degraded or falls back is logged loudly (an error), at
start-up as later: never a silent fall back to load balancing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import structlog

from kvcore.errors import OpenAIError
from routing.metrics import GatewayMetrics
from routing.prompt.openai_api import Endpoint, parse_request
from routing.prompt.preparer import PromptPreparer
from routing.workers.registry import Parity, Worker, WorkerKind, WorkerRegistry

__all__ = ["CANARY", "Parity", "ParityChecker", "first_difference"]

log = structlog.get_logger("routing.workers", component="parity")

# The conversation every worker is checked with: every role, a turn the assistant took,
# accents and an emoji (byte-level merges), spaces and a newline at turn edges.
CANARY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a careful assistant. Réponds brièvement."},
    {"role": "user", "content": "What is 17 × 23?\n"},
    {"role": "assistant", "content": " 17 × 23 = 391 🙂"},
    {"role": "user", "content": "And  the square root of 391, to two places?"},
]
# Under this share of the predicted cached tokens, the engine does not cache what the gateway
# hashes; judged once enough were predicted to tell.
_REPORTED_SHARE_MIN = 0.5
_PREDICTED_MIN_TOKENS = 2048


_Problem = tuple[Parity, str]


def first_difference(ours: list[int], theirs: list[int]) -> str | None:
    """Where two token lists first differ, in words (None: they are equal)."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return f"token {i}: gateway {a}, engine {b}"
    if len(ours) != len(theirs):
        return f"gateway {len(ours)} tokens, engine {len(theirs)}"
    return None


class ParityChecker:
    """Checks each sidecar worker's hash parity and keeps its verdict in the registry."""

    def __init__(
        self,
        registry: WorkerRegistry,
        prompts: PromptPreparer,
        metrics: GatewayMetrics,
        session: aiohttp.ClientSession,
        *,
        model_id: str,
        timeout_s: float = 10.0,
    ) -> None:
        self.registry = registry
        self.prompts = prompts
        self.metrics = metrics
        self.model_id = model_id
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._canary: list[int] | None = None
        self._canary_error: str | None = None
        self._reports: dict[str, tuple[int, int]] = {}  # worker → (predicted, reported) seen

    async def run(self, interval_s: float) -> None:
        """Check every worker, then again every ``interval_s``, until cancelled (a worker
        whose stream comes up is checked at once: ``registry.check_parity``)."""
        while True:
            await self.check_all()
            await asyncio.sleep(interval_s)

    async def check_all(self) -> None:
        checked: dict[str, _Problem | None] = {}  # sidecar URL → the canary's verdict
        for worker in list(self.registry):
            await self.check(worker, checked)

    async def check(
        self, worker: Worker, checked: dict[str, _Problem | None] | None = None
    ) -> None:
        """Judge one worker (``checked``: canary verdicts of sidecars already asked)."""
        if worker.kind is WorkerKind.PLAIN:
            self._verdict(worker, Parity.UNVERIFIED,
                          "a plain engine publishes no KV events: placed by recent routing")
            return
        if worker.mismatch is not None:
            self._verdict(worker, Parity.FALLING_BACK, worker.mismatch)
            return
        canary = self._gateway_canary()
        if canary is None:
            self._verdict(worker, Parity.UNVERIFIED, self._canary_error or "")
            return
        url = worker.address.url
        if checked is not None and url in checked:
            problem = checked[url]
        else:
            problem = await self._engine_disagrees(url, canary)
            if checked is not None:
                checked[url] = problem
        if problem is not None:
            self._verdict(worker, *problem)
            return
        short = self._reports_short(worker.worker_id)
        if short is not None:
            self._verdict(worker, Parity.DEGRADED, short)
            return
        self._verdict(worker, Parity.EXACT, "")

    # --- the canary --------------------------------------------------------------------------

    def _gateway_canary(self) -> list[int] | None:
        """The canary as the gateway tokenizes it (None: it does not tokenize)."""
        if self._canary is None and self._canary_error is None:
            if self.prompts.tokenizer is None:
                self._canary_error = ("the gateway hashes pseudo-tokens (no --model-path): "
                                      "predictions are by shared text, not the engine's blocks")
            else:
                body = orjson.dumps({"model": self.model_id, "messages": CANARY})
                try:
                    prepared = self.prompts.prepare(parse_request(Endpoint.CHAT, body))
                    self._canary = prepared.token_ids
                except OpenAIError as exc:
                    self._canary_error = f"the gateway cannot render the canary: {exc.message}"
        return self._canary

    async def _engine_disagrees(self, sidecar_url: str, canary: list[int]) -> _Problem | None:
        """Why the engine's canary differs, or why it could not be asked (None: it agrees)."""
        try:
            async with self._session.post(
                f"{sidecar_url}/v1/kvsidecar/tokenize", data=orjson.dumps({"messages": CANARY}),
                timeout=self._timeout, headers={"content-type": "application/json"},
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    why = raw[:160].decode(errors="replace")
                    return Parity.UNVERIFIED, (
                        f"the engine could not tokenize ({resp.status}: {why})")
            tokens = orjson.loads(raw)["tokens"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            return Parity.UNVERIFIED, f"the sidecar did not answer the canary ({exc!r})"
        where = first_difference(canary, tokens)
        if where is None:
            return None
        return Parity.DEGRADED, (
            "template mismatch: the gateway's chat template and tokenizer do not give the "
            f"engine's token ids ({where}); its cached blocks are not the ones predicted")

    # --- the engines' reports ----------------------------------------------------------------

    def _reports_short(self, worker_id: str) -> str | None:
        """Whether the engine reported far fewer cached tokens than predicted since the last
        check (salt, LoRA or template not applied on its side)."""
        m = self.metrics
        predicted = m.worker_predicted_cached_tokens.get(worker_id, 0)
        reported = m.worker_actual_cached_tokens.get(worker_id, 0)
        last_predicted, last_reported = self._reports.get(worker_id, (0, 0))
        self._reports[worker_id] = (predicted, reported)
        new_predicted, new_reported = predicted - last_predicted, reported - last_reported
        if new_predicted < _PREDICTED_MIN_TOKENS:
            return None
        if new_reported >= _REPORTED_SHARE_MIN * new_predicted:
            return None
        return (f"the engine reported {new_reported} cached tokens where {new_predicted} were "
                "predicted: its cache keys differ (salt, LoRA or template not applied alike)")

    def _verdict(self, worker: Worker, parity: Parity, reason: str) -> None:
        changed = (worker.parity, worker.parity_reason) != (parity, reason)
        worker.parity, worker.parity_reason = parity, reason
        if not changed:
            return
        if parity in (Parity.DEGRADED, Parity.FALLING_BACK):
            log.error("hash_parity_lost", worker_id=worker.worker_id, parity=parity.value,
                      reason=reason)
        else:
            log.info("hash_parity_checked", worker_id=worker.worker_id, parity=parity.value,
                     reason=reason or None)
