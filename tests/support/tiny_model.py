"""A tiny Llama-3-style model directory for gateway tests: a byte-level BPE tokenizer trained
in-process with the ``tokenizers`` library, Llama 3's special tokens and chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

# Meta-Llama-3-8B-Instruct's chat template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. You are a helpful assistant.",
    "Hello world! How can I help you today? Please answer briefly and precisely.",
    "KV cache blocks, prefix caching, routers and gateways serve large language models.",
    "def main():\n    return 0\n\nif __name__ == '__main__':\n    main()\n",
    "Numbers 0123456789 and punctuation ,.;:!? (parentheses) [brackets] {braces}.",
] * 20


def build_tokenizer(vocab_size: int = 600) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    from tokenizers.processors import TemplateProcessing

    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    return tok


def write_model_dir(
    path: Path, max_position_embeddings: int = 2048, template: str = LLAMA3_TEMPLATE
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "chat_template": template,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (path / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": max_position_embeddings})
    )
    return path
