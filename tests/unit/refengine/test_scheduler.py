"""Scheduler: reservation-based admission, chunked prefill, decode batching, page release."""

from __future__ import annotations

import pytest

from refengine.kv_events import EventRecorder
from refengine.kv_pool import PageAllocator
from refengine.prefix_cache import PrefixCache
from refengine.request import Phase, Request, SamplingParams
from refengine.scheduler import CapacityError, Scheduler, StepKind

P = 4


def _sched(pages: int = 16, chunk: int = 8, running: int = 8) -> Scheduler:
    cache = PrefixCache(P, PageAllocator(pages), EventRecorder(True))
    return Scheduler(cache, chunk, running, eos_token_id=None)


def _req(rid: str, prompt: list[int], new: int = 2) -> Request:
    return Request(rid, prompt, SamplingParams(max_new_tokens=new, temperature=0))


def _drive(s: Scheduler, token: int = 7) -> list[StepKind]:
    kinds = []
    s.admit()
    while (step := s.next_step()) is not None:
        kinds.append(step.kind)
        if step.kind is StepKind.PREFILL:
            for c in step.prefill:
                s.complete_prefill(c, token if c.completes_prompt else None)
        else:
            s.complete_decode(step.decode, [token] * len(step.decode))
        s.admit()
    return kinds


def test_prompt_is_prefilled_in_chunks_then_decoded() -> None:
    """A 20-token prompt with chunk 8 takes 3 prefill steps, then decode to max_new_tokens."""
    s = _sched()
    r = _req("a", list(range(20)), new=3)
    s.add(r)
    kinds = _drive(s)
    assert kinds == [StepKind.PREFILL] * 3 + [StepKind.DECODE] * 2
    assert r.phase is Phase.FINISHED and r.output_ids == [7, 7, 7]
    assert r.finish is not None and r.finish.kind == "length"


def test_pages_return_to_pool_and_cache_keeps_full_pages() -> None:
    """After finishing, every page is free or cached-unreferenced; full pages stay cached."""
    s = _sched()
    s.add(_req("a", list(range(10)), new=3))
    _drive(s)
    cache = s.cache
    assert cache.allocator.num_free + cache.num_evictable == cache.allocator.num_pages
    assert cache.num_cached == 3  # 10 prompt + 2 computed outputs = 12 tokens = 3 pages
    assert s.reserved == 0


def test_second_request_hits_the_prefix() -> None:
    """A repeat prompt reuses the cached pages and computes only the tail."""
    s = _sched()
    s.add(_req("a", list(range(10))))
    _drive(s)
    r = _req("b", list(range(10)))
    s.add(r)
    s.admit()
    assert r.cached_tokens_device == 8 and r.num_computed == 8


def test_full_hit_still_computes_one_token() -> None:
    """A prompt entirely cached recomputes its last page to get the first logits."""
    s = _sched()
    s.add(_req("a", list(range(8)), new=1))
    _drive(s)
    r = _req("b", list(range(8)), new=1)
    s.add(r)
    s.admit()
    assert r.num_computed == 4
    _drive(s)
    assert r.finish is not None and s.cache.allocator.num_free + s.cache.num_evictable == 16


def test_admission_waits_for_capacity_and_decode_batches() -> None:
    """Requests beyond the pool wait; admitted ones decode in one batch."""
    s = _sched(pages=4, chunk=64)
    reqs = [_req(str(i), [i] * 3, new=5) for i in range(3)]  # 2 pages each
    for r in reqs:
        s.add(r)
    assert len(s.admit()) == 2 and s.num_waiting == 1
    step = s.next_step()
    assert step is not None and step.kind is StepKind.PREFILL and len(step.prefill) == 2
    for c in step.prefill:
        s.complete_prefill(c, 1)
    step = s.next_step()
    assert step is not None and step.kind is StepKind.DECODE and len(step.decode) == 2
    s.complete_decode(step.decode, [1, 1])
    _drive(s)
    assert all(r.phase is Phase.FINISHED for r in reqs)


def test_prefill_and_decode_alternate() -> None:
    """With both kinds of work pending, steps alternate so decode is not starved."""
    s = _sched(pages=64, chunk=4)
    s.add(_req("a", [1, 2], new=10))
    s.admit()
    step = s.next_step()
    assert step is not None
    s.complete_prefill(step.prefill[0], 5)
    s.add(_req("b", list(range(16)), new=1))
    s.admit()
    kinds = [s.next_step().kind for _ in range(4)]  # type: ignore[union-attr]
    assert kinds == [StepKind.DECODE, StepKind.PREFILL, StepKind.DECODE, StepKind.PREFILL]


def test_oversized_request_is_rejected() -> None:
    """A request that could never fit the pool fails at submission with CapacityError."""
    s = _sched(pages=2)
    with pytest.raises(CapacityError, match="max-total-tokens"):
        s.add(_req("a", list(range(20))))


def test_abort_releases_everything() -> None:
    """Aborting mid-prefill frees its pages and reservation."""
    s = _sched(chunk=4)
    r = _req("a", list(range(20)), new=4)
    s.add(r)
    s.admit()
    step = s.next_step()
    assert step is not None
    s.complete_prefill(step.prefill[0], None)
    from refengine.request import FinishReason

    s.finish(r, FinishReason("abort", message="x"))
    assert s.reserved == 0
    assert s.cache.allocator.num_free + s.cache.num_evictable == 16


def test_eos_and_stop_ids_finish_early() -> None:
    """EOS (unless ignore_eos) and stop_token_ids end a request with finish type stop."""
    cache = PrefixCache(P, PageAllocator(16), EventRecorder(False))
    s = Scheduler(cache, 8, 8, eos_token_id=7)
    r = _req("a", [1, 2, 3], new=5)
    s.add(r)
    _drive(s, token=7)
    assert r.finish is not None and r.finish.kind == "stop" and r.output_ids == [7]
    r2 = Request("b", [1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True))
    s.add(r2)
    _drive(s, token=7)
    assert r2.finish is not None and r2.finish.kind == "length" and len(r2.output_ids) == 3
