#!/usr/bin/env python3
"""Placement latency: tokenize + hash + match + score for 1k- and 16k-token chat prompts.

The index holds a realistic state: 8 workers, 24 shared system prompts (half a query long),
600 multi-turn sessions over them (each on one worker, every prompt block stored), so a
query's system prompt is matched deep on some workers. Queries are rendered chats (the model
directory's template), a shared system prompt and then:

* ``cold``: a new user text, with the gateway's tokenizer cache emptied before each query;
* ``shared``: the same, cache kept (the shared system prompt's tokens come from it);
* ``turn``: the next turn of a conversation whose history was tokenized before.

Ours, as the gateway runs it: ``PromptTokenizer.encode_chat`` (segment cache) +
``PrefixHashCache.hash_tokens`` (hashes of cached prefixes reused) + ``KvRouter.place``
(prefix match over every tier, speculative prefixes, load, cost). Baseline, same run, same
text: the same ``tokenizers`` tokenizer on the whole text + Dynamo's
``compute_block_hash_for_seq`` + ``RadixTree.find_matches`` (no scoring) from
``ai-dynamo-runtime``. Ratios are baseline / ours (>= 1: we are as fast or faster).

Also the event loop's hold for a cold prompt: the gateway tokenizes an uncached text of
8,192 characters or more in a worker thread (``routing.pipeline.admit``), so the loop is held
only for the passes before and after it; ``loop_hold_*_vs_inline`` sets that against doing
it all on the loop.

    scripts/bench_placement.py [--model-path DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchkit import ROOT, Report, add_json_flag, print_table

from kvcore import BlockHasher, Namespace
from kvcore.events import BlockStored, Tier
from routing.pipeline.admit import DEFER_CHARS
from routing.placement.kv_router import KvRouter
from routing.prompt.chat_template import ChatTemplate
from routing.prompt.hash_cache import PrefixHashCache
from routing.prompt.tokenizer import PromptTokenizer, TokenizeLater

BLOCK_SIZE = 16
WORKERS = [f"worker-{i}" for i in range(8)]
KINDS = ("cold", "shared", "turn")
WORDS = (  # noqa: SIM905 (a sentence reads better than a list of 90 strings)
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega router cache prefix "
    "token engine replica gateway stream latency the of and to in is that for it with as was "
    "on be by this are from or have an they which one you were all we can her has there been "
    "if more when will would who so no function return value class import def self none true "
    "3.14 42 1024 (x) [i] {k}: -> == != <= >= + - * / ; , . ! ?"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def text_of_tokens(tok: PromptTokenizer, rng: random.Random, tokens: int) -> str:
    """Random text of about ``tokens`` tokens under this tokenizer."""
    sample = words(rng, 400)
    per_word = len(tok.encode_full(sample, False)) / 400
    return words(rng, max(1, int(tokens / per_word)))


def percentile(samples: list[float], q: float) -> float:
    samples = sorted(samples)
    return samples[min(len(samples) - 1, int(len(samples) * q))]


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t) / 1e3


class Bench:
    def __init__(self, model_path: Path, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.tok = PromptTokenizer.from_model_dir(model_path)
        template = ChatTemplate.from_model_dir(model_path)
        if template is None:
            raise SystemExit(f"{model_path} has no chat template")
        self.template = template
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.hash_cache = PrefixHashCache(self.hasher)
        self.seed = Namespace("bench-model").seed
        self.router = KvRouter(block_size=BLOCK_SIZE, rng=random.Random(seed))
        # Shared system prompts, half a query long: 1k queries use the 512-token ones.
        self.systems = {
            size: [text_of_tokens(self.tok, self.rng, size // 2) for _ in range(count)]
            for size, count in ((1024, 20), (16384, 4))
        }
        self.dynamo = None
        try:
            from dynamo.llm import RadixTree, compute_block_hash_for_seq

            self.dynamo = RadixTree()
            self.dyn_hash = compute_block_hash_for_seq
        except ImportError:
            pass
        self._dyn_event_ids = {w: 0 for w in range(len(WORKERS))}

    def chat(self, system: str, turns: list[str]) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": system}]
        for i, content in enumerate(turns):
            messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
        return messages

    def store(self, worker: int, tokens: list[int]) -> None:
        hashes = self.hasher.hash_tokens(tokens, self.seed)
        seq = self.router.index.position(WORKERS[worker])
        self.router.apply(
            BlockStored(WORKERS[worker], 0, (seq[1] if seq else 0) + 1, Tier.GPU, hashes)
        )
        if self.dynamo is not None:
            local = self.dyn_hash(tokens[: len(hashes) * BLOCK_SIZE], BLOCK_SIZE)
            self._dyn_event_ids[worker] += 1
            event = {
                "event_id": self._dyn_event_ids[worker],
                "dp_rank": 0,
                "data": {
                    "stored": {
                        "parent_hash": None,
                        "blocks": [
                            {"block_hash": h, "tokens_hash": t}
                            for h, t in zip(hashes, local, strict=True)
                        ],
                    }
                },
            }
            self.dynamo.apply_event(worker, json.dumps(event).encode())

    def build_state(self, sessions: int) -> None:
        texts, owners = [], []
        for s in range(sessions):
            pool = self.systems[16384 if s % 10 == 0 else 1024]
            system = pool[s % len(pool)]
            turns = [words(self.rng, self.rng.randrange(20, 200)) for _ in range(1 + s % 5)]
            texts.append(self.template.render(self.chat(system, turns)))
            owners.append(self.rng.randrange(len(WORKERS)))
        for text, worker in zip(texts, owners, strict=True):
            self.store(worker, self.tok.encode_full(text, False))

    def queries(self, size: int, n: int, warm: bool) -> list[str]:
        """Chats of about ``size`` tokens that open with a shared (indexed) system prompt."""
        out = []
        for _ in range(n):
            system = self.rng.choice(self.systems[size])
            if warm:  # the next turn of a conversation whose history was tokenized before
                history = [text_of_tokens(self.tok, self.rng, size // 6) for _ in range(2)]
                self.tok.encode_chat(self.template.render(self.chat(system, history)))
                turns = [*history, text_of_tokens(self.tok, self.rng, size // 6)]
            else:  # a new user text after the shared system prompt
                turns = [text_of_tokens(self.tok, self.rng, size // 2)]
            out.append(self.template.render(self.chat(system, turns)))
        return out

    def ours(self, text: str, defer_chars: int | None = None) -> object:
        bounds: list[tuple[int, int]] = []
        tokens = self.tok.encode_chat(text, bounds, defer_chars)
        hashes = self.hash_cache.hash_tokens(tokens, bounds, self.seed)
        return self.router.place(hashes, len(tokens), WORKERS)

    def loop_hold(self, text: str) -> float:
        """µs the event loop is held placing ``text`` as the gateway does: the pass that
        hands a long uncached text off, then the pass with its ids (the tokenizing in a
        thread between them is not on the loop)."""
        t0 = time.perf_counter()
        try:
            self.ours(text, DEFER_CHARS)
        except TokenizeLater as later:
            hold = time.perf_counter() - t0
            ids = self.tok.encode_off_loop(later.text, later.add_special_tokens)
            self.tok.offer(later.text, later.add_special_tokens, ids)
            t1 = time.perf_counter()
            self.ours(text, DEFER_CHARS)
            self.tok.withdraw()
            return (hold + time.perf_counter() - t1) * 1e6
        return (time.perf_counter() - t0) * 1e6

    def theirs(self, text: str) -> object:
        tokens = self.tok.encode_full(text, False)
        local = self.dyn_hash(tokens, BLOCK_SIZE)
        return self.dynamo.find_matches(local)  # type: ignore[union-attr]


def run(model_path: Path, sessions: int, reps: int) -> dict[str, float]:
    bench = Bench(model_path)
    t = time.perf_counter()
    bench.build_state(sessions)
    fig: dict[str, float] = {
        "state_build_s": time.perf_counter() - t,
        "indexed_blocks": float(bench.router.index.num_blocks()),
    }
    for size, label in ((1024, "1k"), (16384, "16k")):
        for kind in KINDS:
            n = reps if size == 1024 else max(10, reps // 8)
            queries = bench.queries(size, n, warm=kind == "turn")
            tokens = [len(bench.tok.encode_full(q, False)) for q in queries]
            fig[f"{label}_{kind}_prompt_tokens"] = statistics.mean(tokens)
            ours = []
            for q in queries:
                if kind == "cold":  # nothing cached: not even the shared system prompt
                    bench.tok.clear_cache()
                    bench.hash_cache.clear()
                ours.append(timed(lambda q=q: bench.ours(q)))
            fig[f"placement_{label}_{kind}_p50_us"] = percentile(ours, 0.5)
            fig[f"placement_{label}_{kind}_p99_us"] = percentile(ours, 0.99)
            if bench.dynamo is not None:
                theirs = [timed(lambda q=q: bench.theirs(q)) for q in queries]
                fig[f"dynamo_placement_{label}_{kind}_p50_us"] = percentile(theirs, 0.5)
                fig[f"dynamo_placement_{label}_{kind}_p99_us"] = percentile(theirs, 0.99)
        # The event loop's longest hold for a cold prompt: all of it inline, against the
        # gateway's way (a long uncached text tokenized in a thread).
        inline, deferred = [], []
        for q in bench.queries(size, max(10, reps // 8), warm=False):
            bench.tok.clear_cache()
            bench.hash_cache.clear()
            inline.append(timed(lambda q=q: bench.ours(q)))
            bench.tok.clear_cache()
            bench.hash_cache.clear()
            deferred.append(bench.loop_hold(q))
        fig[f"loop_hold_{label}_cold_inline_p50_us"] = percentile(inline, 0.5)
        fig[f"loop_hold_{label}_cold_p50_us"] = percentile(deferred, 0.5)
        # Where the time goes, on one cold prompt: each step alone.
        q = bench.queries(size, 1, warm=False)[0]
        toks = bench.tok.encode_full(q, False)
        hashes = bench.hasher.hash_tokens(toks, bench.seed)
        n_toks = len(toks)
        steps = {
            "tokenize": lambda q=q: bench.tok.encode_full(q, False),
            "hash": lambda t=toks: bench.hasher.hash_tokens(t, bench.seed),
            "match_score": lambda h=hashes, n=n_toks: bench.router.place(h, n, WORKERS),
        }
        for name, fn in steps.items():
            fig[f"{name}_{label}_p50_us"] = statistics.median(timed(fn) for _ in range(50))
        if bench.dynamo is not None:
            local = bench.dyn_hash(toks, BLOCK_SIZE)
            fig[f"dynamo_hash_{label}_p50_us"] = statistics.median(
                timed(lambda t=toks: bench.dyn_hash(t, BLOCK_SIZE)) for _ in range(50)
            )
            fig[f"dynamo_match_{label}_p50_us"] = statistics.median(
                timed(lambda lo=local: bench.dynamo.find_matches(lo)) for _ in range(50)
            )
    return fig


COMPARED = [
    f"placement_{s}_{k}_{q}_us" for s in ("1k", "16k") for k in KINDS for q in ("p50", "p99")
] + [f"{x}_{s}_p50_us" for s in ("1k", "16k") for x in ("hash", "match")]


def ours_of(name: str) -> str:
    """Our figure compared with Dynamo's ``dynamo_<name>``: the match step is ours with
    scoring."""
    return name.replace("match", "match_score") if name.startswith("match") else name


def add_ratios(report: Report) -> None:
    """The loop's hold against doing it all inline, and each time against Dynamo's (lower is
    better), where both were measured."""
    fig = report.figures
    for s in ("1k", "16k"):
        held = fig.get(f"loop_hold_{s}_cold_p50_us")
        if held:
            report.ratio(f"loop_hold_{s}_cold_p50_us", "inline", held,
                         fig[f"loop_hold_{s}_cold_inline_p50_us"], better="lower")
    for name in COMPARED:
        ours, theirs = fig.get(ours_of(name)), fig.get(f"dynamo_{name}")
        if ours and theirs:
            report.ratio(name, "dynamo", ours, theirs, better="lower")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-path",
        type=Path,
        default=ROOT / "refengine" / "models" / "tiny",
        help="model directory with tokenizer.json and a chat template "
        "(default: the reference engine's tiny model)",
    )
    parser.add_argument("--sessions", type=int, default=600)
    parser.add_argument("--reps", type=int, default=200, help="1k-token queries (16k: reps/8)")
    add_json_flag(parser)
    args = parser.parse_args(argv)
    if not (args.model_path / "tokenizer.json").is_file():
        parser.error(f"{args.model_path} has no tokenizer.json")
    report = Report()
    report.add_figures(run(args.model_path, args.sessions, args.reps))
    add_ratios(report)
    fig, rat = report.figures, report.ratios
    print(
        f"index: {fig['indexed_blocks']:,.0f} blocks on {len(WORKERS)} workers "
        f"(built in {fig['state_build_s']:.1f} s); tokenizer: {args.model_path}"
    )
    print_table(
        ["figure (µs)", "kvsidecar", "dynamo", "ratio"],
        [[ours_of(name), fig.get(ours_of(name)), fig.get(f"dynamo_{name}"),
          rat.get(f"{name}_vs_dynamo")] for name in COMPARED]
        + [[f"loop hold {label} cold (inline)", fig[f"loop_hold_{label}_cold_p50_us"],
            fig[f"loop_hold_{label}_cold_inline_p50_us"],
            rat.get(f"loop_hold_{label}_cold_p50_us_vs_inline")] for label in ("1k", "16k")],
    )
    for label in ("1k", "16k"):
        name = f"tokenize_{label}_p50_us"
        print(f"{name + ' (same lib)':<32}{fig[name]:>12,.1f}")
        for kind in KINDS:
            print(
                f"  mean prompt tokens {label} {kind}: {fig[f'{label}_{kind}_prompt_tokens']:,.0f}"
            )
    print(
        "ratio = dynamo / kvsidecar: >= 1 means we are as fast or faster; "
        "dynamo's side does no scoring"
    )
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
