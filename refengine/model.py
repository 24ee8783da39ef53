"""A Llama-style decoder in torch on CPU: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Weights come from a fixed seed (``ModelConfig.seed``), so every process with the same config
holds the same model and greedy decoding is reproducible across processes. The model reads
and writes K/V in a paged pool owned by :class:`refengine.torch_compute.TorchKVStore`: token slot
``page * page_size + offset`` of per-layer ``[pages, page_size, kv_heads, head_dim]`` views.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from refengine.presets import ModelConfig

__all__ = ["LlamaModel"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.input_norm = _RMSNorm(h, cfg.rms_norm_eps)
        self.qkv = nn.Linear(h, (self.n_heads + 2 * self.n_kv) * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)
        self.post_norm = _RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.qkv(self.input_norm(x))
        q, k, v = qkv.split(
            [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim],
            dim=-1,
        )
        n = x.shape[0]
        return (
            q.view(n, self.n_heads, self.head_dim),
            k.view(n, self.n_kv, self.head_dim),
            v.view(n, self.n_kv, self.head_dim),
        )

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        out: torch.Tensor = self.down(F.silu(gate) * up)
        return out


def _put(pool: torch.Tensor, slots: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` to token slots of a ``[pages, page_size, heads, dim]`` pool view."""
    size = pool.shape[1]
    pool[slots // size, slots % size] = value


def _get(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    size = pool.shape[1]
    return pool[slots // size, slots % size]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; ``x`` is ``[n, heads, dim]``, cos/sin ``[n, dim/2]``."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class LlamaModel(nn.Module):
    """The decoder. ``prefill`` runs one request's chunk, ``decode`` one token per request."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.torch_dtype]
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self._blocks: list[_Layer] = [m for m in self.layers if isinstance(m, _Layer)]
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_weights()
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        )
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float64)
        angles = torch.outer(pos, inv_freq)
        self.register_buffer("rope_cos", angles.cos().to(self.dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(self.dtype), persistent=False)
        self.to(self.dtype)
        self.eval()
        self.requires_grad_(False)

    def _init_weights(self) -> None:
        gen = torch.Generator().manual_seed(self.cfg.seed)
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                continue
            fan_in = p.shape[-1]
            std = 1.0 if name == "embed.weight" else 1.0 / math.sqrt(fan_in)
            if name == "lm_head.weight":
                std *= 3.0  # wider logit gaps: greedy ties are vanishingly rare
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    # -- attention over the paged pool --------------------------------------------------------

    def _attend(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        ctx_slots: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``q``: [B, heads, n, dim]; ``ctx_slots``: [B, T] slot ids; ``mask``: [B, 1, n, T]."""
        k = _get(k_pool, ctx_slots).transpose(1, 2)  # [B, kv, T, dim]
        v = _get(v_pool, ctx_slots).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    @torch.inference_mode()
    def prefill(
        self,
        tokens: torch.Tensor,
        start_pos: int,
        write_slots: torch.Tensor,
        ctx_slots: torch.Tensor,
        *,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """Run ``tokens`` (positions ``start_pos..``) of one request; return last-token logits.

        ``write_slots`` receive this chunk's K/V; ``ctx_slots`` (length ``start_pos + n``) are
        every slot the chunk attends to, the prefix already in the pool followed by the chunk.
        """
        n = tokens.shape[0]
        positions = torch.arange(start_pos, start_pos + n)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        total = ctx_slots.shape[0]
        causal = torch.arange(total).unsqueeze(0) <= positions.unsqueeze(1)  # [n, T]
        mask = causal.view(1, 1, n, total)
        x = self.embed(tokens)
        for i, layer in enumerate(self._blocks):
            q, k, v = layer.split_qkv(x)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            _put(k_cache[i], write_slots, k)
            _put(v_cache[i], write_slots, v)
            out = self._attend(
                q.transpose(0, 1).unsqueeze(0), k_cache[i], v_cache[i], ctx_slots.unsqueeze(0), mask
            )
            x = x + layer.o_proj(out.squeeze(0).transpose(0, 1).reshape(n, -1))
            x = x + layer.mlp(x)
        logits: torch.Tensor = self.lm_head(self.norm(x[-1:])).float()[0]
        return logits

    @torch.inference_mode()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        ctx_slots: torch.Tensor,
        ctx_lens: torch.Tensor,
        *,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """One token for each of B requests; ``ctx_slots`` is [B, T] padded, ``ctx_lens`` [B]."""
        b, total = ctx_slots.shape
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        valid = torch.arange(total).unsqueeze(0) < ctx_lens.unsqueeze(1)  # [B, T]
        mask = valid.view(b, 1, 1, total)
        x = self.embed(tokens)
        for i, layer in enumerate(self._blocks):
            q, k, v = layer.split_qkv(x)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            _put(k_cache[i], write_slots, k)
            _put(v_cache[i], write_slots, v)
            out = self._attend(q.unsqueeze(2), k_cache[i], v_cache[i], ctx_slots, mask)
            x = x + layer.o_proj(out.reshape(b, -1))
            x = x + layer.mlp(x)
        logits: torch.Tensor = self.lm_head(self.norm(x)).float()
        return logits
