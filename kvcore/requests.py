"""What the gateway sends a sidecar: the client's request, already tokenized and placed.

``POST /v1/kvsidecar/generate`` (and the prefill/decode legs) take a ``TokenizedRequest``
as JSON. The gateway has rendered the chat template and tokenized, so the sidecar forwards
exactly the token ids the gateway hashed; sampling parameters travel as OpenAI named them
and the engine's adapter translates them into the engine's names.

A request that asks for more than token ids and sampling parameters can express (tools,
structured output, logprobs, n > 1, any field the translation does not know) carries the
client's own body in ``openai``: the sidecar sends it to the engine's own OpenAI server, whose
parsers produce tool calls, reasoning and logprobs, and relays the answer as the engine gave it.
Nothing a client asked for is dropped on the way.

A request served by a prefill/decode pair carries how the pair shares the KV: ``handoff``
(through our sidecars: the decode worker's sidecar drives the prefill leg and pulls the
prompt's blocks) or ``bootstrap`` (through the engine's own transfer, e.g. SGLang's bootstrap
room); each engine's adapter turns them into what its engine speaks.

A streamed request may ask for the output token ids of each event (``stream_token_ids``:
an SSE comment line before the event, which clients ignore and the gateway strips), and a
stream whose worker died goes on elsewhere as a ``Continuation``: the engine continues after
the tokens the client already has, and the chunks read as the rest of the first stream.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

__all__ = [
    "TRANSFER_FAILED",
    "Bootstrap",
    "Continuation",
    "EngineOpenAI",
    "Handoff",
    "PrefixSource",
    "RequestKind",
    "TokenizedRequest",
]

# The error code of a failed KV handoff: the gateway's cue to re-run the request elsewhere.
TRANSFER_FAILED = "kv_transfer_failed"


class RequestKind(enum.Enum):
    COMPLETION = "completion"
    CHAT = "chat"


class Handoff(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill/decode through our sidecars, sent to the decode worker's sidecar."""

    prefill_url: str  # the prefill worker's sidecar
    prefill_dp_rank: int | None = None
    transport: Literal["shm", "nixl", "tcp"] = "shm"
    transfer_timeout_s: float = 10.0
    # Stream the prefill's token before the handoff (lower TTFT); a failed handoff then ends
    # the stream with an error event instead of an error reply (no fallback possible).
    early_first_token: bool = False


class PrefixSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the request's cached prefix lives when the gateway placed it elsewhere: the
    worker's sidecar pulls it from the holder's block store before prefill (a *move*,
    ``sidecar.kv_move``); a failed pull is a recompute, never an error."""

    peer_url: str  # the holder's sidecar
    block_hashes: list[int]  # the prefix's canonical hashes, from the prompt's first block
    transport: Literal["shm", "nixl", "tcp"] = "shm"
    timeout_s: float = 2.0


class Bootstrap(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill/decode through the engine's own KV transfer: both legs name one room, which
    the prefill engine serves at ``host:port``."""

    role: Literal["prefill", "decode"]
    host: str
    port: int
    room: int


class EngineOpenAI(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The client's request, for the engine's own OpenAI server, as the client sent it."""

    path: Literal[
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/tokenize",
    ]
    body: dict[str, Any]


class Continuation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A stream resumed on another worker (request migration): the engine runs the prompt
    plus ``output_token_ids`` and the chunks continue the first stream (no role again, the
    stream's ``created``, usage counted from the original prompt)."""

    output_token_ids: list[int]  # what the client already has, after the prompt
    created: int | None = None  # the first stream's ``created``


class TokenizedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An OpenAI completions/chat request after the gateway tokenized it (chat template
    applied): what every adapter translates into its engine's native request."""

    request_id: str
    model: str
    kind: RequestKind
    prompt_token_ids: list[int]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    min_tokens: int | None = None  # generated before EOS or a stop token may end it
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    n: int = 1
    lora_name: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    dp_rank: int | None = None
    handoff: Handoff | None = None
    bootstrap: Bootstrap | None = None
    openai: EngineOpenAI | None = None
    stream_token_ids: bool = False  # each streamed event's output ids, as an SSE comment
    continuation: Continuation | None = None
    prefix_source: PrefixSource | None = None  # a moved prefix: pull it before prefill
    # Engine-specific fields passed through verbatim.
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids and self.openai is None:
            raise ValueError("prompt_token_ids must not be empty")
        if self.n != 1 and self.openai is None:
            raise ValueError(f"n={self.n} is not supported; send n separate requests")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.min_tokens is not None and self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.continuation is not None:
            self._check_continuation(self.continuation)

    def _check_continuation(self, c: Continuation) -> None:
        if not self.stream or self.openai is not None or self.handoff is not None:
            raise ValueError("a continuation resumes a stream of token ids on one worker")
        if not c.output_token_ids:
            raise ValueError("a continuation needs the output token ids already streamed")
        if self.max_tokens is not None and len(c.output_token_ids) >= self.max_tokens:
            raise ValueError(f"a continuation of {len(c.output_token_ids)} tokens leaves "
                             f"nothing of max_tokens={self.max_tokens} to generate")

    def for_engine(self) -> TokenizedRequest:
        """What the engine runs: a continuation's prompt and output so far as its prompt,
        the tokens left of ``max_tokens`` (the request itself otherwise)."""
        c = self.continuation
        if c is None:
            return self
        done = len(c.output_token_ids)
        return msgspec.structs.replace(
            self,
            prompt_token_ids=self.prompt_token_ids + c.output_token_ids,
            max_tokens=None if self.max_tokens is None else self.max_tokens - done,
            continuation=None,
        )

