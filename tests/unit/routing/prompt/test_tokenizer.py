"""Prompt tokenization: the segment cache always equals whole-text tokenization."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from routing.prompt.chat_template import ChatTemplate
from routing.prompt.tokenizer import PromptTokenizer, TokenizeLater

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "you",
    "are",
    "helpful",
    "hello",
    "world",
    "",
    "tabs\tand\nnewlines,",
    "KV",
    "cache",
    "ü",
    "日本",
]


def _conversation(rng: random.Random, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": " ".join(rng.choices(WORDS, k=30))}]
    for t in range(turns):
        role = "user" if t % 2 == 0 else "assistant"
        messages.append(
            {"role": role, "content": " ".join(rng.choices(WORDS, k=rng.randrange(1, 40)))}
        )
    return messages


def test_multi_turn_cache_equals_full_tokenization(tiny_model_dir: Path) -> None:
    """Every turn of random chats tokenizes to exactly the uncached ids, from the cache."""
    tok = PromptTokenizer.from_model_dir(tiny_model_dir)
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert template is not None and tok.segmented
    rng = random.Random(7)
    for _ in range(20):
        messages = _conversation(rng, 9)
        for turn in range(2, len(messages) + 1):
            text = template.render(messages[:turn])
            assert tok.encode_chat(text) == tok.encode_full(text, add_special_tokens=False)


def test_edited_history_and_special_text_in_content(tiny_model_dir: Path) -> None:
    """An edited earlier message, or special-token text inside content, stays exact."""
    tok = PromptTokenizer.from_model_dir(tiny_model_dir)
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert template is not None
    rng = random.Random(11)
    for _ in range(10):
        messages = _conversation(rng, 6)
        tok.encode_chat(template.render(messages))
        messages[2] = {
            "role": "assistant",
            "content": "edited <|eot_id|> inside<|start_header_id|>",
        }
        text = template.render(messages)
        assert tok.encode_chat(text) == tok.encode_full(text, add_special_tokens=False)
        assert tok.encode_chat(text) == tok.encode_full(text, add_special_tokens=False)


def test_next_turn_reuses_the_history(tiny_model_dir: Path) -> None:
    """Turn N+1 takes turn N's tokens from the cache; only its new message is tokenized."""
    tok = PromptTokenizer.from_model_dir(tiny_model_dir)
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert template is not None
    messages = _conversation(random.Random(1), 6)
    tok.encode_chat(template.render(messages))
    history = template.render(messages, add_generation_prompt=False)
    before = tok.hit_tokens
    messages.append({"role": "user", "content": "one more question"})
    total = len(tok.encode_chat(template.render(messages)))
    hits = tok.hit_tokens - before
    assert hits >= len(tok.encode_full(history, False))
    assert total - hits <= len(
        tok.encode_full(
            "user<|end_header_id|>\n\none more question<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
            False,
        )
    )


def test_completion_prompts_get_bos_and_are_cached(tiny_model_dir: Path) -> None:
    """Completion prompts carry the tokenizer's special tokens; a repeat is a cache hit."""
    tok = PromptTokenizer.from_model_dir(tiny_model_dir)
    ids = tok.encode_completion("hello world")
    assert ids == tok.encode_full("hello world", True) and ids[0] == 0
    before = tok.hit_tokens
    assert tok.encode_completion("hello world") == ids
    assert tok.hit_tokens - before == len(ids)


def test_cache_is_bounded(tiny_model_dir: Path) -> None:
    """The cache holds at most max_cached_tokens tokens."""
    tok = PromptTokenizer.from_model_dir(tiny_model_dir)
    tok.max_cached_tokens = 400
    for i in range(100):
        tok.encode_completion(f"prompt number {i} " * 3)
    assert tok._cached_tokens <= 400


def test_first_piece_only_normalizer_disables_segmenting() -> None:
    """A tokenizer whose pieces do not tokenize independently is detected and tokenized whole."""
    vocab = {"[UNK]": 0, "<sep>": 1, "▁a": 2, "a": 3, "▁b": 4, "b": 5, "▁": 6}
    inner = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    inner.normalizer = normalizers.Sequence([])
    inner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    inner.add_special_tokens(["<sep>"])
    tok = PromptTokenizer(inner)
    assert not tok.segmented
    text = "a b<sep>a b<sep>b"
    assert tok.encode_chat(text) == tok.encode_full(text, False)


def test_reference_engine_model_if_present() -> None:
    """The reference engine's tiny model (when built) segments correctly too."""
    path = Path(__file__).resolve().parents[4] / "refengine" / "models" / "tiny"
    if not (path / "tokenizer.json").is_file():
        return  # the reference engine's model is not built in this checkout
    tok = PromptTokenizer.from_model_dir(path)
    template = ChatTemplate.from_model_dir(path)
    assert template is not None
    messages = _conversation(random.Random(3), 5)
    text = template.render(messages)
    assert tok.encode_chat(text) == tok.encode_full(text, False)


def test_a_long_text_is_handed_off_and_its_ids_taken_back(tiny_model_dir: Path) -> None:
    """Past ``defer_chars`` an uncached text raises ``TokenizeLater``; the ids tokenized off
    the loop (the GIL-releasing batch call) equal the whole-text ids, and the next pass takes
    them; a cached text never defers."""
    tok = PromptTokenizer.from_model_dir(tiny_model_dir)
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    rng = random.Random(3)
    long_chat = template.render(_conversation(rng, 40))
    text = " ".join(rng.choices(WORDS, k=400))
    for encode, special, source in (
        (lambda d: tok.encode_chat(long_chat, None, d), False, long_chat),
        (lambda d: tok.encode_completion(text, d), True, text),
    ):
        try:
            encode(100)
        except TokenizeLater as later:
            assert later.add_special_tokens is special and later.text in source
            ids = tok.encode_off_loop(later.text, later.add_special_tokens)
            assert ids == tok.encode_full(later.text, special)
            tok.offer(later.text, later.add_special_tokens, ids)
            got = encode(100)
            tok.withdraw()
        else:
            raise AssertionError("a long uncached text was tokenized on the caller's thread")
        assert got == tok.encode_full(source, special)
        assert encode(100) == got  # cached now: no deferral


def test_a_cache_of_zero_tokens_keeps_nothing(tiny_model_dir: Path) -> None:
    """--tokenizer-cache-tokens 0: every prompt tokenized afresh, the same ids."""
    tok = PromptTokenizer.from_model_dir(tiny_model_dir, max_cached_tokens=0)
    ids = tok.encode_completion("hello world")
    assert tok.encode_completion("hello world") == ids
    assert tok._cached_tokens == 0 and tok.hit_tokens == 0


def test_chats_sharing_a_new_system_prompt_defer_under_one_share_key(
    tiny_model_dir: Path,
) -> None:
    """Two chats with the same uncached long system prompt and their own user turns defer
    different texts under one share key (the system prompt's piece): once either's ids are
    cached, the other finds the system prompt there and no longer defers."""
    tok = PromptTokenizer.from_model_dir(tiny_model_dir)
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert template is not None and tok.segmented
    rng = random.Random(5)
    system = {"role": "system", "content": " ".join(rng.choices(WORDS, k=400))}
    chats = [template.render([system, {"role": "user", "content": user}])
             for user in ("hello world", "the quick brown fox")]
    tok.encode_chat(template.render([{"role": "user", "content": "hi"}]))  # headers cached
    deferred = []
    for chat in chats:
        try:
            tok.encode_chat(chat, None, 1000)
        except TokenizeLater as later:
            deferred.append(later)
        else:
            raise AssertionError("a long uncached system prompt was not deferred")
    first, second = deferred
    assert first.text != second.text and first.share_key == second.share_key
    assert system["content"].strip() in first.share_key[0] and first.share_key[1] is False
    tok.offer(first.text, False, tok.encode_off_loop(first.text, False))
    tok.encode_chat(chats[0], None, 1000)
    tok.withdraw()
    assert tok.encode_chat(chats[1], None, 1000) == tok.encode_full(chats[1], False)


def test_a_whole_text_is_its_own_share_key(tiny_model_dir: Path) -> None:
    """A completion prompt shares its tokenizing only with the same text."""
    tok = PromptTokenizer.from_model_dir(tiny_model_dir)
    text = " ".join(random.Random(6).choices(WORDS, k=400))
    try:
        tok.encode_completion(text, 100)
    except TokenizeLater as later:
        assert later.share_key == (text, True)
    else:
        raise AssertionError("a long uncached text was not deferred")
