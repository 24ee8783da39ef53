"""The torch decoder: seeded weights, and paged prefill/decode agree with each other."""

from __future__ import annotations

import torch

from refengine.model import LlamaModel
from refengine.presets import ModelConfig
from refengine.torch_compute import TorchKVStore

CFG = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    max_position_embeddings=256,
)
P = 4


def _slots(pages: list[int], start: int, end: int) -> torch.Tensor:
    pos = torch.arange(start, end)
    return torch.tensor(pages)[pos // P] * P + pos % P


def _prefill(
    model: LlamaModel, kv: TorchKVStore, tokens: list[int], pages: list[int], chunk: int
) -> torch.Tensor:
    logits = None
    for s in range(0, len(tokens), chunk):
        e = min(len(tokens), s + chunk)
        logits = model.prefill(
            torch.tensor(tokens[s:e]),
            s,
            _slots(pages, s, e),
            _slots(pages, 0, e),
            k_cache=kv.k_cache,
            v_cache=kv.v_cache,
        )
    assert logits is not None
    return logits


def test_same_seed_same_weights() -> None:
    """Two models from one config hold identical weights; another seed differs."""
    a, b = LlamaModel(CFG), LlamaModel(CFG)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    from dataclasses import replace

    c = LlamaModel(replace(CFG, seed=1))
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_chunked_prefill_matches_one_shot() -> None:
    """Prefill in chunks over scattered pages gives the logits of a one-shot prefill."""
    model = LlamaModel(CFG)
    tokens = list(range(3, 3 + 21))
    kv1, kv2 = TorchKVStore(CFG, 16, P), TorchKVStore(CFG, 16, P)
    one = _prefill(model, kv1, tokens, list(range(6)), chunk=64)
    chunked = _prefill(model, kv2, tokens, [9, 2, 14, 5, 0, 11], chunk=5)
    torch.testing.assert_close(one, chunked, rtol=1e-4, atol=1e-4)


def test_decode_continues_prefill_consistently() -> None:
    """A decode step on top of a prefix equals prefilling the longer sequence."""
    model = LlamaModel(CFG)
    tokens = list(range(10, 30))
    pages = [0, 1, 2, 3, 4, 5]
    kv = TorchKVStore(CFG, 8, P)
    _prefill(model, kv, tokens[:-1], pages, chunk=8)
    n = len(tokens)
    ctx = _slots(pages, 0, n).unsqueeze(0)
    logits = model.decode(
        torch.tensor([tokens[-1]]),
        torch.tensor([n - 1]),
        ctx[:, -1],
        ctx,
        torch.tensor([n]),
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
    )[0]
    ref = _prefill(model, TorchKVStore(CFG, 8, P), tokens, pages, chunk=64)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_batched_decode_equals_single() -> None:
    """Padding in a decode batch does not change a request's logits."""
    model = LlamaModel(CFG)
    kv = TorchKVStore(CFG, 16, P)
    a, b = list(range(5, 18)), list(range(40, 47))
    pa, pb = [0, 1, 2, 3], [8, 9]
    _prefill(model, kv, a, pa, 64)
    _prefill(model, kv, b, pb, 64)
    width = len(a) + 1
    ctx = torch.zeros((2, width), dtype=torch.long)
    ctx[0] = _slots(pa, 0, len(a) + 1)
    ctx[1, : len(b) + 1] = _slots(pb, 0, len(b) + 1)
    pos = torch.tensor([len(a), len(b)])
    both = model.decode(
        torch.tensor([1, 2]),
        pos,
        ctx[torch.arange(2), pos],
        ctx,
        pos + 1,
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
    )
    single = model.decode(
        torch.tensor([2]),
        pos[1:],
        ctx[1:, len(b)],
        ctx[1:, : len(b) + 1],
        pos[1:] + 1,
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
    )
    torch.testing.assert_close(both[1], single[0], rtol=1e-4, atol=1e-4)


def test_kv_store_page_round_trip() -> None:
    """read_pages / write_pages move a page's K and V bytes unchanged."""
    kv = TorchKVStore(CFG, 8, P)
    kv.kv.copy_(torch.randn(kv.kv.shape))
    data = kv.read_pages([3, 5])
    other = TorchKVStore(CFG, 8, P)
    other.write_pages([1, 6], data)
    torch.testing.assert_close(other.read_pages([1, 6]), data, rtol=0, atol=0)
    assert torch.equal(other.k_cache[1][6], kv.k_cache[1][5])


def test_presets_and_kv_bytes() -> None:
    """The kv-heavy preset has Llama-3-8B's 128 KiB of KV per token."""
    assert CFG.with_preset("kv-heavy").kv_bytes_per_token == 128 * 1024
    assert CFG.with_preset("tiny").kv_bytes_per_token == 4 * 2 * 2 * 32 * 4
