"""Live replay: send a trace's requests to a gateway at their timestamps and record each one.

Each request goes to ``POST {url}/v1/completions`` with a token-id prompt synthesized from its
prefix ids (``synthesis.TokenSynthesizer``), ``max_tokens`` = the trace's output length
(``ignore_eos`` so the engine produces all of them), streaming with
``stream_options.include_usage``. What comes back, per request, one JSONL line:

* ``worker``: the gateway's ``x-kvsidecar-worker`` header;
* ``predicted_cached_tokens``: ``x-kvsidecar-cached-blocks`` × the gateway's block size;
* ``cached_tokens``: ``usage.prompt_tokens_details.cached_tokens`` (what the engine reused);
* ``ttft_s`` (to the first content chunk), ``itl_s`` (every later chunk gap), ``e2e_s``;
* ``error``: why it failed (HTTP status and body head, or the exception); others go on.

Arrivals are scheduled on the loop's clock (``--speedup`` compresses them); at most
``--max-concurrency`` requests are in flight, later ones wait (``start_delay_s`` says how long).
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict

import aiohttp
import orjson

from replay.config import ReplayConfig
from replay.report import PolicyResult, TraceReport, markdown_table, write_report
from replay.summary import RequestOutcome, summarize
from replay.synthesis import TokenSynthesizer, vocab_size_from_model_dir
from replay.traces import TraceRecord, load_for_replay

__all__ = ["LiveConfig", "LiveRecord", "LiveRecordJson", "main_live", "replay_live"]

WORKER_HEADER = "x-kvsidecar-worker"
CACHED_BLOCKS_HEADER = "x-kvsidecar-cached-blocks"


@dataclass(frozen=True, slots=True)
class LiveConfig:
    url: str
    model: str | None = None  # None: the first model the gateway lists at /v1/models
    speedup: float = 1.0
    max_concurrency: int = 64
    block_size: int = 16  # the gateway's, to turn cached blocks into tokens
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must be an http(s) URL, got {self.url!r}")
        if self.speedup <= 0 or not math.isfinite(self.speedup):
            raise ValueError(f"--speedup must be > 0, got {self.speedup}")
        if self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")


class LiveRecordJson(TypedDict):
    """One line of the live replay's JSONL output (``LiveRecord.to_json``)."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    start_delay_s: float
    worker: str | None
    predicted_cached_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_s: float | None
    itl_mean_s: float | None
    itl_s: list[float]
    e2e_s: float | None
    error: str | None


class _StreamOptions(TypedDict):
    include_usage: bool


class _CompletionBody(TypedDict):
    """The ``POST /v1/completions`` body each replayed request sends."""

    model: str
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    stream: bool
    stream_options: _StreamOptions


@dataclass(slots=True)
class LiveRecord:
    """One request's outcome as the client saw it (times in seconds)."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    start_delay_s: float = 0.0
    worker: str | None = None
    predicted_cached_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    itl_s: list[float] | None = None
    e2e_s: float | None = None
    error: str | None = None

    def to_json(self) -> LiveRecordJson:
        itl = self.itl_s or []
        return {
            "index": self.index,
            "arrival_s": self.arrival_s,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "start_delay_s": round(self.start_delay_s, 6),
            "worker": self.worker,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": self.ttft_s,
            "itl_mean_s": sum(itl) / len(itl) if itl else None,
            "itl_s": [round(x, 6) for x in itl],
            "e2e_s": self.e2e_s,
            "error": self.error,
        }


def _body(record: TraceRecord, prompt: list[int], model: str) -> _CompletionBody:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max(1, record.output_tokens),
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _send(
    session: aiohttp.ClientSession,
    cfg: LiveConfig,
    record: TraceRecord,
    prompt: list[int],
    out: LiveRecord,
) -> None:
    t0 = time.monotonic()
    gaps: list[float] = []
    last: float | None = None
    async with session.post(
        f"{cfg.url}/v1/completions", json=_body(record, prompt, cfg.model or "default")
    ) as r:
        out.worker = r.headers.get(WORKER_HEADER)
        blocks = r.headers.get(CACHED_BLOCKS_HEADER)
        if blocks is not None and blocks.isdigit():
            out.predicted_cached_tokens = min(record.input_tokens, int(blocks) * cfg.block_size)
        if r.status != 200:
            text = (await r.text())[:300]
            out.error = f"HTTP {r.status}: {text}"
            return
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                out.error = f"malformed stream chunk: {data[:120]!r}"
                return
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                out.error = f"stream error: {chunk['error']}"
                return
            choices = chunk.get("choices") or []
            if any(c.get("text") or c.get("delta") for c in choices if isinstance(c, dict)):
                now = time.monotonic()
                if last is None:
                    out.ttft_s = now - t0
                else:
                    gaps.append(now - last)
                last = now
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                out.completion_tokens = usage.get("completion_tokens")
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict) and details.get("cached_tokens") is not None:
                    out.cached_tokens = int(details["cached_tokens"])
    out.e2e_s = time.monotonic() - t0
    out.itl_s = gaps
    if out.ttft_s is None:
        out.error = "the stream ended without a token"


async def replay_live(
    records: Sequence[TraceRecord],
    synth: TokenSynthesizer,
    cfg: LiveConfig,
    on_record: Callable[[LiveRecord], None] | None = None,
) -> list[LiveRecord]:
    """Send every record at its (compressed) arrival time; returns outcomes in trace order."""
    results = [LiveRecord(r.index, r.arrival_s, r.input_tokens, r.output_tokens) for r in records]
    limit = asyncio.Semaphore(cfg.max_concurrency)
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.request_timeout_s
    )
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency)
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(record: TraceRecord, out: LiveRecord) -> None:
        due = start + record.arrival_s / cfg.speedup
        await asyncio.sleep(max(0.0, due - loop.time()))  # the trace's schedule, not a wait
        async with limit:
            out.start_delay_s = max(0.0, loop.time() - due)
            prompt = synth.prompt(record.hash_ids, record.input_tokens)
            try:
                await _send(session, cfg, record, prompt, out)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                out.error = f"{type(exc).__name__}: {exc}"
        if on_record is not None:
            on_record(out)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if cfg.model is None:
            cfg = replace(cfg, model=await served_model(session, cfg.url))
        async with asyncio.TaskGroup() as tg:
            for record, out in zip(records, results, strict=True):
                tg.create_task(one(record, out))
    return results


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model the gateway lists at ``GET /v1/models``, else ``"default"``."""
    try:
        async with session.get(f"{url}/v1/models") as resp:
            data = await resp.json(content_type=None)
        return str(data["data"][0]["id"])
    except (aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError):
        return "default"


class _Bar:
    """A one-line progress bar on stderr (quiet when stderr is not a terminal)."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total = total
        self.done = self.errors = 0
        self.quiet = quiet or not sys.stderr.isatty()

    def __call__(self, record: LiveRecord) -> None:
        self.done += 1
        self.errors += record.error is not None
        if self.quiet:
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}"
            f" errors {self.errors}  "
        )
        sys.stderr.flush()

    def close(self) -> None:
        if not self.quiet:
            sys.stderr.write("\n")


def write_jsonl(path: Path, records: Sequence[LiveRecord]) -> None:
    with path.open("wb") as f:
        for record in records:
            f.write(orjson.dumps(record.to_json()) + b"\n")


async def main_live(opts: ReplayConfig) -> int:
    """``kvsidecar replay TRACE --url ...``: the CLI's live mode."""
    if opts.url is None:
        raise ValueError("live replay needs --url")
    cfg = LiveConfig(
        url=opts.url.rstrip("/"),
        model=opts.model,
        speedup=opts.speedup,
        max_concurrency=opts.max_concurrency,
        block_size=opts.block_size,
        request_timeout_s=opts.request_timeout_s,
    )
    vocab = vocab_size_from_model_dir(opts.model_path) if opts.model_path else opts.vocab_size
    synth = TokenSynthesizer(vocab, seed=opts.seed)
    reports = []
    for trace in opts.traces:
        records = await asyncio.to_thread(
            load_for_replay, trace, opts.limit, opts.prefix_share, opts.seed
        )
        bar = _Bar(len(records), opts.quiet)
        results = await replay_live(records, synth, cfg, bar)
        bar.close()
        output = Path(opts.output or f"replay-{Path(trace).stem}.jsonl")
        if len(opts.traces) > 1 and opts.output:
            output = output.with_name(f"{output.stem}-{Path(trace).stem}{output.suffix}")
        await asyncio.to_thread(write_jsonl, output, results)
        outs = [
            RequestOutcome(
                index=r.index,
                worker=r.worker or "",
                input_tokens=r.input_tokens,
                output_tokens=r.output_tokens,
                predicted_tokens=r.predicted_cached_tokens or 0,
                cached_tokens=r.cached_tokens or 0,
                ttft=math.nan if r.ttft_s is None else r.ttft_s,
                itl_mean=sum(r.itl_s) / len(r.itl_s) if r.itl_s else math.nan,
                e2e=math.nan if r.e2e_s is None else r.e2e_s,
                error=r.error,
            )
            for r in results
        ]
        samples = [(g, 1.0) for r in results if r.error is None for g in r.itl_s or ()]
        summary = summarize("live", outs, samples)
        report = TraceReport(
            Path(trace).name,
            f"{len(records):,} requests sent to {cfg.url} (arrivals ×{cfg.speedup:g}, at most "
            f"{cfg.max_concurrency} in flight); records in {output}.",
            [PolicyResult(summary, outs, samples)],
        )
        reports.append(report)
        print(f"## {report.trace}\n\n{report.settings}\n\n{markdown_table(report)}\n")
    if opts.report:
        written = await asyncio.to_thread(write_report, reports, opts.report, "Live trace replay")
        print(f"report written to {written}")
    return 0 if all(p.summary.errors == 0 for r in reports for p in r.policies) else 1
