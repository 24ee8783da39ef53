"""One simulated engine replica: the reference engine's scheduler and timing, event by event.

The policy is ``refengine/scheduler.py``'s: FIFO admission with a page reservation for the
request's whole life (prompt + output, less its cached prefix), chunked prefill in arrival
order, continuous decode batching, and strict alternation of prefill and decode steps while
both have work. Step durations come from ``refengine.timing.TimingModel``.

Speed comes from two coarse-grainings that do not change the answer much:

* the cache works on trace blocks (``cache_model.BlockCache``), so a 512-token block is
  stored, matched and evicted as one unit (of 32 pages);
* between events the step sequence is periodic: while the head request's prefill has full
  chunks left and the decode batch is unchanged, every cycle is (one prefill chunk of
  ``chunk`` tokens, one decode step), and each cycle is longer than the one before by a
  constant (attention over one more chunk of context, KV reads over B more tokens). Cycle
  durations form an arithmetic series, so K cycles advance in O(1) (``_bulk``). Steps near
  changes (a prompt completing, a chunk spanning two requests) run one by one (``_step``).

What the gateway would hear goes to two queues of notes (``replay.notes``) in time order:
``outbox`` for KV events (stored/removed blocks, which may reach the router late) and
``lifecycle`` for what the gateway sees on the request's own stream (first token, output
crossing a trace block, finish). The fleet driver feeds both to the router when the simulated
clock passes them. The replica is pure and synchronous, and one state machine: admission, the
single steps and the bulk cycles all move the same queues, pages and clock, which is why it
stays one module of about 450 lines.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

from refengine.timing import TimingModel
from replay.cache_model import BlockCache
from replay.notes import (
    FirstToken,
    KvNote,
    Removed,
    RequestFinished,
    Stored,
    StreamNote,
    TokensGenerated,
)
from replay.traces import TRACE_BLOCK_TOKENS, TraceRecord

__all__ = ["ReplicaSim", "SimRequest"]


@dataclass(slots=True)
class SimRequest:
    """One request's life on a replica, and what the report needs from it."""

    record: TraceRecord
    arrival: float
    worker: str = ""
    predicted_tokens: int = 0
    cached_tokens: int = 0
    admitted: float = math.nan
    first_token: float = math.nan
    finished: float = math.nan
    error: str | None = None
    itl_sum: float = 0.0
    itl_count: int = 0
    itl_max: float = 0.0
    # scheduler state
    computed: int = 0
    pages: int = 0  # pages covering computed tokens (cached refs + private)
    private: int = 0  # of those, pages not in the cache
    reserved: int = 0
    next_block: int = 0
    nodes: list[int] = field(default_factory=list)
    generated: int = 0
    last_token: float = 0.0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def itl_mean(self) -> float:
        return self.itl_sum / self.itl_count if self.itl_count else math.nan


class _Last(enum.Enum):
    PREFILL = 0
    DECODE = 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ReplicaSim:
    """A replica's queue, cache and clock."""

    def __init__(
        self,
        worker_id: str,
        *,
        capacity_tokens: int,
        timing: TimingModel,
        page_size: int = 16,
        chunk_size: int = 512,
        max_running: int = 64,
        closed_form: bool = True,
    ) -> None:
        if TRACE_BLOCK_TOKENS % page_size:
            raise ValueError(f"page size {page_size} must divide {TRACE_BLOCK_TOKENS}")
        if chunk_size < 1 or max_running < 1:
            raise ValueError("chunk size and max running requests must be >= 1")
        self.worker_id = worker_id
        self.page_size = page_size
        self.block_pages = TRACE_BLOCK_TOKENS // page_size
        self.chunk = chunk_size
        self.max_running = max_running
        self.closed_form = closed_form  # False: every step one by one (the reference)
        self.timing = timing
        self.cache = BlockCache(capacity_tokens // page_size)
        self.t = 0.0
        self.busy_s = 0.0
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[SimRequest] = []
        self.reserved = 0
        self.outbox: deque[KvNote] = deque()
        self.lifecycle: deque[StreamNote] = deque()
        self.itl_samples: list[tuple[float, float]] = []  # (interval s, weight)
        self._last = _Last.DECODE
        tm = timing
        self._k = 1.0 / tm.speedup  # every coefficient below is already divided by speedup
        self._pb, self._pt = tm.prefill_base_s * self._k, tm.prefill_per_token_s * self._k
        self._pa = tm.prefill_attn_per_token_ctx_s * self._k
        self._db, self._ds = tm.decode_base_s * self._k, tm.decode_per_seq_s * self._k
        self._dc = tm.decode_per_ctx_token_s * self._k

    # --- intake -------------------------------------------------------------------------

    def pages_needed(self, record: TraceRecord) -> int:
        return _ceil_div(record.input_tokens + record.output_tokens, self.page_size)

    def add(self, req: SimRequest) -> None:
        """A request arrives (at ``req.arrival``); it is admitted at the next step boundary."""
        need = self.pages_needed(req.record)
        if need > self.cache.capacity_pages:
            req.error = (
                f"needs {need * self.page_size} KV tokens, the replica holds "
                f"{self.cache.capacity_pages * self.page_size}"
            )
            req.finished = req.arrival
            return
        self.waiting.append(req)

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.decoding)

    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    # --- the clock ----------------------------------------------------------------------

    def advance(self, until: float) -> None:
        """Run every step that starts before ``until`` (the last may end after it)."""
        while True:
            if self.waiting:
                self._admit()
            if not (self.prefilling or self.decoding):
                if self.waiting:
                    raise RuntimeError("requests wait on an empty replica: accounting is broken")
                self.t = max(self.t, until)
                return
            if self.t >= until:
                return
            if not (self.closed_form and self._bulk(until)):
                self._step()

    def _admit(self) -> None:
        cache = self.cache
        while self.waiting and len(self.prefilling) + len(self.decoding) < self.max_running:
            req = self.waiting[0]
            rec = req.record
            self.t = max(self.t, req.arrival)  # an idle replica starts when a request arrives
            keys, pages = cache.match(rec.hash_ids, self.block_pages)
            # Keep one prompt token to compute: it yields the first output's logits.
            if pages * self.page_size >= rec.input_tokens:
                pages = (rec.input_tokens - 1) // self.page_size
            cache.acquire(keys)
            need = self.pages_needed(rec) - pages
            if cache.available_pages - self.reserved < need:
                cache.release(keys)
                return
            self.waiting.popleft()
            req.admitted = self.t
            req.nodes = keys
            req.next_block = len(keys)
            req.pages = pages
            req.computed = req.cached_tokens = pages * self.page_size
            req.reserved = need
            self.reserved += need
            self.prefilling.append(req)

    # --- page and cache bookkeeping -----------------------------------------------------

    def _allocate_upto(self, req: SimRequest, tokens: int) -> None:
        n = _ceil_div(tokens, self.page_size) - req.pages
        if n <= 0:
            return
        n = min(n, req.reserved)
        self.cache.allocate(n)
        req.pages += n
        req.private += n
        req.reserved -= n
        self.reserved -= n

    def _insert_blocks(self, req: SimRequest, upto: int, when: float) -> None:
        """Cache every block of ``req`` whose pages are computed once ``upto`` tokens are."""
        rec = req.record
        ids = rec.hash_ids
        run: list[int] = []
        run_parent: int | None = None
        j = req.next_block
        while j < len(ids):
            end = (j + 1) * TRACE_BLOCK_TOKENS
            if upto < min(end, rec.input_tokens):
                break
            size = (min(end, rec.input_tokens) - j * TRACE_BLOCK_TOKENS) // self.page_size
            if size == 0:
                j += 1
                break
            key = ids[j]
            parent = ids[j - 1] if j else None
            if self.cache.insert(key, parent, size):
                req.private -= size
                if not run:
                    run_parent = parent
                run.append(key)
            else:  # cached meanwhile by another request: pin theirs, keep ours private
                self.cache.acquire([key])
                if run:
                    self.outbox.append(Stored(when, run, run_parent))
                    run = []
            req.nodes.append(key)
            j += 1
        req.next_block = j
        if run:
            self.outbox.append(Stored(when, run, run_parent))

    def _publish_removed(self, when: float) -> None:
        if self.cache.removed:
            self.outbox.append(Removed(when, self.cache.removed))
            self.cache.removed = []

    def _prompt_done(self, req: SimRequest, when: float) -> None:
        self.prefilling.remove(req)
        req.first_token = req.last_token = when
        self.lifecycle.append(FirstToken(when, req.record.index))
        if req.record.output_tokens <= 1:
            req.generated = req.record.output_tokens
            self._finish(req, when)
        else:
            req.generated = 1
            self.decoding.append(req)

    def _finish(self, req: SimRequest, when: float) -> None:
        rec = req.record
        req.finished = when
        # The engine caches the computed output pages; nobody will ever match them.
        out_pages = (rec.input_tokens + req.generated - 1) // self.page_size
        out_pages -= rec.input_tokens // self.page_size
        out_pages = min(out_pages, req.private)
        cache = self.cache
        if out_pages > 0 and req.nodes:
            key = -(rec.index + 1)
            if cache.insert(key, req.nodes[-1], out_pages):
                req.private -= out_pages
                cache.release([key])
        cache.release(req.nodes)
        cache.free(req.private)
        self.reserved -= req.reserved
        req.private = req.reserved = 0
        self.lifecycle.append(RequestFinished(when, rec.index))

    # --- one step at a time -------------------------------------------------------------

    def _step(self) -> None:
        if self.prefilling and (not self.decoding or self._last is _Last.DECODE):
            self._last = _Last.PREFILL
            budget = self.chunk
            chunks: list[tuple[SimRequest, int]] = []
            for req in self.prefilling:
                if budget <= 0:
                    break
                end = min(req.record.input_tokens, req.computed + budget)
                self._allocate_upto(req, end)
                chunks.append((req, end))
                budget -= end - req.computed
            self._publish_removed(self.t)
            took = self.timing.prefill([(end - req.computed, end) for req, end in chunks])
            when = self.t + took
            for req, end in chunks:
                req.computed = end
                self._insert_blocks(req, end, when)
                if end == req.record.input_tokens:
                    self._prompt_done(req, when)
        else:
            self._last = _Last.DECODE
            batch = list(self.decoding)
            for req in batch:
                self._allocate_upto(req, req.record.input_tokens + req.generated)
            self._publish_removed(self.t)
            took = self.timing.decode([r.record.input_tokens + r.generated for r in batch])
            when = self.t + took
            for req in batch:
                gap = when - req.last_token
                self._count_itl(req, gap, 1)
                self.itl_samples.append((gap, 1.0))
                req.last_token = when
                req.generated += 1
                if (req.record.input_tokens + req.generated) % TRACE_BLOCK_TOKENS == 0:
                    self.lifecycle.append(TokensGenerated(when, req.record.index, req.generated))
                if req.generated >= req.record.output_tokens:
                    self.decoding.remove(req)
                    self._finish(req, when)
        self.busy_s += took
        self.t = when

    @staticmethod
    def _count_itl(req: SimRequest, gap: float, count: int) -> None:
        req.itl_sum += gap * count
        req.itl_count += count
        req.itl_max = max(req.itl_max, gap)

    # --- many periodic cycles at once ---------------------------------------------------

    def _bulk(self, until: float) -> bool:
        """Advance K ≥ 3 identical-shape cycles in closed form; False if not applicable."""
        decoding = self.decoding
        batch = len(decoding)
        head = None
        if self.prefilling:
            if batch and self._last is not _Last.DECODE:
                return False  # a decode step is due first: take it singly
            if self.waiting:
                return False  # each stored block may shrink a waiting request's reservation
            head = self.prefilling[0]
            left = head.record.input_tokens - head.computed
            cycles = (left - 1) // self.chunk  # cycles whose chunk is the head's alone
            if cycles < 3:
                return False
        else:
            cycles = 1 << 62
        if batch:
            cycles = min(cycles, *(r.record.output_tokens - r.generated for r in decoding))
        if cycles < 3:
            return False
        c = self.chunk if head is not None else 0
        ctx_sum = sum(r.record.input_tokens + r.generated for r in decoding)
        # cycle k lasts a + b·k
        a = 0.0
        b = 0.0
        if head is not None:
            a += self._pb + self._pt * c + self._pa * c * (head.computed + c)
            b += self._pa * c * c
        if batch:
            a += self._db + self._ds * batch + self._dc * ctx_sum
            b += self._dc * batch
        horizon = until - self.t
        # cycles starting before the horizon: k ≥ 0 with a·k + b·k(k−1)/2 < horizon
        if math.isinf(horizon):
            fit = float(cycles)
        elif b > 0:
            half = b / 2
            fit = (-(a - half) + math.sqrt((a - half) ** 2 + 4 * half * horizon)) / (2 * half)
        else:
            fit = horizon / a
        k_fit = max(1, math.ceil(fit))
        while k_fit > 1 and a * (k_fit - 1) + b * (k_fit - 1) * (k_fit - 2) / 2 >= horizon:
            k_fit -= 1
        cycles = min(cycles, k_fit)
        if head is not None and batch and cycles >= 1:
            # Stepping one by one would stop between the last cycle's prefill and its decode
            # if the decode starts at or after the horizon: end one cycle earlier then.
            k = cycles - 1
            decode_start = a * k + b * k * (k - 1) / 2 + self._pb + self._pt * c
            decode_start += self._pa * c * (head.computed + c) + self._pa * c * c * k
            if decode_start >= horizon:
                cycles -= 1
        if cycles < 3:
            return False
        t0 = self.t
        total = a * cycles + b * cycles * (cycles - 1) / 2
        if head is not None:
            end = head.computed + cycles * c
            self._allocate_upto(head, end)
        for req in decoding:
            self._allocate_upto(req, req.record.input_tokens + req.generated + cycles - 1)
        self._publish_removed(t0)
        if head is not None:
            # block j is complete after chunk k_j; its store happens when that prefill ends
            p0 = self._pb + self._pt * c + self._pa * c * (head.computed + c)
            start = head.computed
            j = head.next_block
            while j < len(head.record.hash_ids):
                done_at = (j + 1) * TRACE_BLOCK_TOKENS
                if done_at > end or done_at > head.record.input_tokens:
                    break
                k = _ceil_div(done_at - start, c) - 1
                when = t0 + a * k + b * k * (k - 1) / 2 + p0 + self._pa * c * c * k
                head.computed = start + (k + 1) * c
                self._insert_blocks(head, head.computed, when)
                j = head.next_block
            head.computed = end
        if batch:
            first_end = t0 + a
            mid = a + b * (1 + (cycles - 2) / 2)  # mean of cycles 1..K−1
            spread = b * (cycles - 2) / 4
            self.itl_samples.append((mid - spread, (cycles - 1) * batch / 2))
            self.itl_samples.append((mid + spread, (cycles - 1) * batch / 2))
            when = t0 + total
            crossings: list[StreamNote] = []
            for req in list(decoding):
                # output crossing a trace block at token k of the segment (1-based): the
                # gateway's load view grows by a block then; cycle k−1 ends at t0 + S(k)
                before = req.record.input_tokens + req.generated
                k = TRACE_BLOCK_TOKENS - before % TRACE_BLOCK_TOKENS
                while k <= cycles:
                    at = t0 + a * k + b * k * (k - 1) / 2
                    crossings.append(TokensGenerated(at, req.record.index, req.generated + k))
                    k += TRACE_BLOCK_TOKENS
            crossings.sort(key=lambda note: note.at)
            self.lifecycle.extend(crossings)
            for req in list(decoding):
                first_gap = first_end - req.last_token
                self._count_itl(req, first_gap, 1)
                self.itl_samples.append((first_gap, 1.0))
                req.itl_sum += total - a
                req.itl_count += cycles - 1
                req.itl_max = max(req.itl_max, a + b * (cycles - 1))
                req.generated += cycles
                req.last_token = when
                if req.generated >= req.record.output_tokens:
                    decoding.remove(req)
                    self._finish(req, when)
            self._last = _Last.DECODE
        else:
            self._last = _Last.PREFILL
        self.busy_s += total
        self.t = t0 + total
        return True
