"""``kvsidecar replay --offline``: tables on stdout, a report with plots, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.__main__ import main as kvsidecar_main

SHARED = Path(__file__).resolve().parents[4] / "shared" / "traces"
TRACE = str(SHARED / "conversation_trace.jsonl")


@pytest.mark.slow  # two traces replayed offline and plotted: seconds
def test_offline_report_has_tables_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two policies and the bounds on two traces: report.md lists them, PNGs are drawn."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    rc = kvsidecar_main(
        [
            "replay",
            TRACE,
            str(SHARED / "synthetic_trace.jsonl"),
            "--offline",
            "--limit",
            "150",
            "--replicas",
            "4",
            "--capacity-share",
            "0.2",
            "--policy",
            "kv",
            "--policy",
            "least-loaded",
            "--policy",
            "oracle",
            "--report",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| kv |" in stdout and "| least-loaded |" in stdout
    assert "bound: pooled-belady" in stdout
    text = (out / "report.md").read_text()
    assert "## conversation_trace.jsonl" in text and "## synthetic_trace.jsonl" in text
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 8
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({name})" in text


def test_azure_trace_with_a_prefix_share_replays_offline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An Azure CSV gets synthetic shared prefixes and then hits the cache under kv."""
    csv = SHARED / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    rc = kvsidecar_main(
        [
            "replay",
            str(csv),
            "--offline",
            "--limit",
            "300",
            "--replicas",
            "2",
            "--capacity-tokens",
            "200000",
            "--prefix-share",
            "0.5",
            "--policy",
            "kv",
            "--quiet",
        ]
    )
    assert rc == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| kv"))
    assert float(row.split("|")[2].strip().rstrip("%")) > 10.0


def test_missing_capacity_and_bad_traces_fail_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit code 2 and a one-line reason, for a missing capacity and an unreadable trace."""
    assert kvsidecar_main(["replay", TRACE, "--offline", "--limit", "5"]) == 2
    assert "--capacity-tokens or --capacity-share" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert kvsidecar_main(["replay", str(bad), "--offline", "--capacity-tokens", "9999"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_the_replay_package_never_imports_torch() -> None:
    """``replay`` uses the engine's timing model, not its torch code (fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "import sys, replay.__main__, replay.offline, replay.live, replay.report; "
        "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
