"""The bench kit (scripts/benchkit.py): ratios named and oriented by the kit, values checked,
the JSON report's exact shape, the shared flag and printing, and every bench script on it."""

from __future__ import annotations

import argparse
import ast
import json
import math
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.scripts import SCRIPTS, load_script

benchkit = load_script("benchkit")
Report = benchkit.Report
ReportError = benchkit.ReportError

BENCH_SCRIPTS = sorted(SCRIPTS.glob("bench_*.py"))
OURS = {"kvcore", "shm", "adapters", "sidecar", "routing", "refengine", "replay", "kvsidecar"}


class TestRatio:
    def test_higher_is_better_divides_ours_by_theirs(self) -> None:
        """A rate's ratio is ours / the baseline's, named <figure>_vs_<baseline>."""
        report = Report()
        assert report.ratio("blocks_per_s", "plain_decode", 300.0, 200.0, better="higher") == 1.5
        assert report.ratios == {"blocks_per_s_vs_plain_decode": 1.5}

    def test_lower_is_better_divides_theirs_by_ours(self) -> None:
        """A latency's ratio is the baseline's / ours, so >= 1 still means as good or better."""
        report = Report()
        assert report.ratio("ttft_p99", "round_robin", 0.5, 2.0, better="lower") == 4.0
        assert report.ratio("match_p50_us", "dynamo", 20.0, 10.0, better="lower") == 0.5
        assert list(report.ratios) == ["ttft_p99_vs_round_robin", "match_p50_us_vs_dynamo"]

    def test_ndigits_rounds_the_ratio(self) -> None:
        """``ndigits`` rounds as ``round`` does, for scripts whose ratios were always rounded."""
        report = Report()
        assert report.ratio("warm_start", "full_replay", 3.0, 7.0, better="lower",
                            ndigits=3) == 2.333
        assert report.ratios["warm_start_vs_full_replay"] == 2.333

    def test_ours_zero_where_higher_is_better_is_a_ratio_of_zero(self) -> None:
        """Nothing hit where the baseline hit something is a ratio of 0, not an error."""
        assert Report().ratio("hit_rate", "round_robin", 0.0, 0.4, better="higher") == 0.0

    @pytest.mark.parametrize(("ours", "theirs", "better"), [
        (1.0, 0.0, "higher"), (0.0, 1.0, "lower"), (0.0, 0.0, "higher"), (0.0, 0.0, "lower")])
    def test_a_zero_divisor_is_refused(self, ours: float, theirs: float, better: str) -> None:
        """A ratio whose divisor is 0 has no value: refused, saying which side was 0."""
        with pytest.raises(ReportError, match="is 0"):
            Report().ratio("hit_rate", "round_robin", ours, theirs, better=better)

    @pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, "1.0", None, True])
    def test_a_bad_value_is_refused(self, bad: object) -> None:
        """NaN, infinities, negatives and non-numbers are refused on either side."""
        for ours, theirs in ((bad, 1.0), (1.0, bad)):
            with pytest.raises(ReportError, match="ratio hit_rate_vs_round_robin"):
                Report().ratio("hit_rate", "round_robin", ours, theirs, better="higher")

    def test_better_must_be_higher_or_lower(self) -> None:
        """The orientation is one of two words; anything else is refused, not guessed."""
        with pytest.raises(ReportError, match="better='faster'"):
            Report().ratio("ttft", "cold", 1.0, 2.0, better="faster")

    @pytest.mark.parametrize(("figure", "baseline"), [
        ("hit_rate_vs_one", "two"), ("hit_rate", "a_vs_b"), ("", "cold"), ("ttft", ""),
        ("ttft p99", "cold"), ("ttft", "cold/warm"), ("_ttft", "cold")])
    def test_a_malformed_name_is_refused(self, figure: str, baseline: str) -> None:
        """Each part is a plain name without ``_vs_``: the name has one figure, one baseline."""
        with pytest.raises(ReportError):
            Report().ratio(figure, baseline, 1.0, 1.0, better="higher")

    def test_a_ratio_is_added_once(self) -> None:
        """The same ratio twice is a script's mistake: refused, both values in the message."""
        report = Report()
        report.ratio("ttft", "cold", 1.0, 2.0, better="lower")
        with pytest.raises(ReportError, match="added twice"):
            report.ratio("ttft", "cold", 1.0, 3.0, better="lower")


class TestFigure:
    def test_figures_keep_their_order_and_type(self) -> None:
        """Figures come back in the order added; ints stay ints, numpy floats become floats."""
        np = pytest.importorskip("numpy")
        report = Report()
        assert report.figure("requests", 12) == 12
        report.figure("rss_growth", -0.25)  # a figure may be negative
        report.figure("gbps", np.float64(1.5))
        assert list(report.figures.items()) == [("requests", 12), ("rss_growth", -0.25),
                                                ("gbps", 1.5)]
        assert type(report.figures["requests"]) is int
        assert type(report.figures["gbps"]) is float

    @pytest.mark.parametrize("bad", [math.nan, math.inf, "3", None, False])
    def test_a_bad_value_is_refused(self, bad: object) -> None:
        """A figure JSON cannot hold or a session cannot compare is refused, by name."""
        with pytest.raises(ReportError, match="figure ttft_p99_s"):
            Report().figure("ttft_p99_s", bad)

    def test_names_as_the_scripts_write_them_are_accepted(self) -> None:
        """Modes, sizes and policies: ``pinned.x``, ``put_256KiB_b64_gbps``, ``round-robin_x``."""
        report = Report()
        for name in ("pinned.mixed_events_per_s", "put_256KiB_b64_gbps", "round-robin_hit_rate",
                     "sweep_ow0.5_ps10_1024_gap", "reachable_hit_rate_vs_dynamo_1024"):
            report.figure(name, 1.0)
        assert len(report.figures) == 5

    @pytest.mark.parametrize("bad", ["", "a b", "ttft/s", ".hidden", "x\n"])
    def test_a_malformed_name_is_refused(self, bad: str) -> None:
        """Names are letters, digits, ``_``, ``.`` and ``-``, starting with a letter or digit."""
        with pytest.raises(ReportError, match="figure name"):
            Report().figure(bad, 1.0)

    def test_a_figure_is_added_once(self) -> None:
        """The same figure twice would silently overwrite a measurement: refused."""
        report = Report()
        report.figure("ttft_s", 1.0)
        with pytest.raises(ReportError, match="added twice"):
            report.add_figures({"ttft_s": 2.0})

    def test_add_figures_prefixes_every_name(self) -> None:
        """``add_figures(values, prefix=...)`` adds each under the prefix, in order."""
        report = Report()
        report.add_figures({"ttft_ms": 3.0, "hit_rate": 0.5}, prefix="kv_")
        assert dict(report.figures) == {"kv_ttft_ms": 3.0, "kv_hit_rate": 0.5}

    def test_the_views_are_read_only(self) -> None:
        """What ``figures`` and ``ratios`` return cannot bypass the checks."""
        report = Report()
        with pytest.raises(TypeError):
            report.figures["x"] = math.nan  # type: ignore[index]
        with pytest.raises(TypeError):
            report.ratios["x_vs_y"] = -1.0  # type: ignore[index]


class TestJson:
    def test_write_json_writes_exactly_figures_and_ratios(self, tmp_path: Path) -> None:
        """The file is ``{"figures": {...}, "ratios": {...}}`` and nothing else."""
        report = Report()
        report.figure("kv_ttft_p99_ms", 50.0)
        report.figure("round-robin_ttft_p99_ms", 100)
        report.ratio("ttft_p99", "round_robin", 50.0, 100, better="lower")
        out = tmp_path / "bench.json"
        report.write_json(out)
        text = out.read_text()
        assert text.endswith("\n")
        assert json.loads(text) == {
            "figures": {"kv_ttft_p99_ms": 50.0, "round-robin_ttft_p99_ms": 100},
            "ratios": {"ttft_p99_vs_round_robin": 2.0},
        }
        assert json.loads(text) == report.as_dict()

    def test_an_empty_report_still_has_both_keys(self, tmp_path: Path) -> None:
        """A run that measured nothing writes both keys, empty."""
        out = tmp_path / "empty.json"
        Report().write_json(out)
        assert json.loads(out.read_text()) == {"figures": {}, "ratios": {}}

    def test_include_prefixes_another_reports_figures_and_ratios(self) -> None:
        """One report per pass, gathered under ``<mode>.``, ratios kept as they were."""
        one = Report()
        one.figure("match_p50_us", 10.0)
        one.ratio("match_p50_us", "dynamo", 10.0, 20.0, better="lower")
        report = Report()
        report.include(one, prefix="pinned.")
        report.include(one, prefix="unpinned.")
        assert report.as_dict() == {
            "figures": {"pinned.match_p50_us": 10.0, "unpinned.match_p50_us": 10.0},
            "ratios": {"pinned.match_p50_us_vs_dynamo": 2.0,
                       "unpinned.match_p50_us_vs_dynamo": 2.0},
        }
        with pytest.raises(ReportError, match="added twice"):
            report.include(one, prefix="pinned.")


class TestRepeats:
    """What several runs of one configuration say: their spread, and a ratio's error."""

    def test_run_spread_is_the_sd_of_single_runs_relative_to_the_pooled(self) -> None:
        assert benchkit.run_spread([0.5, 0.6, 0.7], 0.6) == pytest.approx(0.1 / 0.6)
        assert benchkit.run_spread([3.0, 3.0], 3.0) == 0.0

    @pytest.mark.parametrize(("runs", "pooled"), [([0.7], 0.7), ([], 0.0), ([0.0, 0.0], 0.0)])
    def test_one_run_or_a_pooled_zero_has_no_spread(self, runs: list[float],
                                                    pooled: float) -> None:
        assert benchkit.run_spread(runs, pooled) == 0.0

    def test_a_ratios_error_adds_both_sides_in_quadrature_over_sqrt_runs(self) -> None:
        """3 % and 4 % a run on either side: 5 % of the ratio a run, half that over 4 runs."""
        assert benchkit.ratio_se(2.0, 0.03, 0.04, 4) == pytest.approx(2.0 * 0.05 / 2)
        assert benchkit.ratio_se(0.9, 0.0, 0.0, 3) == 0.0

    def test_a_ratios_error_needs_a_run(self) -> None:
        with pytest.raises(ValueError, match="runs must be >= 1"):
            benchkit.ratio_se(1.0, 0.1, 0.1, 0)


class TestCommandLine:
    def test_the_json_flag_takes_a_file(self, tmp_path: Path) -> None:
        """``--json FILE`` is a Path; absent, None."""
        parser = argparse.ArgumentParser()
        benchkit.add_json_flag(parser)
        assert parser.parse_args([]).json is None
        assert parser.parse_args(["--json", str(tmp_path / "x.json")]).json == tmp_path / "x.json"

    def test_progress_goes_to_stderr_with_a_time(self, capsys: pytest.CaptureFixture[str]) -> None:
        """Progress lines are ``[script HH:MM:SS] message`` on stderr; stdout stays results."""
        benchkit.progress("running a pass")
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith("[") and err.endswith("] running a pass\n")
        assert err.split("] ")[0].split()[-1].count(":") == 2

    def test_print_ratios_aligns_names_and_values(
            self, capsys: pytest.CaptureFixture[str]) -> None:
        """One line per ratio under a heading that says >= 1 is as good or better."""
        report = Report()
        report.ratio("hit_rate", "round_robin", 3.0, 2.0, better="higher")
        report.ratio("ttft_p99", "least_loaded", 1.0, 4.0, better="lower")
        report.print_ratios("kv", notes={"ttft_p99_vs_least_loaded": "target >= 1"})
        lines = capsys.readouterr().out.splitlines()
        assert lines[1] == "ratios (>= 1: kv as good as the baseline or better):"
        assert lines[2:] == ["  hit_rate_vs_round_robin   1.500",
                             "  ttft_p99_vs_least_loaded  4.000  target >= 1"]

    def test_print_table_aligns_columns(self, capsys: pytest.CaptureFixture[str]) -> None:
        """The first column left, the rest right; numbers formatted; None is ``-``."""
        benchkit.print_table(["figure", "ours", "dynamo"],
                             [["events_per_s", 123456.7, None], ["match_us", 12.5, 3]])
        assert capsys.readouterr().out.splitlines() == [
            "figure           ours  dynamo",
            "events_per_s  123,457       -",
            "match_us        12.50       3",
        ]

    @pytest.mark.parametrize(("value", "text"), [
        (1234567, "1,234,567"), (1234.5, "1,234"), (123.46, "123.5"), (1.23456, "1.235"),
        (0.000123456, "0.0001235"), (-2.5, "-2.500")])
    def test_format_value(self, value: float, text: str) -> None:
        """Ints with separators; floats to about four significant digits, no exponent >= 1."""
        assert benchkit.format_value(value) == text


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of every import in ``path``, in order."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return sorted(found)


@pytest.mark.parametrize("path", BENCH_SCRIPTS, ids=lambda p: p.stem)
class TestEveryBenchScript:
    def test_it_imports_the_kit_before_any_package_of_ours(self, path: Path) -> None:
        """The kit's import puts this checkout on sys.path before ours are imported."""
        imports = _imports(path)
        assert "benchkit" in {name for _, name in imports}, f"{path.name} does not use the kit"
        kit = [line for line, name in imports if name.startswith("bench")]  # or a script on it
        ours = [line for line, name in imports if name in OURS]
        assert not ours or min(kit) < min(ours), f"{path.name} imports ours before benchkit"

    def test_it_writes_no_report_of_its_own(self, path: Path) -> None:
        """No script edits sys.path or writes ``{"figures", "ratios"}`` itself."""
        text = path.read_text()
        assert "sys.path.insert" not in text and "sys.path.append" not in text
        assert '"ratios":' not in text.replace('``{"figures": {...}, "ratios": {...}}``', "")
        assert "def progress(" not in text


class TestStreamReply:
    """A streamed reply read by the kit: first-event time, gaps, text, usage, status."""

    @staticmethod
    def _app() -> web.Application:
        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            if body.get("model") != "tiny":
                return web.json_response({"error": {"message": "no such model"}}, status=404)
            resp = web.StreamResponse(headers={"x-kvsidecar-worker": "w1"})
            await resp.prepare(request)
            for piece in ("Hel", "lo", "!"):
                chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
            await resp.write(b": a comment line\n\ndata: " + json.dumps(usage).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        return app

    async def test_a_stream_is_timed_and_folded(self) -> None:
        """TTFT to the first data event, one gap per later event, the deltas' text joined,
        the last usage, the headers; comments and [DONE] are not events."""
        async with TestServer(self._app()) as server, aiohttp.ClientSession() as session:
            reply = await benchkit.stream_reply(
                session, str(server.make_url("/v1/chat/completions")),
                {"model": "tiny", "stream": True})
        assert reply.status == 200 and reply.headers["x-kvsidecar-worker"] == "w1"
        assert reply.ttft_s is not None and reply.ttft_s > 0
        assert len(reply.itl_s) == 3 and all(gap >= 0 for gap in reply.itl_s)
        assert reply.text == "Hello!"
        assert reply.usage == {"prompt_tokens": 5, "completion_tokens": 3}

    async def test_a_refusal_is_read_whole_and_has_its_status_alone(self) -> None:
        """A reply other than 200: its status and body, no timing, no text."""
        async with TestServer(self._app()) as server, aiohttp.ClientSession() as session:
            reply = await benchkit.stream_reply(
                session, str(server.make_url("/v1/chat/completions")), {"model": "other"})
        assert (reply.status, reply.ttft_s, reply.itl_s, reply.text, reply.usage) == (
            404, None, [], "", None)
        assert json.loads(reply.error) == {"error": {"message": "no such model"}}
