"""From a parsed request to what placement needs: token ids, block hashes, the body to forward.

With a model directory the gateway tokenizes exactly as the engine will (chat: the rendered
template without added special tokens; completions: the text with them) and forwards a
completion's token ids, so the engine caches the blocks the gateway hashed. Without one it
forwards bodies unchanged; the prefix-aware modes then hash *pseudo-tokens* (the prompt's
UTF-8 bytes, four to a token), which keeps shared prefixes together but predicts cached
blocks in pseudo-blocks, not the engine's.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
import xxhash

from kvcore import BlockHasher, TokenIdError, namespace_seed
from kvcore.errors import OpenAIError
from routing.prompt.chat_template import ChatTemplate, ChatTemplateError
from routing.prompt.hash_cache import PrefixHashCache
from routing.prompt.openai_api import Endpoint, OpenAIRequest, media_parts, message_text
from routing.prompt.tokenizer import PromptTokenizer

__all__ = ["PreparedPrompt", "PromptPreparer"]



@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    block_hashes: Sequence[int]
    prompt_tokens: int  # real tokens, pseudo-tokens, or a bytes/4 estimate
    body: bytes | None  # a rewritten body (token ids), or None: forward the client's bytes
    timed: bool  # placement work was done (tokenize and/or hash): worth a histogram sample
    tokenized: int = 0
    cache_hit_tokens: int = 0
    token_ids: list[int] | None = None  # the real prompt token ids, when known (sidecars)
    media: bool = False  # images (or other media) in the prompt: hashed with their digest


def _media_digest(req: OpenAIRequest) -> str | None:
    """A digest of every non-text content part of a chat (images, audio, video), or None.

    The engines key a block holding an image by the image's own hash; the gateway does not
    know where in the tokens an image lands, so it hashes the whole prompt in a namespace
    of its media: two prompts with different images never share a block (nor, conservatively,
    does one with an image share its text prefix with a prompt without)."""
    parts = media_parts(req.messages)
    if not parts:
        return None
    return xxhash.xxh3_64_hexdigest(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS))


def _pseudo_tokens(text: str) -> list[int]:
    raw = text.encode("utf-8", "surrogatepass")
    raw += b"\x00" * (-len(raw) % 4)
    return array("I", raw).tolist()


class PromptPreparer:
    """Tokenize (or not), check the context limit, hash."""

    def __init__(
        self,
        tokenizer: PromptTokenizer | None,
        template: ChatTemplate | None,
        hasher: BlockHasher,
        hash_prompts: bool,
        max_model_len: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.hasher = hasher
        self.hash_prompts = hash_prompts
        self.max_model_len = max_model_len
        self.hash_cache = PrefixHashCache(hasher)

    def prepare(self, req: OpenAIRequest, defer_chars: int | None = None) -> PreparedPrompt:
        """The request's tokens and block hashes. ``defer_chars``: an uncached text at least
        this long is not tokenized here but raises ``TokenizeLater`` (tokenize it in a
        thread, ``offer`` the ids to the tokenizer, and prepare again)."""
        if not req.prompted:  # placed by load: nothing to hash
            return PreparedPrompt((), 0, None, False)
        bounds: list[tuple[int, int]] = []
        tokens, body, hits, tokenized = self._tokens(req, bounds, defer_chars)
        if tokens is None:
            return PreparedPrompt((), len(req.body.get("prompt") or "") // 4, None, False)
        if tokenized or req.prompt_ids is not None:  # real token ids, not pseudo-tokens
            self._check_length(req, tokens)
        media = _media_digest(req)
        salt = req.cache_salt if media is None else f"{req.cache_salt or ''}\x00media:{media}"
        try:
            hashes = self.hash_cache.hash_tokens(
                tokens, bounds, namespace_seed(req.model, req.lora_name, salt)
            )
        except TokenIdError as exc:
            raise OpenAIError(400, f"bad token id in 'prompt': {exc}", param="prompt") from exc
        real = tokens if (tokenized or req.prompt_ids is not None) else None
        return PreparedPrompt(hashes, len(tokens), body, True, tokenized, hits, real,
                              media is not None)

    def _tokens(
        self, req: OpenAIRequest, bounds: list[tuple[int, int]], defer_chars: int | None
    ) -> tuple[list[int] | None, bytes | None, int, int]:
        """(tokens or None, rewritten body, cache-hit tokens, tokens produced); fills
        ``bounds`` with the prefix keys of the text that was tokenized."""
        tok = self.tokenizer
        if req.prompt_ids is not None:
            return req.prompt_ids, None, 0, 0
        if tok is None:
            if not self.hash_prompts:
                return None, None, 0, 0
            if req.endpoint is Endpoint.CHAT:
                text = "\x00".join(
                    f"{m.get('role')}\x01{message_text(m)}" for m in req.messages or ()
                )
            elif req.prompt_text is not None:
                text = req.prompt_text
            else:
                return None, None, 0, 0
            return _pseudo_tokens(text), None, 0, 0
        before = tok.hit_tokens
        if req.endpoint is Endpoint.CHAT:
            tokens = tok.encode_chat(self.render(req), bounds, defer_chars)
            return tokens, None, tok.hit_tokens - before, len(tokens)
        if req.prompt_text is None:
            return None, None, 0, 0  # a batch of prompts: forwarded as is, not placed by prefix
        tokens = tok.encode_completion(req.prompt_text, defer_chars)
        bounds.append((hash(req.prompt_text), len(tokens)))
        body = dict(req.body)
        body["prompt"] = tokens
        return tokens, orjson.dumps(body), tok.hit_tokens - before, len(tokens)

    def render(self, req: OpenAIRequest) -> str:
        if self.template is None:
            raise OpenAIError(400, "this model has no chat template; use /v1/completions")
        extra = req.body.get("chat_template_kwargs")
        tools = req.body.get("tools")
        try:
            return self.template.render(
                req.messages or [],
                add_generation_prompt=bool(req.body.get("add_generation_prompt", True)),
                tools=tools if type(tools) is list else None,
                extra=extra if type(extra) is dict else None,
            )
        except ChatTemplateError as exc:
            raise OpenAIError(400, str(exc), param="messages") from exc

    def _check_length(self, req: OpenAIRequest, tokens: Sequence[int]) -> None:
        limit = self.max_model_len
        if limit is None:
            return
        n = len(tokens)
        wanted = n + (req.max_tokens or 0)
        if n >= limit or wanted > limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{wanted} tokens ({n} in the prompt, {req.max_tokens or 0} in the completion). "
                "Please reduce the length of the prompt or the completion.",
                param="messages" if req.endpoint is Endpoint.CHAT else "prompt",
                code="context_length_exceeded",
            )
