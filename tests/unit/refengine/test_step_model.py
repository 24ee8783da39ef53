"""The step model: mixed steps (``--enable-mixed-chunk``) under the batched-token budget, and
their durations, linear or Dynamo's mocker's (``--sim-model``), on a virtual clock."""

from __future__ import annotations

import asyncio

import pytest

from refengine.executor import SimExecutor
from refengine.kv_events import EventRecorder
from refengine.kv_pool import PageAllocator
from refengine.model import LlamaModel
from refengine.prefix_cache import PrefixCache
from refengine.presets import ModelConfig
from refengine.request import Phase, Request, SamplingParams
from refengine.scheduler import Scheduler, Step, StepKind
from refengine.timing import SimModel, TimingModel
from refengine.torch_compute import TorchExecutor, TorchKVStore

P = 4


def _sched(pages: int = 64, chunk: int = 8, mixed: bool = True) -> Scheduler:
    cache = PrefixCache(P, PageAllocator(pages), EventRecorder(False))
    return Scheduler(cache, chunk, 16, eos_token_id=None, mixed_chunk=mixed)


def _req(rid: str, prompt: list[int], new: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=new, temperature=0))


def _complete(s: Scheduler, step: Step, token: int = 7) -> None:
    for c in step.prefill:
        s.complete_prefill(c, token if c.completes_prompt else None)
    s.complete_decode(step.decode, [token] * len(step.decode))


def _shape(step: Step) -> tuple[StepKind, list[tuple[str, int]], list[str]]:
    return (step.kind, [(c.req.rid, c.end - c.start) for c in step.prefill],
            [r.rid for r in step.decode])


def test_mixed_steps_run_every_decode_and_chunks_up_to_the_budget() -> None:
    """With chunk 8: a decoding request takes one token of each step's budget, a prompt's
    chunks the rest; the request whose prompt completes decodes from the next step on."""
    s = _sched()
    a, b = _req("a", [1, 2], new=10), _req("b", list(range(16)), new=3)
    s.add(a)
    s.add(b)
    s.admit()
    shapes = []
    for _ in range(4):
        step = s.next_step()
        assert step is not None
        shapes.append(_shape(step))
        _complete(s, step)
    assert shapes == [
        (StepKind.PREFILL, [("a", 2), ("b", 6)], []),
        (StepKind.MIXED, [("b", 7)], ["a"]),
        (StepKind.MIXED, [("b", 3)], ["a"]),
        (StepKind.DECODE, [], ["a", "b"]),
    ]
    assert b.phase is Phase.DECODE and len(b.output_ids) == 2 and len(a.output_ids) == 4


def test_without_mixing_prefill_and_decode_steps_alternate() -> None:
    """The default (SGLang's): the same two requests alternate whole prefill and decode steps."""
    s = _sched(mixed=False)
    s.add(_req("a", [1, 2], new=10))
    s.add(_req("b", list(range(16)), new=3))
    s.admit()
    kinds = []
    for _ in range(4):
        step = s.next_step()
        assert step is not None
        kinds.append(step.kind)
        _complete(s, step)
    assert kinds == [StepKind.PREFILL, StepKind.DECODE, StepKind.PREFILL, StepKind.DECODE]


def test_more_decodes_than_the_budget_leave_no_room_for_chunks() -> None:
    """A decode batch as large as the budget runs alone; the prompt waits for room."""
    s = _sched(chunk=2)
    for rid in ("a", "b"):
        s.add(_req(rid, [1], new=5))
    s.admit()
    step = s.next_step()
    assert step is not None
    _complete(s, step)
    s.add(_req("c", list(range(8)), new=1))
    s.admit()
    step = s.next_step()
    assert step is not None and _shape(step) == (StepKind.DECODE, [], ["a", "b"])


def test_a_step_carries_the_kv_its_yielding_requests_attend_over() -> None:
    """kv_attended: the contexts of the requests that yield a token, summed, over the pool's
    tokens (the mocker's decode argument): exact tokens, not pages, and a shared prefix once
    per request that reads it."""
    s = _sched(pages=16, chunk=64)  # 16 pages of 4 tokens: 64 tokens
    s.add(_req("a", list(range(10)), new=2))
    s.admit()
    step = s.next_step()  # the prompt's chunk completes it: its first token comes from here
    assert step is not None and step.kv_attended == pytest.approx(10 / 64)
    _complete(s, step)
    step = s.next_step()
    assert step is not None and step.kind is StepKind.DECODE
    assert step.kv_attended == pytest.approx(11 / 64)


def test_a_shared_prefix_counts_once_per_request_that_reads_it() -> None:
    s = _sched(pages=16, chunk=64)
    s.add(_req("a", list(range(8)), new=4))
    s.admit()
    step = s.next_step()
    assert step is not None
    _complete(s, step)
    s.add(_req("b", [*range(8), 99], new=4))  # two pages cached, one token computed
    s.admit()
    step = s.next_step()
    assert step is not None and _shape(step) == (StepKind.MIXED, [("b", 1)], ["a"])
    assert step.kv_attended == pytest.approx((9 + 9) / 64)


def test_a_chunk_that_leaves_its_prompt_unfinished_is_not_attended() -> None:
    s = _sched(pages=16, chunk=4)
    s.add(_req("a", list(range(10)), new=1))
    s.admit()
    step = s.next_step()
    assert step is not None and not step.yields_tokens and step.kv_attended == 0.0


def _mocker_ms(new: int, yields: bool, kv: float) -> float:
    prefill = 4.209989e-07 * new**2 + 1.518344e-02 * new + 16.50142 if new else 0.0
    return prefill + (-25.74 * kv**2 + 54.01 * kv + 5.74 if yields else 0.0)


def test_mocker_timing_is_the_mockers_polynomial() -> None:
    """Dynamo 1.6.1's mocker: prefill by the step's prompt tokens, decode by the KV read,
    the two summed in a mixed step; a chunk that yields no token has no decode part."""
    t = TimingModel(shape=SimModel.MOCKER)
    chunk_only = t.step([(4000, 4000)], [], yields=False, kv_attended=0.3)
    assert chunk_only * 1e3 == pytest.approx(_mocker_ms(4000, False, 0.3))
    decode_only = t.step([], [5000] * 16, yields=True, kv_attended=0.25)
    assert decode_only * 1e3 == pytest.approx(_mocker_ms(0, True, 0.25))
    mixed = t.step([(64, 4064), (64, 4064)], [4100] * 16, yields=True, kv_attended=0.25)
    assert mixed * 1e3 == pytest.approx(_mocker_ms(128, True, 0.25))
    # the batch size does not matter to the mocker's decode, the KV it reads does
    assert t.step([], [100], yields=True, kv_attended=0.25) == pytest.approx(decode_only)
    assert t.step([], [100], yields=True, kv_attended=0.9) > decode_only
    # the mocker takes the KV read at most at the pool's size: many readers of one prefix
    # price as a full pool, not past the polynomial's vertex
    full = t.step([], [100], yields=True, kv_attended=1.0)
    assert t.step([], [100], yields=True, kv_attended=2.0) == pytest.approx(full)
    assert full * 1e3 == pytest.approx(_mocker_ms(0, True, 1.0))
    slow = TimingModel(shape=SimModel.MOCKER, speedup=0.25)
    assert slow.step([(64, 64)], [9], yields=True, kv_attended=0.1) == pytest.approx(
        4 * t.step([(64, 64)], [9], yields=True, kv_attended=0.1))


def test_linear_timing_of_a_mixed_step_is_its_two_parts() -> None:
    """The linear model prices a mixed step as its prefill step plus its decode step, and a
    pure step exactly as before."""
    t = TimingModel()
    chunks, contexts = [(512, 1024)], [300, 400]
    assert t.step(chunks, [], yields=False, kv_attended=0.5) == t.prefill(chunks)
    assert t.step([], contexts, yields=True, kv_attended=0.5) == t.decode(contexts)
    assert t.step(chunks, contexts, yields=True, kv_attended=0.5) == pytest.approx(
        t.prefill(chunks) + t.decode(contexts))


def test_the_sim_executor_runs_a_mixed_step_as_one_timed_step() -> None:
    """On a virtual clock (the executor's busy time), the three requests' steps take exactly
    the mocker's durations, and every request gets its tokens."""
    timing = TimingModel(shape=SimModel.MOCKER, speedup=1e6)  # sleeps of nanoseconds
    executor = SimExecutor(timing, [11, 12], [13, 14])
    s = _sched(chunk=8)
    reqs = [_req("a", [1, 2], new=4), _req("b", list(range(16)), new=3)]
    for r in reqs:
        s.add(r)
    expected = 0.0

    async def drive() -> None:
        nonlocal expected
        s.admit()
        while (step := s.next_step()) is not None:
            new = sum(c.end - c.start for c in step.prefill)
            expected += _mocker_ms(new, step.yields_tokens, step.kv_attended) / 1e3 / 1e6
            first, decoded = await executor.run(step)
            assert len(first) == len(step.prefill) and len(decoded) == len(step.decode)
            for c, tok in zip(step.prefill, first, strict=True):
                s.complete_prefill(c, tok)
            s.complete_decode(step.decode, decoded)

    asyncio.run(drive())
    assert executor.busy_s == pytest.approx(expected)
    assert [len(r.output_ids) for r in reqs] == [4, 3]
    assert all(r.phase is Phase.FINISHED for r in reqs)


def _torch_outputs(mixed: bool) -> list[list[int]]:
    cfg = ModelConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=96, max_position_embeddings=256)
    executor = TorchExecutor(LlamaModel(cfg), TorchKVStore(cfg, 64, P), cfg.vocab_size)
    s = _sched(chunk=8, mixed=mixed)
    reqs = [_req("a", [5, 9], new=6), _req("b", [(i * 37 + 3) % 128 for i in range(21)], new=4)]
    for r in reqs:
        s.add(r)

    async def drive() -> None:
        s.admit()
        while (step := s.next_step()) is not None:
            first, decoded = await executor.run(step)
            for c, tok in zip(step.prefill, first, strict=True):
                s.complete_prefill(c, tok)
            s.complete_decode(step.decode, decoded)

    asyncio.run(drive())
    return [r.output_ids for r in reqs]


def test_torch_greedy_output_is_the_same_mixed_or_alternating() -> None:
    """A mixed step computes its chunks, then its decode batch, on the real model: greedy
    tokens are those of alternating steps."""
    assert _torch_outputs(mixed=True) == _torch_outputs(mixed=False)


def test_requests_sharing_a_prefix_in_flight_compute_it_once() -> None:
    """With share_in_flight, two requests admitted together with a common 16-token prefix:
    the second waits while the first computes it, then reuses those pages from the cache."""
    s = _sched(chunk=64)
    s.share_in_flight = True
    prefix = list(range(100, 116))  # 4 pages
    a, b = _req("a", [*prefix, 1, 2], new=2), _req("b", [*prefix, 3, 4, 5], new=2)
    s.add(a)
    s.add(b)
    s.admit()
    step = s.next_step()
    assert step is not None and _shape(step) == (StepKind.PREFILL, [("a", 18)], [])
    _complete(s, step)
    step = s.next_step()
    assert step is not None and _shape(step) == (StepKind.MIXED, [("b", 3)], ["a"])
    assert b.cached_tokens_device == 16 and b.pages[:4] == a.pages[:4]
    _complete(s, step)
    while (step := s.next_step()) is not None:
        _complete(s, step)
    assert a.phase is b.phase is Phase.FINISHED and s.reserved == 0
    assert s.cache.allocator.num_free + s.cache.num_evictable == s.cache.allocator.num_pages


def test_without_sharing_both_compute_the_prefix() -> None:
    """The default: both requests' whole prompts go into the first step."""
    s = _sched(chunk=64)
    prefix = list(range(100, 116))
    s.add(_req("a", [*prefix, 1, 2], new=2))
    s.add(_req("b", [*prefix, 3, 4, 5], new=2))
    s.admit()
    step = s.next_step()
    assert step is not None and _shape(step) == (StepKind.PREFILL, [("a", 18), ("b", 19)], [])


def test_a_follower_waits_chunk_by_chunk_behind_the_leader() -> None:
    """A long shared prefix computed in chunks: the follower waits while the leader's chunk
    covers its next page, catches up after each chunk, computes only its own tail."""
    s = _sched(chunk=8, mixed=False)
    s.share_in_flight = True
    prefix = list(range(100, 124))  # 6 pages, 3 chunks of 8
    a, b = _req("a", [*prefix, 1], new=1), _req("b", [*prefix, 2], new=1)
    s.add(a)
    s.add(b)
    s.admit()
    chunks = []
    while (step := s.next_step()) is not None:
        chunks.append([(c.req.rid, c.start, c.end) for c in step.prefill])
        _complete(s, step)
    assert [c for c in chunks if c] == [
        [("a", 0, 8)], [("a", 8, 16)], [("a", 16, 24)], [("a", 24, 25), ("b", 24, 25)]]
    assert b.cached_tokens_device == 24 and a.output_ids and b.output_ids
