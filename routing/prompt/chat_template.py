"""Chat templates rendered the way ``transformers``' ``apply_chat_template`` renders them.

Same Jinja environment as transformers (``_compile_jinja_template``): a sandboxed, immutable
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, the
``{% generation %}`` tag, a ``tojson`` filter that does not escape HTML, and the globals
``raise_exception`` and ``strftime_now``. Rendered with ``messages``, ``add_generation_prompt``,
``tools``/``documents`` and the special tokens of ``tokenizer_config.json`` (``bos_token``,
``eos_token``, ...), plus any ``chat_template_kwargs`` the request brings.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError"]

_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The template could not be loaded or rejected the conversation."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(Extension):
    """``{% generation %}…{% endgeneration %}`` marks assistant text; rendering keeps it."""

    tags = {"generation"}  # noqa: RUF012 (jinja's API)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [])
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens)

    @classmethod
    def from_model_dir(cls, path: Path) -> ChatTemplate | None:
        """The template of a model directory (None if it has none).

        Looks, like transformers, at ``chat_template.jinja``, then ``chat_template.json``,
        then ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
        templates of which ``default`` is used).
        """
        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.is_file():
            config = json.loads(config_file.read_text())
        special = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k)))}
        source: Any = None
        if (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        elif (path / "chat_template.json").is_file():
            source = json.loads((path / "chat_template.json").read_text()).get("chat_template")
        else:
            source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ChatTemplateError(f"{config_file}: chat_template is not a string")
        return cls(source, special)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation; ``ChatTemplateError`` if the template refuses."""
        kwargs: dict[str, Any] = dict(self.special_tokens)
        if extra:
            kwargs.update(extra)
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template rejected the conversation: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the chat template failed on this conversation: {exc}"
            ) from exc
