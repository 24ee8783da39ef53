"""Generate the reference engine's default model directory, deterministically, with no download.

Writes ``tokenizer.json`` (a byte-level BPE trained with the ``tokenizers`` library on a fixed
built-in corpus), ``tokenizer_config.json`` (special tokens and a Llama-3-style
``chat_template``) and ``config.json`` (HF Llama field names plus ``refengine.seed``; the
weights are drawn from that seed at start-up). Run it again and the files come out identical.

    python scripts/make_tiny_model.py [--out refengine/models/tiny] [--vocab-size 1024]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

_WORDS = (  # noqa: SIM905 - a paragraph reads better than 110 quoted words
    "the a an of to in and is that for on with as by at from it this be are was or "
    "which cache block prefix token tokens request requests engine engines replica "
    "replicas memory shared page pages hash chain router gateway sidecar decode "
    "prefill latency throughput model layer layers attention head heads key value "
    "keys values batch batches queue time system user assistant please answer "
    "question explain summary document context window first second third last next "
    "previous number numbers one two three four five six seven eight nine ten "
    "hundred thousand million data event events stream streams store stored removed "
    "cleared tier host disk remote load loaded compute computed hit miss evict"
).split()


def corpus(lines: int = 4000) -> list[str]:
    """A fixed pseudo-text: a linear congruential walk over the word list, plus digits."""
    state, out = 12345, []
    for i in range(lines):
        words = []
        for _ in range(12):
            state = (1103515245 * state + 12345) % (1 << 31)
            words.append(_WORDS[state % len(_WORDS)])
        out.append(" ".join(words).capitalize() + f". Item {i}, value {state % 997}!")
    out.append("".join(chr(c) for c in range(32, 127)))
    return out


def build(out: Path, vocab_size: int) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    vocab = tok.get_vocab_size()
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "pad_token": "<|pad|>",
                "add_bos_token": False,
                "model_max_length": 8192,
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
        + "\n"
    )
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": vocab,
                "hidden_size": 256,
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "intermediate_size": 688,
                "rope_theta": 10000.0,
                "rms_norm_eps": 1e-5,
                "max_position_embeddings": 8192,
                "torch_dtype": "float32",
                "bos_token_id": tok.token_to_id("<|begin_of_text|>"),
                "eos_token_id": tok.token_to_id("<|eot_id|>"),
                "refengine": {"seed": 0, "preset": "tiny"},
            },
            indent=2,
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(__file__).resolve().parent.parent / "refengine" / "models" / "tiny"
    parser.add_argument("--out", type=Path, default=default, help="output directory")
    parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size")
    args = parser.parse_args(argv)
    build(args.out, args.vocab_size)
    print(f"wrote {args.out}/{{tokenizer.json,tokenizer_config.json,config.json}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
