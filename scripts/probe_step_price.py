"""How an engine prices a decode step, read from its streamed replies: point it at two
engines with the same small KV pool (our sim engine with ``--sim-model mocker``, Dynamo's
mocker) to tell whether their step models agree.

Two probes, each a table:

* **one stream**: the median gap before each token of one streamed completion (``--prompt``
  word tokens, ``--max-tokens`` out), over ``--repeats`` requests. A model priced by the KV
  pages held steps up at each page boundary; one priced by exact tokens grows every token.
* **streams sharing a prefix**: ``--streams`` concurrent completions on one
  ``--shared``-word prefix (sent once first, so it is cached) plus ``--own`` words each;
  the mean gap of each stream's middle half. A model that counts a shared prefix once per
  request that reads it prices these as unshared streams; one that counts the pages held
  prices the prefix once.

With ``--pool-tokens`` (the engine's KV pool: blocks × block size), each table also prints
Dynamo 1.6.1's polynomial (``refengine.timing``) at both readings of ``p``, for the
context the gap was measured at. Prompts are random ``w<n>`` words: on a one-word-one-token
model (``~/.cache/kvsidecar-bench/tinymodel``) a word is a token.

  python scripts/probe_step_price.py http://127.0.0.1:8000 --pool-tokens 1024
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import statistics
from typing import Any

import benchkit  # noqa: F401  (first: this checkout's packages on sys.path)
from benchkit import StreamedReply, print_table, progress, stream_reply

from refengine.timing import SimModel, TimingModel

MOCKER = TimingModel(shape=SimModel.MOCKER)


def mocker_ms(kv: float) -> float:
    """The mocker's pure decode step at ``p`` = ``kv``, in ms."""
    return MOCKER.step((), (), yields=True, kv_attended=kv) * 1e3


def words(rng: random.Random, n: int, tag: str) -> str:
    return " ".join(f"{tag}{rng.randrange(30000)}" for _ in range(n))


async def complete(session: Any, url: str, model: str, prompt: str, max_tokens: int
                   ) -> StreamedReply:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "min_tokens": max_tokens}
    reply = await stream_reply(session, f"{url}/v1/completions", body)
    if reply.status != 200:
        raise SystemExit(f"{url} answered {reply.status}: {reply.error[:300]}")
    return reply


def token_times(reply: StreamedReply, max_tokens: int) -> list[float]:
    """Each token's arrival, from the first token's (the events after the last token, such
    as a usage chunk, left out)."""
    times, t = [0.0], 0.0
    for gap in reply.itl_s[: max_tokens - 1]:
        t += gap
        times.append(t)
    return times


async def one_stream(session: Any, args: argparse.Namespace, rng: random.Random) -> None:
    per_token: list[list[float]] = [[] for _ in range(args.max_tokens)]
    await complete(session, args.url, args.model, words(rng, args.prompt, "w"), 2)  # warm
    for i in range(args.repeats):
        progress(f"one stream: request {i + 1}/{args.repeats}")
        reply = await complete(session, args.url, args.model, words(rng, args.prompt, "w"),
                               args.max_tokens)
        for k, t in enumerate(token_times(reply, args.max_tokens)):
            per_token[k].append(t)
    header = ["token", "context", "step_ms"]
    if args.pool_tokens:
        header += ["mocker_at_tokens_ms", "mocker_at_pages_ms"]
    rows: list[list[object]] = []
    prev = statistics.median(per_token[1]) if per_token[1] else 0.0
    # the second token on: some servers send the first two tokens together
    for k in range(2, args.max_tokens):
        if not per_token[k]:
            break
        now = statistics.median(per_token[k])
        context = args.prompt + k  # the tokens the step that made token k read
        row: list[object] = [k, context, round((now - prev) * 1e3, 3)]
        if args.pool_tokens:
            pages = math.ceil(context / args.block_size) * args.block_size
            row += [round(mocker_ms(context / args.pool_tokens), 3),
                    round(mocker_ms(pages / args.pool_tokens), 3)]
        rows.append(row)
        prev = now
    print(f"one stream: {args.prompt} prompt tokens, {args.max_tokens} out, median of "
          f"{args.repeats} requests")
    print_table(header, rows)


async def shared_streams(session: Any, args: argparse.Namespace, rng: random.Random) -> None:
    header = ["streams", "shared", "own", "mid_gap_ms"]
    if args.pool_tokens:
        header += ["mocker_summed_ms", "mocker_pages_held_ms"]
    rows: list[list[object]] = []
    for streams in args.streams:
        gaps: list[float] = []
        for i in range(args.repeats):
            progress(f"{streams} streams on a shared prefix: batch {i + 1}/{args.repeats}")
            prefix = words(rng, args.shared, "p")
            await complete(session, args.url, args.model, prefix, 1)  # cache the prefix
            replies = await asyncio.gather(*(
                complete(session, args.url, args.model, f"{prefix} {words(rng, args.own, 'u')}",
                         args.max_tokens) for _ in range(streams)))
            for reply in replies:
                times = token_times(reply, args.max_tokens)
                mid = times[len(times) // 4: 3 * len(times) // 4]
                gaps += [b - a for a, b in itertools.pairwise(mid)]
        row: list[object] = [streams, args.shared, args.own,
                             round(statistics.fmean(gaps) * 1e3, 3) if gaps else None]
        if args.pool_tokens:
            context = args.shared + args.own + args.max_tokens // 2  # mid-stream
            own_pages = (math.ceil(context / args.block_size)
                         - args.shared // args.block_size)
            held = (args.shared // args.block_size + streams * own_pages) * args.block_size
            row += [round(mocker_ms(streams * context / args.pool_tokens), 3),
                    round(mocker_ms(held / args.pool_tokens), 3)]
        rows.append(row)
    print(f"\nstreams sharing a prefix: {args.max_tokens} tokens out, mean gap of each "
          f"stream's middle half over {args.repeats} batches")
    print_table(header, rows)


async def run(args: argparse.Namespace) -> None:
    import aiohttp

    rng = random.Random(args.seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await one_stream(session, args, rng)
        if args.streams:
            await shared_streams(session, args, rng)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", help="the engine's (or a frontend's) base URL")
    p.add_argument("--model", default="tiny", help="the served model name")
    p.add_argument("--prompt", type=int, default=200, help="one stream's prompt, in words")
    p.add_argument("--max-tokens", type=int, default=40, help="tokens out a request")
    p.add_argument("--repeats", type=int, default=10, help="requests (or batches) a row")
    p.add_argument("--shared", type=int, default=288, help="the shared prefix, in words")
    p.add_argument("--own", type=int, default=20, help="each stream's own words")
    p.add_argument("--streams", type=int, nargs="*", default=[1, 2, 3],
                   help="stream counts of the shared-prefix probe (none: skip it)")
    p.add_argument("--pool-tokens", type=int,
                   help="the engine's KV pool in tokens: print the mocker's polynomial too")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    if args.max_tokens < 8:
        p.error("--max-tokens must be at least 8: the probes read gaps mid-stream")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
