"""The pure scheduling core: admission, page reservation, chunked prefill, decode batching.

No I/O, no torch, no clock: the engine asks for the next :class:`Step`, runs it, and reports
back. Policy, in SGLang's spirit but without preemption:

* **Admission** is FIFO. A request is admitted when the pool can hold its whole life
  (``ceil((prompt + max_new_tokens) / page_size)`` pages, less the pages its prefix already
  has in the cache); those pages are *reserved*, so a running request never runs out of KV
  and nothing is ever retracted. The head of the queue blocks the rest (no starvation).
* **Prefill** is chunked: one step computes at most ``chunk_size`` prompt tokens, taken from
  admitted requests in order.
* **Decode** batches every running request into one step (continuous batching: requests join
  after their prefill and leave when done). When both kinds of work are pending, steps
  alternate prefill / decode so a long prompt does not stall running requests (SGLang's
  default) or, with ``mixed_chunk`` (SGLang's ``--enable-mixed-chunk``; vLLM's and Dynamo's
  mocker's only way), every step is one batch: each decoding request's next token plus
  prompt chunks up to ``chunk_size`` tokens in all (the decode tokens count against it).
* **Caching**: full pages are inserted into the prefix cache as soon as their KV is computed
  (prompt pages after each chunk, output pages when the request finishes).
* **Prefill in flight** (``share_in_flight``): a request whose next prompt page an earlier
  request's chunk computes in this step skips the step, and takes the page from the cache
  afterwards instead of computing it again (SGLang's in-batch prefix caching; vLLM and
  Dynamo's mocker reach the same by caching blocks as they are scheduled). Without it, hot
  requests that arrive together on a cold replica each compute the whole shared prefix.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from refengine.page_hash import event_salt_seed, page_digests
from refengine.prefix_cache import PrefixCache
from refengine.request import FinishReason, Phase, Request

__all__ = ["CapacityError", "PrefillChunk", "Scheduler", "Step", "StepKind"]


class CapacityError(ValueError):
    """The request can never fit in the KV pool."""


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # prompt chunks and a decode batch in one step (mixed_chunk)


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    req: Request
    start: int
    end: int

    @property
    def completes_prompt(self) -> bool:
        return self.end == len(self.req.prompt)


@dataclass(frozen=True, slots=True)
class Step:
    kind: StepKind
    prefill: tuple[PrefillChunk, ...] = ()
    decode: tuple[Request, ...] = ()
    # The contexts its token-yielding requests attend over, summed, as a fraction of the
    # pool's tokens (Dynamo's mocker prices decode by this, taken at most 1): a shared prefix
    # counts once per request that reads it, so it passes 1 when many requests share one.
    kv_attended: float = 0.0

    @property
    def yields_tokens(self) -> bool:
        """The step produces a token: a decode batch, or a chunk that completes its prompt."""
        return bool(self.decode) or any(c.completes_prompt for c in self.prefill)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(
        self,
        cache: PrefixCache,
        chunk_size: int,
        max_running: int,
        eos_token_id: int | None,
        mixed_chunk: bool = False,
        share_in_flight: bool = False,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunked prefill size must be >= 1, got {chunk_size}")
        self.cache = cache
        self.page_size = cache.page_size
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.eos_token_id = eos_token_id
        self.mixed_chunk = mixed_chunk
        self.share_in_flight = share_in_flight
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.reserved = 0
        self._last = StepKind.DECODE

    # -- bookkeeping views --------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def waiting_uncached_tokens(self) -> int:
        return sum(len(r.prompt) - r.num_computed for r in (*self.waiting, *self.prefilling))

    def used_tokens(self) -> int:
        return (self.cache.allocator.num_pages - self.cache.num_available) * self.page_size

    def pages_needed(self, req: Request) -> int:
        new = 1 if req.export_pages else req.params.max_new_tokens
        return _ceil_div(len(req.prompt) + new, self.page_size)

    # -- intake -------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        need = self.pages_needed(req)
        total = self.cache.allocator.num_pages
        if need > total:
            raise CapacityError(
                f"the request needs {need * self.page_size} KV tokens "
                f"({len(req.prompt)} prompt + {req.params.max_new_tokens} new) but the pool "
                f"holds {total * self.page_size} (--max-total-tokens)"
            )
        if not req.digests:
            full = req.prompt[: len(req.prompt) // self.page_size * self.page_size]
            req.digests = page_digests(full, self.page_size, event_salt_seed(req.cache_salt))
        req.phase = Phase.WAITING
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Move requests from the queue to prefill while their reservation fits."""
        admitted = []
        while self.waiting and self.num_running < self.max_running:
            req = self.waiting[0]
            matched = self.cache.match(req.digests)
            # Keep at least one prompt token to compute: it yields the first output's logits.
            if matched and len(matched) * self.page_size >= len(req.prompt):
                matched = matched[:-1]
            self.cache.acquire(matched)
            need = self.pages_needed(req) - len(matched)
            if self.cache.num_available - self.reserved < need:
                self.cache.release(matched)
                break
            self.waiting.popleft()
            req.pages = list(matched)
            req.cache_refs = list(matched)
            req.inserted_pages = len(matched)
            req.num_computed = len(matched) * self.page_size
            req.cached_tokens_device = req.num_computed
            req.reserved_pages = need
            self.reserved += need
            req.phase = Phase.PREFILL
            self.prefilling.append(req)
            admitted.append(req)
        return admitted

    def alloc_pages(self, req: Request, n: int) -> list[int]:
        """Allocate ``n`` of the request's reserved pages (evicting cached pages if needed)."""
        if n > req.reserved_pages:
            raise RuntimeError(f"request {req.rid} asked for {n} pages beyond its reservation")
        if not self.cache.ensure_free(n):
            raise RuntimeError("reserved pages are not available: accounting is broken")
        pages = self.cache.allocator.alloc(n)
        req.reserved_pages -= n
        self.reserved -= n
        req.pages.extend(pages)
        return pages

    def mark_loaded(self, req: Request, num_pages: int) -> None:
        """``num_pages`` pages after the device-cached prefix were loaded from the host tier."""
        req.num_computed += num_pages * self.page_size
        req.cached_tokens_storage += num_pages * self.page_size
        self._insert_computed(req)

    # -- steps --------------------------------------------------------------------------------

    def next_step(self) -> Step | None:
        want_prefill = bool(self.prefilling)
        want_decode = bool(self.decoding)
        if self.mixed_chunk and want_decode:
            decode = self._plan_decode()
            budget = self.chunk_size - len(decode)
            prefill = self._plan_prefill(budget) if want_prefill and budget > 0 else ()
            kind = StepKind.MIXED if prefill else StepKind.DECODE
            return Step(kind, prefill=prefill, decode=decode,
                        kv_attended=self._kv_attended(prefill, decode))
        if want_prefill and (not want_decode or self._last is StepKind.DECODE):
            self._last = StepKind.PREFILL
            prefill = self._plan_prefill(self.chunk_size)
            return Step(StepKind.PREFILL, prefill=prefill,
                        kv_attended=self._kv_attended(prefill, ()))
        if want_decode:
            self._last = StepKind.DECODE
            decode = self._plan_decode()
            return Step(StepKind.DECODE, decode=decode,
                        kv_attended=self._kv_attended((), decode))
        return None

    def _kv_attended(
        self, prefill: tuple[PrefillChunk, ...], decode: tuple[Request, ...]
    ) -> float:
        """``Step.kv_attended``: each decoding request's tokens so far, and the prompt of each
        chunk that completes one (its first token comes from this step)."""
        tokens = sum(r.num_tokens for r in decode)
        tokens += sum(c.end for c in prefill if c.completes_prompt)
        return tokens / (self.cache.allocator.num_pages * self.page_size)

    def _plan_decode(self) -> tuple[Request, ...]:
        for req in self.decoding:
            pos = req.num_tokens - 1
            if pos // self.page_size >= len(req.pages):
                self.alloc_pages(req, 1)
        return tuple(self.decoding)

    def _plan_prefill(self, budget: int) -> tuple[PrefillChunk, ...]:
        chunks = []
        computing: set[bytes] = set()  # prompt pages this step's chunks compute
        for req in self.prefilling:
            if budget <= 0:
                break
            if self.share_in_flight:
                self._catch_up(req)
                nxt = req.num_computed // self.page_size
                if nxt < len(req.digests) and req.digests[nxt] in computing:
                    continue  # an earlier request computes it now: wait, then reuse it
            start = req.num_computed
            end = min(len(req.prompt), start + budget)
            missing = _ceil_div(end, self.page_size) - len(req.pages)
            if missing > 0:
                self.alloc_pages(req, missing)
            chunks.append(PrefillChunk(req, start, end))
            budget -= end - start
            if self.share_in_flight:
                touched = range(start // self.page_size, _ceil_div(end, self.page_size))
                computing.update(req.digests[touched.start : touched.stop])
        return tuple(chunks)

    def _catch_up(self, req: Request) -> None:
        """Take the cached pages that extend the request's prefix since it was admitted or
        last computed (another request computed them meanwhile), while it holds no page of
        its own yet to switch from; its reservation shrinks by as many pages."""
        held = len(req.pages)
        if req.inserted_pages != held or req.num_computed != held * self.page_size:
            return
        matched = self.cache.match(req.digests)
        if len(matched) * self.page_size >= len(req.prompt):
            matched = matched[:-1]  # keep a token to compute, as admit() does
        extra = matched[held:]
        if not extra:
            return
        extra = extra[: req.reserved_pages]
        self.cache.acquire(extra)
        req.pages.extend(extra)
        req.cache_refs.extend(extra)
        req.inserted_pages += len(extra)
        req.num_computed += len(extra) * self.page_size
        req.cached_tokens_device += len(extra) * self.page_size
        req.reserved_pages -= len(extra)
        self.reserved -= len(extra)

    def complete_prefill(self, chunk: PrefillChunk, token: int | None) -> None:
        req = chunk.req
        req.num_computed = chunk.end
        self._insert_computed(req)
        if not chunk.completes_prompt:
            return
        self.prefilling.remove(req)
        if req.params.max_new_tokens == 0:
            self.finish(req, FinishReason("length", length=0))
            return
        if token is None:
            raise RuntimeError("a prompt-completing chunk must yield a token")
        req.output_ids.append(token)
        req.phase = Phase.DECODE
        self.decoding.append(req)
        self._check_stop(req)

    def complete_decode(self, reqs: tuple[Request, ...], tokens: list[int]) -> None:
        for req, token in zip(reqs, tokens, strict=True):
            if req.phase is not Phase.DECODE:
                continue  # aborted while the step ran
            req.num_computed = req.num_tokens
            req.output_ids.append(token)
            self._check_stop(req)

    def _check_stop(self, req: Request) -> None:
        token = req.output_ids[-1]
        n = len(req.output_ids)
        p = req.params
        if req.export_pages:
            self.finish(req, FinishReason("length", length=n))
        elif n >= p.min_new_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token == self.eos_token_id)
        ):
            self.finish(req, FinishReason("stop", matched=token))
        elif n >= p.max_new_tokens:
            self.finish(req, FinishReason("length", length=n))

    # -- cache insertion and release ----------------------------------------------------------

    def _extend_digests(self, req: Request, upto_pages: int) -> None:
        have = len(req.digests)
        if upto_pages <= have:
            return
        tokens = req.all_tokens()[have * self.page_size : upto_pages * self.page_size]
        prior = req.digests[-1] if req.digests else event_salt_seed(req.cache_salt)
        req.digests.extend(page_digests(tokens, self.page_size, prior))

    def _insert_computed(self, req: Request) -> None:
        full = req.num_computed // self.page_size
        if full <= req.inserted_pages:
            return
        self._extend_digests(req, full)
        first = req.inserted_pages
        digests = req.digests[first:full]
        pages = req.pages[first:full]
        tokens = req.all_tokens()[first * self.page_size : full * self.page_size]
        parent = req.digests[first - 1] if first else None
        inserted = self.cache.insert(digests, pages, tokens, parent, req.cache_salt)
        for digest, page, new in zip(digests, pages, inserted, strict=True):
            if new:
                req.cache_refs.append(page)
            else:  # someone cached the same content first: pin theirs, keep ours private
                (cached,) = self._lookup(digest)
                self.cache.acquire([cached])
                req.cache_refs.append(cached)
        req.inserted_pages = full

    def _lookup(self, digest: bytes) -> list[int]:
        found = self.cache.match([digest])
        if not found:
            raise RuntimeError("a duplicate page vanished from the cache")
        return found

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request in any phase: cache what it computed, release everything else."""
        if req.phase is Phase.FINISHED:
            return
        if req.phase is Phase.WAITING:
            self.waiting.remove(req)
        else:
            if req in self.prefilling:
                self.prefilling.remove(req)
            if req in self.decoding:
                self.decoding.remove(req)
            if reason.kind != "abort":
                self._insert_computed(req)
            refs = set(req.cache_refs)
            private = [p for p in req.pages if p not in refs]
            self.cache.release(req.cache_refs)
            self.cache.allocator.free(private)
            self.reserved -= req.reserved_pages
            req.reserved_pages = 0
        req.phase = Phase.FINISHED
        req.finish = reason
