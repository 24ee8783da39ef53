"""Request traces: Mooncake JSONL and Azure CSV, read into one record type.

Mooncake records carry ``hash_ids``, one id per ``TRACE_BLOCK_TOKENS``-token block of the
prompt, each standing for the whole prefix up to that block (equal ids ⇒ equal prefixes).
Azure records carry only arrival times and lengths; ``with_prefix_share`` synthesizes shared
prefixes on top, in the same id form, so everything downstream handles one shape.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "TraceError",
    "TraceRecord",
    "load_for_replay",
    "load_trace",
    "with_prefix_share",
]

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request: when it arrives, how long its prompt and answer are, its prefix ids."""

    index: int
    arrival_s: float  # relative to the trace's first request
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # one per TRACE_BLOCK_TOKENS-token block; may be empty


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Read a Mooncake ``.jsonl`` or Azure ``.csv`` trace (by extension)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace {path} does not exist")
    reader = _read_csv if path.suffix.lower() == ".csv" else _read_jsonl
    records = list(itertools.islice(reader(path), limit))
    if not records:
        raise TraceError(f"trace {path} holds no request")
    t0 = records[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in records]


def _read_jsonl(path: Path) -> Iterator[TraceRecord]:
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                record = TraceRecord(
                    index=lineno - 1,
                    arrival_s=float(obj["timestamp"]) / 1000.0,
                    input_tokens=int(obj["input_length"]),
                    output_tokens=int(obj["output_length"]),
                    hash_ids=tuple(int(h) for h in obj.get("hash_ids", ())),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: not a Mooncake record: {exc}") from exc
            _check(record, path, lineno)
            yield record


def _read_csv(path: Path) -> Iterator[TraceRecord]:
    with path.open(newline="") as f:
        rows = csv.DictReader(f)
        for lineno, row in enumerate(rows, 2):
            try:
                stamp = row["TIMESTAMP"]
                # Seven fractional digits: trim to the six datetime parses.
                head, _, frac = stamp.partition(".")
                when = datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")
                record = TraceRecord(
                    index=lineno - 2,
                    arrival_s=when.timestamp(),
                    input_tokens=int(row["ContextTokens"]),
                    output_tokens=int(row["GeneratedTokens"]),
                    hash_ids=(),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: not an Azure record: {exc}") from exc
            _check(record, path, lineno)
            yield record


def _check(record: TraceRecord, path: Path, lineno: int) -> None:
    if record.input_tokens < 1 or record.output_tokens < 0:
        raise TraceError(f"{path}:{lineno}: lengths must be positive: {record}")
    if record.hash_ids and len(record.hash_ids) != math.ceil(
        record.input_tokens / TRACE_BLOCK_TOKENS
    ):
        raise TraceError(
            f"{path}:{lineno}: {len(record.hash_ids)} hash ids for {record.input_tokens} "
            f"tokens (expected one per {TRACE_BLOCK_TOKENS}-token block)"
        )


def with_prefix_share(
    records: Iterable[TraceRecord],
    share: float,
    num_prefixes: int = 32,
    seed: int = 0,
) -> list[TraceRecord]:
    """Give records without prefix ids synthetic ones: the first ``share`` of each prompt is
    one of ``num_prefixes`` shared prefixes (Zipf-popular), the rest unique to the request."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"prefix share must be in [0, 1], got {share}")
    if num_prefixes < 1:
        raise ValueError(f"need at least one shared prefix, got {num_prefixes}")
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) for k in range(num_prefixes)]
    # prefix k owns ids [k·span, (k+1)·span); unique blocks come after every prefix's range
    span = 1 << 24
    fresh = itertools.count(num_prefixes * span)
    out = []
    for record in records:
        if record.hash_ids:
            out.append(record)
            continue
        blocks = math.ceil(record.input_tokens / TRACE_BLOCK_TOKENS)
        shared = min(blocks, int(record.input_tokens * share) // TRACE_BLOCK_TOKENS)
        if shared > span:
            raise ValueError(f"record {record.index}: {shared} shared blocks exceed {span}")
        prefix = rng.choices(range(num_prefixes), weights)[0]
        ids = [prefix * span + i for i in range(shared)]
        ids += [next(fresh) for _ in range(blocks - shared)]
        out.append(replace(record, hash_ids=tuple(ids)))
    return out


def load_for_replay(
    path: str | Path, limit: int | None = None, prefix_share: float = 0.0, seed: int = 0
) -> list[TraceRecord]:
    """``load_trace``, then synthetic prefix ids for records that have none (Azure): a shared
    ``prefix_share`` of each prompt, the rest unique, so every record can be replayed."""
    records = load_trace(path, limit)
    if not prefix_share and all(r.hash_ids for r in records):
        return records
    return with_prefix_share(records, prefix_share, seed=seed)
