"""The simulated-compute timing model (``--compute sim``): how long a step would take on a
GPU, with no math done. All costs are divided by ``--speedup``. Two shapes (``--sim-model``):

``linear`` (the default, its terms the ``--sim-*`` flags):

* prefill step: ``prefill_base + Σ_chunks (per_token × new_tokens
  + attn_per_token_ctx × new_tokens × context_after_chunk)`` — linear in uncached tokens plus
  the attention term that grows with context;
* decode step: ``decode_base + per_seq × batch + per_ctx_token × Σ context lengths`` — a fixed
  kernel-launch floor, per-sequence work, and KV reads that grow with context;
* host-tier load: ``load_per_page × pages``;
* a mixed step (``--enable-mixed-chunk``): its prefill part plus its decode part.

``mocker``: the polynomial of Dynamo 1.6.1's mocker (``PerfModel::Polynomial`` in
``lib/mocker/src/common/perf_model.rs``, timed per pass as its vLLM scheduler does), so a
simulated fleet and a mocker fleet of the same size serve at the same speed:

* a step's prefill part, over ``T`` prompt tokens computed in it:
  ``4.209989e-7 T² + 1.518344e-2 T + 16.50142`` ms (none when ``T`` is 0);
* its decode part, when the step yields any token (a decoding request, or a chunk that
  completes its prompt): ``max(1, -25.74 p² + 54.01 p + 5.74)`` ms, where ``p`` is the tokens
  those requests attend over (each one's whole context so far, exact tokens, not pages),
  summed, over the pool's tokens, and at most 1. A prefix shared by several requests counts
  once per request, so ``p`` reaches 1 when many share one. Measured on the mocker itself
  (``scripts/probe_step_price.py``; a pool of 64 blocks, where one block moves a step by
  ~0.8 ms): one stream's step grows token by token, not by block; two or three streams
  sharing a 288-token prefix step as unshared ones (29.46 and 33.76 ms; the polynomial at
  the summed contexts: 29.45 and 33.75, at the pages held: 21.3 and 22.4); and 8 streams on
  a 1,000-token prefix, contexts summing to twice a 4,096-token pool, step 34.01 ms, the
  polynomial at 1 (at 2: 10.0). Decode cost follows the KV read, not batch size: the
  mocker's model, whatever one thinks of it.

Steps run one at a time on a replica, so a step's prefill delays every running decode: the
interference disaggregation removes. The linear defaults are the order of magnitude of an 8B
model on one datacenter GPU (about 20k prefill tokens/s, ~10 ms decode steps).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvcore.options import check_bounds, option

__all__ = ["SIM_GROUP", "SimModel", "SimTiming", "TimingModel"]


class SimModel(enum.Enum):
    """The shape of the simulated step durations (``--sim-model``)."""

    LINEAR = "linear"
    MOCKER = "mocker"


@dataclass(frozen=True, slots=True)
class TimingModel:
    prefill_base_s: float = 0.002
    prefill_per_token_s: float = 50e-6
    prefill_attn_per_token_ctx_s: float = 2e-9
    decode_base_s: float = 0.008
    decode_per_seq_s: float = 0.0002
    decode_per_ctx_token_s: float = 2e-8
    load_per_page_s: float = 20e-6
    speedup: float = 1.0
    shape: SimModel = SimModel.LINEAR

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError(f"--speedup must be > 0, got {self.speedup}")

    def prefill(self, chunks: Sequence[tuple[int, int]]) -> float:
        """``chunks``: (new tokens, context length after the chunk) per request."""
        t = self.prefill_base_s
        for new, ctx in chunks:
            t += self.prefill_per_token_s * new + self.prefill_attn_per_token_ctx_s * new * ctx
        return t / self.speedup

    def decode(self, context_lens: Sequence[int]) -> float:
        t = (
            self.decode_base_s
            + self.decode_per_seq_s * len(context_lens)
            + self.decode_per_ctx_token_s * sum(context_lens)
        )
        return t / self.speedup

    def step(
        self, prefill: Sequence[tuple[int, int]], decode: Sequence[int], *, yields: bool,
        kv_attended: float,
    ) -> float:
        """One scheduler step: ``prefill`` its chunks (new tokens, context after), ``decode``
        its decode batch's context lengths; ``yields``: the step produces a token (a decode
        batch, or a chunk completing its prompt); ``kv_attended``: the contexts of the
        requests that yield a token, summed, over the pool's tokens (``Step.kv_attended``)."""
        before, after = self.step_parts(prefill, decode, yields=yields, kv_attended=kv_attended)
        return before + after

    def step_parts(
        self, prefill: Sequence[tuple[int, int]], decode: Sequence[int], *, yields: bool,
        kv_attended: float,
    ) -> tuple[float, float]:
        """:meth:`step`'s duration in two parts: until its tokens leave, and after. The
        linear model's tokens leave at the step's end; the mocker's after its prefill part,
        before its decode part (measured: a 3,000-token prompt's first token came 70.4 ms
        after it was sent, the prefill part 65.8 ms; its second 14.4 ms later, the first
        pass's decode part 14.8 ms), so a prompt's first token never waits for the decode
        of the step that completes it."""
        if self.shape is SimModel.MOCKER:
            before = _mocker_prefill_s(sum(new for new, _ in prefill))
            after = _mocker_decode_s(kv_attended) if yields else 0.0
            return before / self.speedup, after / self.speedup
        took = self.prefill(prefill) if prefill else 0.0
        return took + (self.decode(decode) if decode else 0.0), 0.0

    def load(self, pages: int) -> float:
        return self.load_per_page_s * pages / self.speedup


def _mocker_prefill_s(new_tokens: int) -> float:
    """Dynamo 1.6.1's mocker: a pass's prefill part in seconds at speedup 1, for its
    ``new_tokens`` prompt tokens (see the module's docstring for the source)."""
    if new_tokens <= 0:
        return 0.0
    t = float(new_tokens)
    return (4.209989e-07 * t * t + 1.518344e-02 * t + 1.650142e01) / 1e3


def _mocker_decode_s(kv: float) -> float:
    """Its decode part, for a pass that yields tokens: by the KV read, at most the pool."""
    kv = min(kv, 1.0)
    return max(1.0, -25.74 * kv * kv + 54.01 * kv + 5.74) / 1e3


_DEFAULT = TimingModel()
SIM_GROUP = "simulated timing (the engine's --compute sim)"  # the --sim-* flags' in --help


@dataclass(frozen=True, slots=True)
class SimTiming:
    """The ``--sim-*`` flags of the engine and of offline replay, one declaration for both:
    ``TimingModel``'s main terms in the units its users think in; the others keep their
    defaults."""

    sim_prefill_base_ms: float = option(
        _DEFAULT.prefill_base_s * 1e3, group=SIM_GROUP, ge=0, help="per prefill step")
    sim_prefill_us_per_token: float = option(
        _DEFAULT.prefill_per_token_s * 1e6, group=SIM_GROUP, ge=0, help="per uncached prompt token")
    sim_decode_base_ms: float = option(
        _DEFAULT.decode_base_s * 1e3, group=SIM_GROUP, ge=0, help="per decode step")
    sim_decode_us_per_seq: float = option(
        _DEFAULT.decode_per_seq_s * 1e6, group=SIM_GROUP, ge=0,
        help="per sequence in a decode step")

    def __post_init__(self) -> None:
        check_bounds(self)

    def model(self, speedup: float = 1.0) -> TimingModel:
        """The timing model these flags give, every duration divided by ``speedup``."""
        return replace(
            _DEFAULT,
            prefill_base_s=self.sim_prefill_base_ms / 1e3,
            prefill_per_token_s=self.sim_prefill_us_per_token / 1e6,
            decode_base_s=self.sim_decode_base_ms / 1e3,
            decode_per_seq_s=self.sim_decode_us_per_seq / 1e6,
            speedup=speedup,
        )
