"""Trace loading: Mooncake JSONL and Azure CSV into one record type, with clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.traces import TraceError, load_trace, with_prefix_share

SHARED = Path(__file__).resolve().parents[4] / "shared" / "traces"


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_records_are_read_with_seconds_and_ids(tmp_path: Path) -> None:
    """Timestamps in ms become seconds from the first request; ids are kept in order."""
    path = _jsonl(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 2500, "input_length": 100, "output_length": 0, "hash_ids": [0]},
        ],
    )
    a, b = load_trace(path)
    assert (a.arrival_s, b.arrival_s) == (0.0, 1.5)
    assert a.hash_ids == (0, 1) and b.input_tokens == 100 and b.output_tokens == 0


def test_wrong_number_of_ids_names_the_line(tmp_path: Path) -> None:
    """A record whose ids do not cover its prompt is refused with file and line."""
    path = _jsonl(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]},
            {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1]},
        ],
    )
    with pytest.raises(TraceError, match=r"t\.jsonl:2: 2 hash ids for 1100 tokens"):
        load_trace(path)


def test_malformed_json_and_missing_files_are_trace_errors(tmp_path: Path) -> None:
    """Bad JSON, missing fields, empty files and missing paths raise TraceError."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: not a Mooncake record"):
        load_trace(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="no request"):
        load_trace(empty)
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")


def test_azure_csv_is_read_relative_to_its_first_row(tmp_path: Path) -> None:
    """Azure's seven-digit fractional timestamps parse; records carry no ids."""
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n"
        "2023-11-16 18:17:05.4799600,1200,3\n"
    )
    a, b = load_trace(path)
    assert a.arrival_s == 0.0 and b.arrival_s == pytest.approx(1.5)
    assert a.hash_ids == () and a.input_tokens == 4808


def test_limit_keeps_the_first_records() -> None:
    """--limit reads only the first N records of a real trace."""
    records = load_trace(SHARED / "conversation_trace.jsonl", limit=50)
    assert len(records) == 50 and records[0].index == 0 and records[-1].index == 49


def test_prefix_share_gives_azure_records_shared_leading_ids(tmp_path: Path) -> None:
    """With share 0.5, half of each prompt is a shared prefix; share 0 is all unique."""
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:17:0{i}.0000000,4096,10\n" for i in range(6))
    )
    records = load_trace(path)
    shared = with_prefix_share(records, 0.5, num_prefixes=1)
    assert all(len(r.hash_ids) == 8 for r in shared)
    assert len({r.hash_ids[:4] for r in shared}) == 1
    assert len({r.hash_ids[4:] for r in shared}) == 6
    unique = with_prefix_share(records, 0.0)
    assert len({i for r in unique for i in r.hash_ids}) == 6 * 8
    with pytest.raises(ValueError, match="prefix share"):
        with_prefix_share(records, 1.5)
