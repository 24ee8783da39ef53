"""A streamed reply's text holds no half character: the tokens whose bytes do not yet make
whole characters wait for the token that completes them, as SGLang's and vLLM's
detokenizers do. The text the client has is then always the decoding of a prefix of the
output ids, the point a stream migrated to another engine resumes from."""

from __future__ import annotations

from refengine.http_common import output_text
from refengine.request import FinishReason, Request, SamplingParams
from refengine.tokenizer import DEFAULT_MODEL_PATH, ChatTokenizer

TOKENIZER = ChatTokenizer.from_model_path(DEFAULT_MODEL_PATH)


def test_a_character_split_across_tokens_is_streamed_whole() -> None:
    """"好" is three byte tokens in the tiny model: no step shows one or two of them as
    U+FFFD, every step's text extends the last one's, and it is the decoding of the ids
    up to some step; the finished reply is all of it."""
    ids = TOKENIZER.encode("688 好 e")
    assert [TOKENIZER.decode([i]) for i in ids[3:6]] == ["\ufffd"] * 3  # the premise
    req = Request("r", [1], SamplingParams())
    prefixes = {TOKENIZER.decode(ids[:k]) for k in range(len(ids) + 1)}
    shown = ""
    for k in range(1, len(ids) + 1):
        req.output_ids = ids[:k]
        text = output_text(TOKENIZER, req)
        assert "\ufffd" not in text and text.startswith(shown) and text in prefixes, (k, text)
        shown = text
    assert shown == "688 好 e"
    req.output_ids = ids[:5]  # the reply ends inside the character: its bytes are all shown
    req.finish = FinishReason("length", length=5)
    assert output_text(TOKENIZER, req) == "688 \ufffd"
