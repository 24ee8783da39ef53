"""The "model" behind the test-only engine stand-ins (``sglang_standin``, ``trtllm_standin``).

It generates deterministically, and every request field it honours leaves a mark a test can
read in the reply, so a matrix test can tell a field that reached the engine from one that was
dropped on the way:

- text: the tokens of ``SENTENCE`` in a cycle, starting at an offset set by ``seed`` (and by
  the choice's index, so ``n`` choices differ); an EOS opportunity every ``NATURAL_TOKENS``
  tokens ends it with ``finish_reason`` ``stop`` (matched: the EOS id), unless
  ``ignore_eos`` or ``min_tokens`` say to go on; ``max_tokens`` ends it with ``length``;
- ``stop`` strings and ``stop_token_ids`` end it with ``stop`` and the matched stop (the stop
  string is cut from the text, as the engines do);
- any non-neutral penalty (presence, frequency, repetition) makes it never repeat a token;
- ``json_schema`` / ``json_object``: the content is JSON, an instance of the schema;
  ``regex`` / ``ebnf``: the content says which constraint it was given;
- tools with a ``tool_choice`` other than ``none``: one tool call, its arguments an instance
  of the tool's parameters schema;
- thinking: ``reasoning_content`` that quotes the last user message;
- images: the content names each image's SHA-256 (the bytes the engine loaded);
- a LoRA adapter: the content starts with ``[lora <name>]``;
- logprobs: a deterministic logprob per token, with ``top_logprobs`` alternatives.

Nothing here knows kvsidecar: the front ends speak the engines' HTTP surfaces and this module
only turns their parsed requests into answers. Malformed constraints raise ``StandinError``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "NATURAL_TOKENS",
    "SENTENCE",
    "Ask",
    "Choice",
    "StandinError",
    "StandinModel",
    "Tokenizer",
    "ToolCall",
    "check_json_schema",
    "instance_of",
]

SENTENCE = " the quick brown fox jumps over the lazy dog while a cat sleeps"
NATURAL_TOKENS = 8
_JSON_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


class StandinError(ValueError):
    """A request the stand-in refuses, as the real engine would (HTTP 400)."""


class Tokenizer(Protocol):
    """What the model needs of a ``transformers`` tokenizer."""

    eos_token_id: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...

    def decode(self, token_ids: Any) -> Any: ...


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Choice:
    """One generated choice: its token ids, text and how it ended."""

    index: int
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    matched_stop: int | str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] | None = None

    deltas: list[str] = field(default_factory=list)  # the text, one piece per token

@dataclass(frozen=True)
class Ask:
    """What a request asks of the model, in the engine-neutral terms of this module."""

    prompt_ids: list[int]
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    penalized: bool = False
    n: int = 1
    json_schema: Any = None  # a schema (dict), or True for json_object
    regex: str | None = None
    ebnf: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: Any = "none"  # "none" | "auto" | "required" | a function name
    thinking: bool = False
    last_user_text: str = ""
    image_digests: tuple[str, ...] = ()
    lora: str | None = None
    top_logprobs: int | None = None  # None: no logprobs


class StandinModel:
    """Answers ``Ask``s deterministically (module docstring)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cycle = tokenizer.encode(SENTENCE, add_special_tokens=False)
        self.eos = tokenizer.eos_token_id

    def answer(self, ask: Ask) -> list[Choice]:
        if ask.json_schema is not None and ask.json_schema is not True:
            check_json_schema(ask.json_schema)
        for tool in ask.tools:
            params = (tool.get("function") or {}).get("parameters")
            if params is not None:
                check_json_schema(params)
        return [self._choice(ask, i) for i in range(ask.n)]

    def _choice(self, ask: Ask, index: int) -> Choice:
        choice = self._generate(ask, index)
        prefix = f"[lora {ask.lora}] " if ask.lora else ""
        marks = "".join(f" [image sha256:{d}]" for d in ask.image_digests)
        if ask.thinking:
            choice.reasoning = f"The user wrote {ask.last_user_text!r}; answer briefly."
        tool = self._tool_for(ask)
        if tool is not None:
            fn = tool.get("function") or {}
            args = instance_of(fn.get("parameters") or {"type": "object"})
            choice.tool_calls = [
                ToolCall(f"call_{index}_{fn.get('name')}", str(fn.get("name")), json.dumps(args))
            ]
            choice.text, choice.deltas = "", []
            choice.finish_reason = "tool_calls"
            choice.matched_stop = None
        elif ask.json_schema is not None:
            schema = {"type": "object"} if ask.json_schema is True else ask.json_schema
            value = instance_of(schema)
            if ask.json_schema is True:
                value = {"answer": choice.text.strip()}
            choice.text = json.dumps(value)
            choice.deltas = [choice.text]
            choice.finish_reason, choice.matched_stop = "stop", self.eos
        elif ask.regex is not None or ask.ebnf is not None:
            kind, rule = ("regex", ask.regex) if ask.regex is not None else ("ebnf", ask.ebnf)
            choice.text = f"constrained by {kind} {rule!r}:{choice.text}"
            choice.deltas = [choice.text]
        if not choice.tool_calls:
            choice.text = prefix + choice.text + marks
            choice.deltas = [*([prefix] if prefix else []), *choice.deltas,
                             *([marks] if marks else [])]
        return choice

    def _tool_for(self, ask: Ask) -> dict[str, Any] | None:
        if not ask.tools or ask.tool_choice == "none":
            return None
        if ask.tool_choice in ("auto", "required"):
            return ask.tools[0]
        for tool in ask.tools:
            if (tool.get("function") or {}).get("name") == ask.tool_choice:
                return tool
        raise StandinError(f"Tool '{ask.tool_choice}' not found in tools list.")

    def _generate(self, ask: Ask, index: int) -> Choice:
        choice = Choice(index)
        start = ((ask.seed or 0) * 7 + index * 3) % len(self.cycle)
        used: set[int] = set()
        position = start
        while True:
            produced = len(choice.ids)
            if produced >= ask.max_tokens:
                choice.finish_reason = "length"
                break
            at_eos = produced > 0 and produced % NATURAL_TOKENS == 0
            if at_eos and not ask.ignore_eos and produced >= ask.min_tokens:
                choice.ids.append(self.eos)
                choice.finish_reason, choice.matched_stop = "stop", self.eos
                break
            token = self.cycle[position % len(self.cycle)]
            position += 1
            if ask.penalized:
                tries = 0
                while token in used and tries < len(self.cycle):
                    token = self.cycle[position % len(self.cycle)]
                    position += 1
                    tries += 1
                if token in used:  # nothing left that does not repeat
                    choice.ids.append(self.eos)
                    choice.finish_reason, choice.matched_stop = "stop", self.eos
                    break
            used.add(token)
            choice.ids.append(token)
            if token in ask.stop_token_ids and produced + 1 >= ask.min_tokens:
                choice.finish_reason, choice.matched_stop = "stop", token
                break
            text = self.tokenizer.decode(choice.ids)
            hit = next((s for s in ask.stop if s and s in text), None)
            if hit is not None and produced + 1 >= ask.min_tokens:
                choice.finish_reason, choice.matched_stop = "stop", hit
                break
        visible = [t for t in choice.ids if t != self.eos and t not in ask.stop_token_ids]
        text = self.tokenizer.decode(visible)
        if isinstance(choice.matched_stop, str):
            text = text[: text.index(choice.matched_stop)]
        choice.text = text
        sent = ""
        for i in range(len(visible)):
            upto = self.tokenizer.decode(visible[: i + 1])[: len(text)]
            choice.deltas.append(upto[len(sent) :])
            sent = upto
        if ask.top_logprobs is not None:
            choice.logprobs = [self._logprob(t, i, ask.top_logprobs) for i, t in enumerate(visible)]
        return choice

    def _logprob(self, token: int, i: int, top: int) -> tuple[str, float, list[tuple[str, float]]]:
        text = self.tokenizer.decode([token])
        logprob = -0.25 * (1 + i % 4)
        alternatives = [(text, logprob)]
        for k in range(1, top):
            other = self.cycle[(i + k) % len(self.cycle)]
            alternatives.append((self.tokenizer.decode([other]), logprob - k))
        return text, logprob, alternatives[:top]


def digest(data: bytes) -> str:
    """How the stand-ins name an image in a reply: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(data).hexdigest()[:16]


def check_json_schema(schema: Any, where: str = "schema") -> None:
    """Refuse a schema a grammar compiler would refuse (wrong types, malformed keywords)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise StandinError(f"{where} must be a JSON object, got {type(schema).__name__}")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in _JSON_TYPES:
            raise StandinError(f"{where}.type: unknown JSON schema type {k!r}")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise StandinError(f"{where}.properties must be an object")
        for name, sub in props.items():
            check_json_schema(sub, f"{where}.properties.{name}")
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise StandinError(f"{where}.required must be a list of property names")
    if "items" in schema:
        check_json_schema(schema["items"], f"{where}.items")
    enum = schema.get("enum")
    if enum is not None and (not isinstance(enum, list) or not enum):
        raise StandinError(f"{where}.enum must be a non-empty list")


def instance_of(schema: Any) -> Any:
    """A value that satisfies ``schema`` (the subset ``check_json_schema`` admits)."""
    if not isinstance(schema, dict):
        return {}
    if "enum" in schema:
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: instance_of(sub) for name, sub in props.items()}
    if kind == "array":
        return [instance_of(schema.get("items") or {"type": "string"})]
    return {"string": "stand-in", "integer": 7, "number": 0.5, "boolean": True, "null": None}[
        kind
    ]
