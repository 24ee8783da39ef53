"""The one interface the sidecar uses for every engine: ``EngineAdapter``.

An adapter turns one engine replica's native KV interfaces into the canonical model
(``kvcore``): a single stream of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` events, each naming its worker (one per data-parallel rank), in order
per worker and unstamped (the sidecar's relay numbers them); when it no longer knows what a
worker holds it says so with ``AllBlocksCleared``. It also translates the gateway's already
tokenized OpenAI requests into the engine's native request and the answers back.

Nothing here knows SGLang or TensorRT-LLM. Engines register a factory in ``ADAPTERS`` by
module path, so looking an adapter up imports only that adapter (and never an engine
package: the adapters speak the engines' wire formats, they do not import them).

An engine that can split a request over a prefill and a decode worker says how through
``pd`` (``PrefillDecode``): the two legs, the handoff metadata between them and the engine's
own transfer (``TokenizedRequest.bootstrap``, which ``translate_request`` carries), so the
sidecar drives prefill/decode without knowing any engine's paths or fields.

An engine whose scheduler publishes its own load (SGLang's load socket) shows it through
``engine_load``; the others answer None there and the gateway goes by its own count.

Storage hooks that run *inside* the engine (SGLang's HiCache backend, TensorRT-LLM's KV
cache connector) are separate classes the engine loads; an adapter only describes them
(``block_layout()``: the blocks' bytes; ``store_keys``: what the hook keys them by), so they
can be added without touching this Protocol. A hook that keys blocks by the engine's own
block hash cannot name them canonically (it sees no tokens); the adapter, the one home of
the mapping from the engine's block identity to canonical hashes, reports each chain the
engine stores (``watch_store_names``) so the sidecar's store can (``shm.block_names``).
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

import msgspec

from kvcore.errors import OpenAIError
from kvcore.events import KVEvent
from kvcore.layout import BlockLayout
from kvcore.requests import TokenizedRequest
from kvcore.stream import EngineLoad

__all__ = [
    "ADAPTERS",
    "AdapterConfig",
    "AdapterError",
    "EngineAdapter",
    "EngineInfo",
    "EngineKind",
    "EngineRequest",
    "EventEndpoint",
    "LoraAdapter",
    "PrefillDecode",
    "PrefillResult",
    "ResponseTranslator",
    "StoreKeys",
    "StoreNameSink",
    "create_adapter",
    "engine_openai_request",
    "worker_id_for",
]


class EngineKind(enum.StrEnum):
    """The engines we adapt: ``kvsidecar sidecar --engine``'s values, what ``inject`` detects,
    and the keys of ``ADAPTERS`` (a StrEnum: its value goes into flags, logs and labels)."""

    SGLANG = "sglang"
    TRTLLM = "trtllm"
    VLLM = "vllm"


class StoreKeys(enum.Enum):
    """What an engine's storage hook keys the blocks it puts in the sidecar's store by."""

    CANONICAL = "canonical"  # the canonical block hash (TensorRT-LLM's connector)
    ENGINE = "engine"  # the engine's own block hash (SGLang's HiCache: the page hash)


# Reports one chain of blocks the engine stored: each block's hash as the storage hook keys
# it, each one's canonical hash, and the canonical parent of the first (None: a root).
StoreNameSink = Callable[[Sequence[int], Sequence[int], int | None], None]


class AdapterError(RuntimeError):
    """The engine cannot be adapted as configured (no KV events, a size mismatch, ...)."""


def worker_id_for(base: str, dp_rank: int, dp_size: int) -> str:
    """The canonical worker id of one DP rank: ``base`` alone, or ``base/dp<rank>``."""
    return base if dp_size <= 1 else f"{base}/dp{dp_rank}"


@dataclass(frozen=True, slots=True)
class EventEndpoint:
    """Where one DP rank's KV events (or its engine load) come from.

    SGLang: ``endpoint`` is the ZMQ PUB address and ``replay_endpoint`` its ROUTER (or
    None: no replay). TensorRT-LLM: ``endpoint`` is the server's base URL.
    """

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        if self.dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {self.dp_rank}")
        if not self.endpoint:
            raise ValueError("an event endpoint needs an address")


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter the engine has loaded, as an engine that selects adapters by id needs
    it (TensorRT-LLM's ``lora_request``: name, integer id, checkpoint path)."""

    name: str
    int_id: int
    path: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a LoRA adapter needs a name")
        if self.int_id < 0:
            raise ValueError(f"LoRA adapter {self.name!r}: id must be >= 0, got {self.int_id}")

    @classmethod
    def parse(cls, spec: str) -> LoraAdapter:
        """``NAME=ID[:PATH]`` (the sidecar's ``--lora-adapter``)."""
        name, sep, rest = spec.partition("=")
        id_text, _, path = rest.partition(":")
        try:
            int_id = int(id_text)
        except ValueError:
            int_id = -1
        if not sep or int_id < 0 or not name:
            raise ValueError(
                f"--lora-adapter {spec!r}: expected NAME=ID[:PATH] with a non-negative "
                "integer ID (the engine's lora_int_id)"
            )
        return cls(name, int_id, path)

    @staticmethod
    def check_unique(adapters: Sequence[LoraAdapter]) -> None:
        for attr, label in (("name", "name"), ("int_id", "id")):
            values = [getattr(a, attr) for a in adapters]
            if len(set(values)) != len(values):
                raise ValueError(f"two LoRA adapters share {label}s: {values}")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What an adapter is told; everything else it learns from the engine.

    ``block_size`` and ``endpoints`` may be given (flags) or left to discovery (the engine's
    ``/server_info``); when both exist they must agree, or ``start()`` fails.
    ``load_endpoints``: where the engine publishes its scheduler's load per DP rank (flags;
    discovered when the engine advertises them and discovery runs; an engine without one
    leaves the load to the gateway's own count).
    """

    engine: EngineKind
    engine_url: str
    worker_id: str
    model_id: str
    block_size: int | None = None
    endpoints: tuple[EventEndpoint, ...] = ()
    load_endpoints: tuple[EventEndpoint, ...] = ()
    model_path: str | None = None
    lora_adapters: tuple[LoraAdapter, ...] = ()
    request_timeout_s: float = 5.0
    replay_timeout_s: float = 2.0
    poll_interval_s: float = 0.05
    queue_size: int = 4096
    api_key: str | None = field(default=None, repr=False)  # the engine's; never logged

    @property
    def lora_names(self) -> dict[int, str]:
        """Adapter names by their engine ids (events that carry only an id)."""
        return {a.int_id: a.name for a in self.lora_adapters}

    def engine_headers(self) -> dict[str, str]:
        """Headers of a request to the engine: its bearer token when it has one."""
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        if self.block_size is not None and not 1 <= self.block_size <= 4096:
            raise ValueError(f"block_size must be in [1, 4096], got {self.block_size}")
        for name in ("request_timeout_s", "replay_timeout_s", "poll_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {self.queue_size}")
        for kind, endpoints in (("event", self.endpoints), ("load", self.load_endpoints)):
            ranks = [e.dp_rank for e in endpoints]
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"two {kind} endpoints share a dp_rank: {sorted(ranks)}")
        LoraAdapter.check_unique(self.lora_adapters)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the sidecar needs to know about the engine, once the adapter has started."""

    kind: EngineKind
    block_size: int
    dp_size: int
    endpoints: tuple[EventEndpoint, ...]
    worker_ids: tuple[str, ...]
    model_path: str | None = None
    server_info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def reasoning_parser(self) -> str | None:
        """The engine's reasoning parser (SGLang's ``--reasoning-parser``): it splits the
        model's thinking into ``reasoning_content`` on the engine's OpenAI server only."""
        parser = self.server_info.get("reasoning_parser")
        return parser if isinstance(parser, str) and parser else None


# --- request translation ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A native request: POST ``body`` (JSON) to ``path`` on the engine. ``openai``: it goes to
    the engine's own OpenAI server, whose answers are already in OpenAI's shape."""

    path: str
    body: dict[str, Any]
    stream: bool
    openai: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)  # the engine's own, e.g. a leg's


def engine_openai_request(
    request: TokenizedRequest, extra: Mapping[str, Any] | None = None
) -> EngineRequest:
    """``request.openai`` as its engine's OpenAI server takes it: the client's body as it came
    (its model name too: ``<base>:<adapter>`` selects a LoRA adapter) and ``extra`` (an
    engine's own fields, e.g. SGLang's request id)."""
    openai = request.openai
    if openai is None:
        raise ValueError("the request carries no OpenAI body")
    if request.bootstrap is not None or request.handoff is not None:
        raise ValueError("a prefill/decode leg speaks token ids, not the OpenAI API")
    body = {**openai.body, **(extra or {})}
    return EngineRequest(openai.path, body, bool(body.get("stream")), openai=True)


class PrefillResult(msgspec.Struct, frozen=True):
    """The prefill leg's answer (``POST /v1/kvsidecar/pd/prefill``, prefill sidecar to decode
    sidecar): the first token and what the decode engine must import to go on."""

    output_ids: list[int]
    text: str
    finished: bool  # the first token already ended the request (EOS, a stop, max_tokens 1)
    finish_reason: Any  # the engine's own, for the first token's answer object
    cached_tokens: int
    handoff_keys: list[str]  # the prompt's KV as the engine exported it (its page keys)
    seconds: float
    # What the decode engine needs to fetch the KV itself (TensorRT-LLM's
    # disaggregated_params); empty when the KV moves through our sidecars (handoff_keys).
    engine_state: dict[str, Any] = {}


class PrefillDecode(Protocol):
    """How our sidecars split one request over a prefill and a decode engine of one kind.

    The decode worker's sidecar sends ``prefill_request`` to the prefill worker's engine (via
    its sidecar), pulls the blocks named by ``PrefillResult.handoff_keys``, then streams
    ``decode_request`` from its own engine; ``stitched`` makes the two answers one request's,
    in the engine's native objects, for the adapter's ``ResponseTranslator``.
    """

    def prefill_request(self, request: TokenizedRequest) -> EngineRequest:
        """The prefill leg: one token, not streamed; the engine exports the prompt's KV."""
        ...

    def prefill_result(
        self, request: TokenizedRequest, body: Mapping[str, Any], seconds: float
    ) -> PrefillResult:
        """The prefill engine's answer, read (``ValueError`` if it is not one)."""
        ...

    def first_object(self, request: TokenizedRequest, prefill: PrefillResult) -> dict[str, Any]:
        """The native answer object of the first token alone."""
        ...

    def decode_request(self, request: TokenizedRequest, prefill: PrefillResult) -> EngineRequest:
        """The decode leg: prompt plus the first token, the rest of ``max_tokens``, streamed,
        importing the prefill's KV."""
        ...

    def stitched(
        self,
        request: TokenizedRequest,
        prefill: PrefillResult,
        head: dict[str, Any],
        rest: AsyncIterator[dict[str, Any]],
    ) -> AsyncIterator[dict[str, Any]]:
        """The decode engine's native objects rewritten as one request's (the first token
        prepended, usage against the client's prompt)."""
        ...

    def store_keys(self, model_id: str, handoff_keys: Sequence[str]) -> list[tuple[int, int]]:
        """The block store's ``(namespace seed, block hash)`` keys of ``handoff_keys``, as
        the engine's storage hook keys those pages (what a sidecar pulls from its peer)."""
        ...

    def import_failed(self, status: int) -> bool:
        """Whether an error status of the decode engine means it could not import the KV."""
        ...

    def bootstrap_address(self, engine_url: str, port: int | None) -> tuple[str, int] | None:
        """Where a prefill engine serves its own KV transfer (``Bootstrap``), or None if this
        engine has none."""
        ...


class ResponseTranslator(Protocol):
    """Turns one request's engine answers into OpenAI bodies (one per request, stateful)."""

    def response(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The OpenAI response for a non-streaming engine answer."""
        ...

    def chunk(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        """OpenAI stream chunks for one engine SSE ``data:`` object (may be none)."""
        ...

    def token_ids(self) -> list[int] | None:
        """The output token ids of the chunks returned since the last call (None when the
        engine's answers do not say them)."""
        ...

    def finish(self) -> list[dict[str, Any]]:
        """Chunks to send after the engine's stream ended (the usage chunk, if asked)."""
        ...

    def cached_tokens(self) -> int | None:
        """The prompt tokens the engine said it found cached, of the prompt it was sent
        (not adjusted for a continuation), once an answer said; None: no answer said (yet)."""
        ...

    def error(self, status: int, body: bytes) -> OpenAIError:
        """The OpenAI-shaped error for an engine error reply."""
        ...


# --- the adapter ----------------------------------------------------------------------------


@runtime_checkable
class EngineAdapter(Protocol):
    """One engine replica, seen through the canonical model.

    Use as ``async with adapter:`` (``start()`` then ``aclose()``); ``events()`` is the one
    stream of every DP rank's normalized events, in order per worker.
    """

    kind: EngineKind
    pd: PrefillDecode | None  # None: the engine cannot be split into prefill and decode
    store_keys: StoreKeys  # what the engine's storage hook keys blocks by

    async def start(self) -> EngineInfo:
        """Discover the engine (``/server_info`` or flags), connect, and begin consuming."""
        ...

    @property
    def info(self) -> EngineInfo:
        """What ``start()`` learned; raises ``AdapterError`` before it."""
        ...

    def events(self) -> AsyncIterator[KVEvent]:
        """Normalized events; ends after ``aclose()``."""
        ...

    async def kv_capacity_blocks(self) -> int | None:
        """How many KV blocks one worker of the engine holds, if the engine says (best
        effort: None when it does not or cannot be asked now)."""
        ...

    def engine_load(self, worker_id: str) -> EngineLoad | None:
        """The engine's own latest load reading for ``worker_id`` (its scheduler's running
        and queued requests and KV use), or None: the engine publishes none, or its last
        reading is too old to go by. Cheap: the sidecar asks every status interval."""
        ...

    async def render_tokens(self, messages: list[dict[str, Any]]) -> list[int] | None:
        """The token ids the engine makes of a conversation for a chat completion (its chat
        template and tokenizer): what the gateway's own must equal for its block hashes to
        be the engine's. None: the engine cannot say; ``AdapterError``: asking failed."""
        ...

    def block_layout(self) -> BlockLayout:
        """The KV block memory layout (needs the model config; ``AdapterError`` if unknown);
        its ``kind`` is the order the engine's storage hook can write a block in."""
        ...

    def watch_store_names(self, sink: StoreNameSink) -> None:
        """Report every chain the engine stores to ``sink`` from now on (call before
        ``start``), when ``store_keys`` is ``ENGINE``; a no-op for canonical keys."""
        ...

    def translate_request(self, request: TokenizedRequest) -> EngineRequest:
        """The engine's native request for ``request``."""
        ...

    def response_translator(self, request: TokenizedRequest) -> ResponseTranslator:
        """A translator for the answers to ``request``."""
        ...

    async def aclose(self) -> None:
        """Stop consuming and release sockets; idempotent."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


AdapterFactory = Callable[..., EngineAdapter]

# name → "module:attribute" of a factory taking (config, *, metrics=None); imported on use.
ADAPTERS: dict[str, str] = {
    EngineKind.SGLANG.value: "adapters.sglang.adapter:SGLangAdapter",
    EngineKind.TRTLLM.value: "adapters.trtllm.adapter:TrtllmAdapter",
    EngineKind.VLLM.value: "adapters.vllm.adapter:VllmAdapter",
}


def create_adapter(config: AdapterConfig, **kwargs: Any) -> EngineAdapter:
    """The registered adapter for ``config.engine``."""
    try:
        target = ADAPTERS[config.engine.value]
    except KeyError:
        raise AdapterError(
            f"no adapter registered for engine {config.engine.value!r}; known: {sorted(ADAPTERS)}"
        ) from None
    module_name, _, attr = target.partition(":")
    factory: AdapterFactory = getattr(importlib.import_module(module_name), attr)
    return factory(config, **kwargs)
