"""Tokenizer and chat template from a local model directory (the HF file shapes).

Reads ``tokenizer.json`` with the ``tokenizers`` library and ``tokenizer_config.json`` for the
special tokens and the Jinja ``chat_template``; no ``transformers`` needed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["DEFAULT_MODEL_PATH", "ChatTokenizer"]

DEFAULT_MODEL_PATH = Path(__file__).resolve().parent / "models" / "tiny"


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class ChatTokenizer:
    tokenizer: Tokenizer
    chat_template: jinja2.Template | None
    bos_token: str | None
    eos_token: str | None
    eos_token_id: int | None
    add_bos_token: bool
    vocab_size: int

    @classmethod
    def from_model_path(cls, path: str | Path) -> ChatTokenizer:
        root = Path(path)
        try:
            tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:
            raise ValueError(f"cannot load {root / 'tokenizer.json'}: {exc}") from exc
        cfg_file = root / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        template_src = cfg.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(template_src) if isinstance(template_src, str) else None
        eos = _token_text(cfg.get("eos_token"))
        return cls(
            tokenizer=tok,
            chat_template=template,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=eos,
            eos_token_id=tok.token_to_id(eos) if eos else None,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            vocab_size=tok.get_vocab_size(),
        )

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
        return ids

    def word_token_ids(self) -> tuple[list[int], list[int]]:
        """Ids of whole ASCII words that encode back to themselves: (bare words, space-led
        words). A reply made of a bare word then space-led ones tokenizes to the same ids
        again, leading whitespace trimmed as chat templates do (as a real model's replies
        mostly do), so a simulated reply sent back in a chat's history is a cacheable
        prefix."""
        tok = self.tokenizer
        bare: list[int] = []
        spaced: list[int] = []
        for token_id in range(self.vocab_size):
            text = tok.decode([token_id])
            word = text[1:] if text.startswith(" ") else text
            if (word.isalpha() and word.isascii()
                    and tok.encode(text, add_special_tokens=False).ids == [token_id]):
                (spaced if text.startswith(" ") else bare).append(token_id)
        return bare, spaced

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
    ) -> str:
        """The conversation rendered for generation; ``template_kwargs`` (a request's
        ``chat_template_kwargs``) are extra template variables."""
        if self.chat_template is None:
            raise ValueError("this model directory has no chat_template in tokenizer_config.json")
        return self.chat_template.render(
            {
                **(template_kwargs or {}),
                "messages": messages,
                "add_generation_prompt": True,
                "bos_token": self.bos_token or "",
                "eos_token": self.eos_token or "",
            }
        )
