"""Prompt tokenization from a local model directory, with a segment cache for multi-turn chats.

A rendered chat is cut right after every special token (``<|eot_id|>``, ``<|start_header_id|>``
...). The ``tokenizers`` library splits text on added tokens *before* its pre-tokenizer and
model run, so the pieces between cut points tokenize independently: the ids of the whole text
are the concatenation of the ids of its pieces. Each piece's ids are cached (LRU, bounded by
tokens), so turn N of a conversation re-tokenizes only what turn N added; the history's
pieces are found in the cache. Whether a tokenizer really has that property (some
SentencePiece-style normalizers prepend a space to the first piece only) is checked once at
load time on a probe text; if it does not, every prompt is tokenized whole.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

__all__ = ["PromptTokenizer", "TokenizeLater"]

_PROBE = (
    "{s0}system{s1}\n\nYou are helpful.  Be brief{s2}{s0}user{s1}\n\n hello  world\n"
    " tabs\tand spaces {s2}{s0}assistant{s1}\n\nHi! How can I help?{s2}"
)


def _prepends_to_first_piece_only(node: Any) -> bool:
    """A Metaspace pre-tokenizer with ``prepend_scheme: first`` (SentencePiece-style) adds its
    space marker only at the very start of the text, not after each special token."""
    if isinstance(node, dict):
        if node.get("prepend_scheme") == "first":
            return True
        return any(_prepends_to_first_piece_only(v) for v in node.values())
    if isinstance(node, list):
        return any(_prepends_to_first_piece_only(v) for v in node)
    return False


class TokenizeLater(Exception):
    """A text too long to tokenize on the event loop (the ``defer_chars`` of an encode): the
    caller runs ``encode_off_loop`` in a thread, ``offer``s the ids and prepares again.

    ``share_key``: what other prompts that need the same tokenizing have in common: the
    longest uncached piece of a rendered chat (a new system prompt that a burst of requests
    shares, each with its own user turn), else the whole text. Once one request's
    tokenizing of it is cached, the others find it there (``routing.prompt.flights``)."""

    def __init__(self, text: str, add_special_tokens: bool, share_key: str | None = None
                 ) -> None:
        super().__init__(f"{len(text)} characters to tokenize off the event loop")
        self.text = text
        self.add_special_tokens = add_special_tokens
        self.share_key = (text if share_key is None else share_key, add_special_tokens)


class PromptTokenizer:
    """Text → token ids for completions (with the tokenizer's special tokens) and for
    rendered chats (the template already holds them)."""

    def __init__(self, tokenizer: Tokenizer, max_cached_tokens: int = 4_000_000) -> None:
        self._tok = tokenizer
        self.max_cached_tokens = max_cached_tokens
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_tokens = 0
        self.hit_tokens = 0  # tokens served from the cache (a counter, never reset)
        # Long texts tokenized in a worker thread, waiting for the pass that asked for them
        # (``TokenizeLater``), by (text, add_special_tokens).
        self._ready: dict[tuple[str, bool], list[int]] = {}
        cut_tokens = {
            token_id: t.content
            for token_id, t in tokenizer.get_added_tokens_decoder().items()
            if t.special and not t.rstrip and not t.single_word and t.content
        }
        self._id_of = {content: token_id for token_id, content in cut_tokens.items()}
        specials = list(cut_tokens.values())
        specials.sort(key=len, reverse=True)
        self._split = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.segmented = (
            self._split is not None
            and not _prepends_to_first_piece_only(json.loads(tokenizer.to_str()))
            and self._segments_are_independent(specials)
        )

    @classmethod
    def from_model_dir(cls, path: Path, max_cached_tokens: int = 4_000_000) -> PromptTokenizer:
        try:
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as exc:  # the library raises its own Exception type
            raise ValueError(f"cannot load {path / 'tokenizer.json'}: {exc}") from exc
        return cls(tok, max_cached_tokens)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    # --- public ------------------------------------------------------------------------

    def encode_full(self, text: str, add_special_tokens: bool) -> list[int]:
        """Uncached tokenization of the whole text (the reference the cache must equal)."""
        return self._encode(text, add_special_tokens)

    def encode_off_loop(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize in any thread: the library's batch call, which releases the GIL (its
        single-text call holds it); touches none of this object's state."""
        ids: list[int] = self._tok.encode_batch(
            [text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    def offer(self, text: str, add_special_tokens: bool, ids: list[int]) -> None:
        """Ids ``encode_off_loop`` made, for the pass that runs next (then ``withdraw``)."""
        self._ready[(text, add_special_tokens)] = ids

    def withdraw(self) -> None:
        """Drop offered ids that the pass did not take."""
        self._ready.clear()

    def _encode(self, text: str, add_special_tokens: bool, defer_chars: int | None = None,
                share_key: str | None = None) -> list[int]:
        if self._ready:
            ready = self._ready.pop((text, add_special_tokens), None)
            if ready is not None:
                return ready
        if defer_chars is not None and len(text) >= defer_chars:
            raise TokenizeLater(text, add_special_tokens, share_key)
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode_completion(self, text: str, defer_chars: int | None = None) -> list[int]:
        """A completion prompt: with the special tokens the tokenizer adds (BOS).
        ``defer_chars``: an uncached text this long raises ``TokenizeLater``."""
        cached = self._lookup(text)
        if cached is not None:
            return list(cached)
        ids = self._encode(text, True, defer_chars)
        self._store(text, ids)
        return ids

    def encode_chat(self, rendered: str, bounds: list[tuple[int, int]] | None = None,
                    defer_chars: int | None = None) -> list[int]:
        """A rendered chat (no special tokens added): cached piece by piece.

        With ``bounds`` given, appends ``(prefix key, tokens so far)`` at every piece boundary:
        equal keys mean equal rendered prefixes, so a caller can cache per-prefix results
        (the gateway caches block hashes that way). ``defer_chars``: an uncached text this
        long raises ``TokenizeLater``.
        """
        if not self.segmented:
            ids = self._lookup(rendered)
            if ids is None:
                ids = self._encode(rendered, False, defer_chars)
                self._store(rendered, ids)
            if bounds is not None:
                bounds.append((hash(rendered), len(ids)))
            return list(ids)
        pieces, ends, open_tail = self._pieces(rendered)
        out: list[int] = []
        key = 0
        for k, piece in enumerate(pieces):
            hit = self._lookup(piece)
            if hit is None:  # tokenize the rest in one call, from this safe cut point
                tail = self._encode_tail(pieces[k:], ends[k:], open_tail, defer_chars)
                if bounds is not None:
                    base = len(out)
                    for piece_k, end in tail[1]:
                        key = hash((key, piece_k))
                        bounds.append((key, base + end))
                out += tail[0]
                break
            out += hit
            if bounds is not None:
                key = hash((key, piece))
                bounds.append((key, len(out)))
        return out

    def clear_cache(self) -> None:
        self._cache.clear()
        self._cached_tokens = 0

    # --- internals ---------------------------------------------------------------------

    def _pieces(self, text: str) -> tuple[list[str], list[str], bool]:
        """Cut after every special token: the pieces, the special token that ends each closed
        piece, and True if the last piece ends without one."""
        pieces, ends, start = [], [], 0
        for match in self._split.finditer(text):  # type: ignore[union-attr]
            pieces.append(text[start : match.end()])
            ends.append(match.group())
            start = match.end()
        if start < len(text):
            pieces.append(text[start:])
            return pieces, ends, True
        return pieces, ends, False

    def _encode_tail(
        self, pieces: list[str], ends: list[str], open_tail: bool, defer_chars: int | None
    ) -> tuple[list[int], list[tuple[str, int]]]:
        """Tokenize pieces as one text (one library call, cheaper than a batch of small ones),
        then cut the ids after each special token to cache every piece. Returns the ids and
        (piece, end offset in the ids) for every piece that could be cut out."""
        text, share = "".join(pieces), None
        if defer_chars is not None and len(text) >= defer_chars:
            # the piece that made it long (the first uncached one is often a role header)
            share = max((p for p in pieces if p not in self._cache), key=len)
        ids = self._encode(text, False, defer_chars, share)
        wanted = [self._id_of[content] for content in ends]
        # The cut tokens must appear exactly where the text has them, and nowhere else.
        if sum(ids.count(t) for t in set(wanted)) != len(wanted):
            return ids, []  # an unexpected special-token layout: correct, just not cached
        cuts, pos = [], 0
        for token_id in wanted:
            pos = ids.index(token_id, pos) + 1
            cuts.append(pos)
        if open_tail:
            cuts.append(len(ids))
        start = 0
        for piece, end in zip(pieces, cuts, strict=True):
            self._store(piece, ids[start:end])
            start = end
        return ids, list(zip(pieces, cuts, strict=True))

    def _lookup(self, key: str) -> list[int] | None:
        ids = self._cache.get(key)
        if ids is not None:
            self._cache.move_to_end(key)
            self.hit_tokens += len(ids)
        return ids

    def _store(self, key: str, ids: list[int]) -> None:
        if len(ids) > self.max_cached_tokens // 4:
            return
        old = self._cache.pop(key, None)
        if old is not None:
            self._cached_tokens -= len(old)
        self._cache[key] = ids
        self._cached_tokens += len(ids)
        while self._cached_tokens > self.max_cached_tokens:
            _, evicted = self._cache.popitem(last=False)
            self._cached_tokens -= len(evicted)

    def _segments_are_independent(self, specials: list[str]) -> bool:
        marks = [*specials, specials[0], specials[0]][:3]
        probe = _PROBE.format(s0=marks[0], s1=marks[1], s2=marks[2])
        whole = self.encode_full(probe, False)
        joined: list[int] = []
        for piece in self._pieces(probe)[0]:
            joined += self.encode_full(piece, False)
        return whole == joined
