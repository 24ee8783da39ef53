"""Request preparation: tokenize as the engine will, check the context limit, hash."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kvcore import BlockHasher, Namespace
from kvcore.errors import OpenAIError
from routing.prompt.chat_template import ChatTemplate
from routing.prompt.openai_api import Endpoint, parse_request
from routing.prompt.preparer import PromptPreparer
from routing.prompt.tokenizer import PromptTokenizer


def _preparer(
    model_dir: Path | None, limit: int | None = None, hash_prompts: bool = True
) -> PromptPreparer:
    tok = PromptTokenizer.from_model_dir(model_dir) if model_dir else None
    template = ChatTemplate.from_model_dir(model_dir) if model_dir else None
    return PromptPreparer(tok, template, BlockHasher(16), hash_prompts, limit)


def test_completion_text_is_forwarded_as_token_ids(tiny_model_dir: Path) -> None:
    """A text prompt becomes the tokenizer's ids in the forwarded body, hashed per block."""
    prep = _preparer(tiny_model_dir)
    text = "The quick brown fox jumps over the lazy dog. " * 8
    raw = orjson.dumps({"model": "m", "prompt": text, "max_tokens": 4, "extra": 1})
    out = prep.prepare(parse_request(Endpoint.COMPLETIONS, raw))
    ids = prep.tokenizer.encode_full(text, True)  # type: ignore[union-attr]
    assert out.body is not None
    forwarded = orjson.loads(out.body)
    assert forwarded["prompt"] == ids and forwarded["extra"] == 1
    assert out.prompt_tokens == len(ids)
    assert list(out.block_hashes) == BlockHasher(16).hash_tokens(ids, Namespace("m").seed)


def test_chat_body_is_forwarded_unchanged(tiny_model_dir: Path) -> None:
    """A chat is tokenized for placement only: its body goes to the engine as sent."""
    prep = _preparer(tiny_model_dir)
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi " * 40}]})
    out = prep.prepare(parse_request(Endpoint.CHAT, raw))
    assert out.body is None and out.prompt_tokens > 16 and out.block_hashes


def test_cache_salt_changes_every_hash(tiny_model_dir: Path) -> None:
    """The same prompt under another cache_salt shares no block hash."""
    prep = _preparer(tiny_model_dir)
    a = {"model": "m", "prompt": "hello world " * 20}
    b = dict(a, cache_salt="tenant-b")
    ha = prep.prepare(parse_request(Endpoint.COMPLETIONS, orjson.dumps(a))).block_hashes
    hb = prep.prepare(parse_request(Endpoint.COMPLETIONS, orjson.dumps(b))).block_hashes
    assert ha and not set(ha) & set(hb)


def test_prompt_over_the_context_limit(tiny_model_dir: Path) -> None:
    """Prompt plus max_tokens over the limit is a 400 context_length_exceeded."""
    prep = _preparer(tiny_model_dir, limit=64)
    raw = orjson.dumps({"model": "m", "prompt": "hello world " * 10, "max_tokens": 60})
    with pytest.raises(OpenAIError) as info:
        prep.prepare(parse_request(Endpoint.COMPLETIONS, raw))
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert "maximum context length is 64 tokens" in info.value.message


def test_template_rejection_is_400(tiny_model_dir: Path) -> None:
    """A conversation the template refuses (raise_exception) is a 400 with its message."""
    prep = _preparer(tiny_model_dir)
    prep.template = ChatTemplate("{{ raise_exception('roles must alternate') }}", {})
    raw = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(OpenAIError, match="roles must alternate"):
        prep.prepare(parse_request(Endpoint.CHAT, raw))


def test_without_model_dir_prefix_modes_hash_pseudo_tokens() -> None:
    """Without a tokenizer, shared prompt prefixes still share leading block hashes."""
    prep = _preparer(None)
    prefix = "You are a helpful assistant. " * 10
    a = prep.prepare(
        parse_request(Endpoint.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prefix + "A"}))
    )
    b = prep.prepare(
        parse_request(Endpoint.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prefix + "B"}))
    )
    assert a.body is None and len(a.block_hashes) >= 4
    assert a.block_hashes[:4] == b.block_hashes[:4]
    plain = _preparer(None, hash_prompts=False)
    out = plain.prepare(
        parse_request(Endpoint.COMPLETIONS, orjson.dumps({"model": "m", "prompt": prefix}))
    )
    assert not out.block_hashes and not out.timed


def test_prefix_hash_cache_equals_direct_hashing(tiny_model_dir: Path) -> None:
    """Hashes reused from earlier turns equal hashing the whole prompt, turn after turn."""
    import random

    prep = _preparer(tiny_model_dir)
    tok = prep.tokenizer
    assert tok is not None
    rng = random.Random(4)
    words = ["alpha", "beta", "gamma", "cache", "router", "the", "of", "block", "\n"]
    hit_before = prep.hash_cache.hit_blocks
    for conversation in range(6):
        messages = [{"role": "system", "content": " ".join(rng.choices(words, k=120))}]
        for turn in range(5):
            messages.append({"role": "user", "content": " ".join(rng.choices(words, k=50))})
            body = {"model": "m", "messages": messages, "cache_salt": f"s{conversation % 2}"}
            out = prep.prepare(parse_request(Endpoint.CHAT, orjson.dumps(body)))
            text = prep.render(parse_request(Endpoint.CHAT, orjson.dumps(body)))
            ids = tok.encode_full(text, False)
            seed = Namespace("m", None, f"s{conversation % 2}").seed
            assert list(out.block_hashes) == BlockHasher(16).hash_tokens(ids, seed), turn
            messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=30))})
    assert prep.hash_cache.hit_blocks - hit_before > 100  # later turns reused earlier hashes


def _chat_with_image(url: str | None) -> bytes:
    parts: list[dict[str, object]] = [{"type": "text", "text": "Describe this picture. " * 12}]
    if url is not None:
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": parts}]})


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_image_prompts_hash_in_their_media_namespace(
    tiny_model_dir: Path, with_tokenizer: bool
) -> None:
    """Same text, different images: no shared block (the engine keys image blocks by image)."""
    prep = _preparer(tiny_model_dir if with_tokenizer else None)
    cat, dog, text = (
        prep.prepare(parse_request(Endpoint.CHAT, _chat_with_image(url)))
        for url in ("https://x/cat.png", "https://x/dog.png", None)
    )
    again = prep.prepare(parse_request(Endpoint.CHAT, _chat_with_image("https://x/cat.png")))
    assert cat.block_hashes and cat.media and not text.media
    assert again.block_hashes == cat.block_hashes  # the same image still finds its cache
    assert not set(cat.block_hashes) & set(dog.block_hashes)
    assert not set(cat.block_hashes) & set(text.block_hashes)
