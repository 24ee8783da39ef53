"""Chat templates render with transformers' apply_chat_template semantics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from routing.prompt.chat_template import ChatTemplate, ChatTemplateError

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def test_llama3_template_renders_like_transformers(tiny_model_dir: Path) -> None:
    """Llama 3's template gives the exact text transformers produces for it."""
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert template is not None
    text = template.render(
        [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}]
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    no_prompt = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert no_prompt.endswith("Hi<|eot_id|>")


def test_trim_and_lstrip_blocks() -> None:
    """Block tags eat their own line's indentation and the newline after them."""
    source = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
        "{% endif %}\n{% endfor %}"
    )
    template = ChatTemplate(source, SPECIAL)
    assert template.render(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    ) == ("[a]\n[b]\n")


def test_tojson_keeps_non_ascii_and_takes_indent() -> None:
    """tojson is json.dumps with ensure_ascii=False (HTML is not escaped) and takes indent."""
    template = ChatTemplate("{{ messages[0] | tojson }}|{{ {'a': 1} | tojson(indent=2) }}", {})
    out = template.render([{"role": "user", "content": "héllo <b>"}])
    assert out == '{"role": "user", "content": "héllo <b>"}|' + json.dumps({"a": 1}, indent=2)


def test_raise_exception_becomes_template_error() -> None:
    """raise_exception in a template rejects the conversation with its message."""
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}"
        "{% endif %}ok",
        SPECIAL,
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_special_tokens_loopcontrols_and_generation_tag() -> None:
    """bos/eos tokens are variables; break/continue and {% generation %} work."""
    template = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}{{ eos_token }}",
        SPECIAL,
    )
    out = template.render([{"role": "user", "content": c} for c in "abc"])
    assert out == "<s>ab</s>"


def test_template_sources_in_order(tmp_path: Path) -> None:
    """chat_template.jinja wins over tokenizer_config.json; named lists use 'default'."""
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "default", "template": "D"},
                    {"name": "tool_use", "template": "T"},
                ]
            }
        )
    )
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template is not None and template.render([]) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template is not None and template.render([]) == "J"


def test_bad_template_is_a_clear_error() -> None:
    """A template that does not compile fails at load time, naming the problem."""
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", SPECIAL)


def test_sandbox_blocks_attribute_tricks() -> None:
    """The sandbox refuses access to Python internals from a template."""
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", SPECIAL)
    with pytest.raises(ChatTemplateError):
        template.render([])
