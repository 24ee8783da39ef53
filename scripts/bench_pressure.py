#!/usr/bin/env python3
"""Placement under memory pressure, live: our stack against Dynamo's own (frontend + mocker)
on the shared-prefix multi-turn chat workload, at two KV capacities, in one run.

The workload and both stacks are those of the Dynamo comparison kit in the shared bench folder
(``bench/dynamo/``: ``dynamo_stack.sh``, ``load.py``; read-only, so they are driven through
their environment knobs; our stack is the one of its ``kvsidecar_stack.sh``, started by
``LocalStack``): 20 system prompts × 2,000 tokens, 3 turns of
64 user tokens and 64 output tokens, 256 sessions, 64 in flight, 4 workers, block 16,
mocker-like timing. At 4,096 blocks per worker every worker can hold every system prompt; at
1,024 a worker holds fewer than half of them, and the fleet only so many copies.

Per stack × capacity, each on a fresh stack (cold caches):
  * hit rate: the cached tokens the engines report (``usage.prompt_tokens_details``) over the
    prompt tokens;
  * predicted: what the router expected cached, token-weighted: ours
    ``kvsidecar_gateway_predicted_cached_tokens_total`` over the engines' prompt tokens,
    Dynamo's ``dynamo_component_router_kv_selected_cached_prefix_tokens_total`` over its
    frontend's input tokens (the per-request mean ``dynamo_component_router_kv_hit_rate`` is
    kept too);
  * gap: |predicted − hit rate|, in points; TTFT p50/p99 (ms) from the load driver.

Ours runs with its defaults, with ``least-loaded`` (the p99 TTFT reference), and, unless
``--quick``, over a sweep of ``--overlap-weight`` × ``--prefill-load-scale``. Each run also
gets its *ceiling*, a bound no router can pass on that load: every system prompt in use must
be computed once, and every turn's user message (fresh random words) every time, so at most
``1 − (system prompts used × their tokens + requests × user tokens) / prompt tokens`` of the
prompt tokens can hit. Ratios (≥ 1 is as good or better): ``hit_rate_vs_dynamo_<cap>``,
``prediction_gap_vs_dynamo_<cap>`` (Dynamo's gap over ours; a gap under half a point counts
as half a point, the run-to-run resolution),
``defaults_vs_best_sweep_<cap>`` (our default hit rate over the sweep's best),
``hit_rate_vs_ceiling_<cap>`` and ``ttft_p99_vs_least_loaded_<cap>``; the figure
``reachable_hit_rate_vs_dynamo_<cap>`` is the ceiling over Dynamo's hit rate, the most any
router could score against Dynamo in that run.

    python scripts/bench_pressure.py [--quick] [--capacities 4096,1024] [--json FILE]

Needs the Dynamo venv of ``bench/dynamo/setup_dynamo.sh`` under ``$BENCH_HOME`` (default
``~/.cache/kvsidecar-bench``); without it the Dynamo rows are skipped and say why. Each stack
run takes about a minute here; the default sweep (3 × 3) makes the whole bench ~25 minutes,
``--quick`` ~6.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchkit import ROOT, Report, add_json_flag, progress

from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec

KIT = ROOT.parent / "shared" / "bench" / "dynamo"
GAP_FLOOR = 0.005  # half a point: below it a gap is run-to-run noise
_OURS = re.compile(rb"^kvsidecar_gateway_(predicted_cached_tokens|actual_cached_tokens|"
                   rb"usage_prompt_tokens)_total (\S+)$", re.MULTILINE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Run:
    """One stack brought up by the kit's script, loaded by ``load.py``, and stopped."""

    def __init__(self, args: argparse.Namespace, workdir: Path, label: str) -> None:
        self.args, self.label = args, label
        self.state = workdir / label
        self.port = free_port()

    def env(self, capacity: int, extra: dict[str, str]) -> dict[str, str]:
        return {**os.environ, "BENCH_HOME": str(self.args.bench_home),
                "STATE_DIR": str(self.state), "PORT": str(self.port),
                "NUM_GPU_BLOCKS": str(capacity), "NUM_WORKERS": str(self.args.workers),
                "MAIN": str(self.args.main), "PYTHONPATH": str(self.args.main), **extra}

    def ours(self, capacity: int, extra: dict[str, str]) -> LocalStack:
        """Our stack as the kit's ``kvsidecar_stack.sh`` starts it (its model dir, block
        size, per-worker capacity and mocker-like timing), from ``--main``'s tree."""
        model = str(self.args.bench_home / "tinymodel")
        timing = ("--sim-prefill-base-ms", "20", "--sim-prefill-us-per-token", "20",
                  "--sim-decode-base-ms", "4", "--sim-decode-us-per-seq", "1900",
                  "--chunked-prefill-size", "8192")
        workers = self.args.workers
        spec = StackSpec(
            engines=(EngineSpec(
                replicas=workers, worker_ids=tuple(f"w{i}" for i in range(workers)),
                args=("--served-model-name", "tiny", "--page-size", "16",
                      "--max-running-requests", "256", *timing),
                sidecar_args=("--model-path", model)),),
            gateways=(GatewaySpec(
                port=self.port, router_mode=extra["ROUTER_MODE"], health_check_interval_s=10.0,
                args=("--served-model-name", "tiny",
                      *extra.get("EXTRA_GATEWAY_ARGS", "").split())),),
            model_path=model, max_total_tokens=capacity * 16, log_level="warning",
            env={"PYTHONPATH": str(self.args.main)})
        return LocalStack(spec, self.state).start()

    def go(self, stack: str, capacity: int, extra: dict[str, str]) -> dict[str, float]:
        env = self.env(capacity, extra)
        ours = None
        if stack == "kvsidecar":
            ours = self.ours(capacity, extra)
        else:
            start = subprocess.run([str(KIT / f"{stack}_stack.sh")], env=env,
                                   capture_output=True, text=True, timeout=300)
            if start.returncode:
                self.stop(stack, env)
                raise RuntimeError(f"{stack} stack did not start: {start.stderr[-800:]}")
        try:
            url = f"http://127.0.0.1:{self.port}"
            out = self.state / "load.json"
            cmd = [sys.executable, str(KIT / "load.py"), "--url", url, "--model", "tiny",
                   "--concurrency", str(self.args.concurrency), "--users", str(self.args.users),
                   "--json", str(out), "--label", self.label, "--request-timeout", "120"]
            if stack == "dynamo":
                cmd += ["--metrics-url", url + "/metrics"]
            load = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            if load.returncode:
                raise RuntimeError(f"load.py failed: {load.stderr[-800:]}")
            res = json.loads(out.read_text())
            if res["requests_failed"]:
                raise RuntimeError(f"{res['requests_failed']} requests failed: "
                                   f"{res['errors_sample']}")
            fig = {"hit_rate": float(res["client_cache_hit_rate"] or 0.0),
                   "ttft_p50_ms": float(res["ttft_p50_ms"]),
                   "ttft_p99_ms": float(res["ttft_p99_ms"]), "wall_s": float(res["wall_s"]),
                   "ceiling": ceiling_of(res)}
            if extra.get("ROUTER_MODE") == "kv":  # the other modes predict nothing
                predicted = (ours_predicted(url) if stack == "kvsidecar"
                             else dynamo_predicted(res, fig))
                if stack == "kvsidecar":
                    fig.update(ours_weights(url))
                if math.isnan(predicted):
                    progress(f"{self.label}: the router's metrics hold no prediction")
                else:
                    fig["predicted"] = predicted
                    fig["gap"] = abs(predicted - fig["hit_rate"])
            return fig
        finally:
            if ours is not None:
                ours.stop()
            else:
                self.stop(stack, env)

    @staticmethod
    def stop(stack: str, env: dict[str, str]) -> None:
        subprocess.run([str(KIT / f"stop_{stack}_stack.sh")], env=env, capture_output=True,
                       timeout=120)


def ours_predicted(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        found = {m.group(1).decode(): float(m.group(2)) for m in _OURS.finditer(resp.read())}
    prompt = found.get("usage_prompt_tokens", 0.0)
    return found.get("predicted_cached_tokens", 0.0) / prompt if prompt else 0.0


_REASON = re.compile(rb'^kvsidecar_gateway_placement_reason_total\{reason="(\w+)"\} (\S+)$',
                     re.MULTILINE)
_DECODE_FIT = ("output_tokens", "prefill_s_per_token", "fleet_itl_base_s",
               "fleet_itl_per_stream_s")


def ours_weights(url: str) -> dict[str, float]:
    """The scorer's weights at the end of the run (learned ones included), the learned
    decode-interference fit (``final_decode_*``) and the share of placements per reason
    (``reason_*``), if reported."""
    with urllib.request.urlopen(url + "/v1/workers", timeout=10) as resp:
        scorer = json.loads(resp.read()).get("scorer") or {}
    out = {f"final_{k}": float(scorer[k]) for k in ("overlap_weight", "prefill_load_scale")
           if isinstance(scorer.get(k), (int, float))}
    decode = scorer.get("decode_interference") or {}
    out.update({f"final_decode_{k}": float(decode[k]) for k in _DECODE_FIT
                if isinstance(decode.get(k), (int, float))})
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        reasons = {m.group(1).decode(): float(m.group(2)) for m in _REASON.finditer(resp.read())}
    total = sum(reasons.values())
    out.update({f"reason_{k}": v / total for k, v in reasons.items() if total})
    return out


def dynamo_predicted(res: dict[str, object], fig: dict[str, float]) -> float:
    delta = res.get("metrics_delta") or {}
    assert isinstance(delta, dict)
    mean = res.get("router_predicted_hit_rate_mean")
    if isinstance(mean, float):
        fig["predicted_request_mean"] = mean
    tokens = delta.get("dynamo_frontend_input_sequence_tokens_sum") or 0.0
    selected = delta.get("dynamo_component_router_kv_selected_cached_prefix_tokens_total")
    if tokens and selected is not None:
        return float(selected) / float(tokens)
    return float(mean) if isinstance(mean, float) else float("nan")


def ceiling_of(res: dict[str, Any]) -> float:
    """The most any placement can hit on the load ``load.py`` ran (its JSON ``res``): the
    system prompts its sessions drew (as ``load.py`` draws them: one per session, from a
    generator seeded by the session) are computed at least once, every user message always."""
    drawn = {random.Random(int(res["seed"]) * 1_000_003 + sid).randrange(int(res["system_prompts"]))
             for sid in range(int(res["users"]))}
    uncached = len(drawn) * int(res["system_tokens"]) + int(res["requests_ok"]) * int(
        res["user_tokens"])
    return 1.0 - uncached / float(res["prompt_tokens"])


def configs(args: argparse.Namespace) -> list[tuple[str, str, dict[str, str]]]:
    """(label, stack, extra env) for each run at one capacity."""
    out: list[tuple[str, str, dict[str, str]]] = []
    if args.dynamo:
        out.append(("dynamo", "dynamo", {"ROUTER_MODE": "kv"}))
    mine = " ".join(args.gateway_arg)
    out.append(("ours", "kvsidecar", {"ROUTER_MODE": "kv", "EXTRA_GATEWAY_ARGS": mine}))
    out.append(("ours_least_loaded", "kvsidecar", {"ROUTER_MODE": "least-loaded"}))
    if not args.quick:
        out.extend((f"sweep_ow{ow:g}_ps{ps:g}", "kvsidecar",
                    {"ROUTER_MODE": "kv", "EXTRA_GATEWAY_ARGS":
                     f"{mine} --overlap-weight {ow:g} --prefill-load-scale {ps:g}"})
                   for ow in args.sweep_overlap for ps in args.sweep_scale)
    return out


def table(results: dict[int, dict[str, dict[str, float]]]) -> None:
    print(f"\n{'capacity':>8}  {'run':<22}{'hit rate':>9}{'predicted':>10}{'gap pt':>8}"
          f"{'TTFT p50':>10}{'TTFT p99':>10}{'wall s':>8}  final weights (ow / ps)")
    for cap, runs in results.items():
        for label, f in runs.items():
            pred = f"{f['predicted']:>10.1%}{f['gap'] * 100:>8.1f}" if "gap" in f else " " * 18
            weights = (f"  {f['final_overlap_weight']:.3g} / {f['final_prefill_load_scale']:.3g}"
                       if "final_overlap_weight" in f else "")
            print(f"{cap:>8}  {label:<22}{f['hit_rate']:>9.1%}{pred}"
                  f"{f['ttft_p50_ms']:>8.0f}ms{f['ttft_p99_ms']:>8.0f}ms{f['wall_s']:>8.1f}"
                  f"{weights}")
            if "final_decode_fleet_itl_per_stream_s" in f:
                print(f"{'':>10}  decode fit: ITL {f['final_decode_fleet_itl_base_s'] * 1e3:.1f}"
                      f" ms + {f['final_decode_fleet_itl_per_stream_s'] * 1e3:.2f} ms/stream, "
                      f"prefill {f['final_decode_prefill_s_per_token'] * 1e6:.0f} µs/token; "
                      f"placements for interference {f.get('reason_interference', 0.0):.1%}")


def add_ratios(report: Report, cap: int, runs: dict[str, dict[str, float]]) -> None:
    """One capacity's ratios: our default run against the ceiling, Dynamo, the sweep and
    least-loaded."""
    ours = runs["ours"]
    report.ratio("hit_rate", f"ceiling_{cap}", ours["hit_rate"], ours["ceiling"],
                 better="higher")
    if "dynamo" in runs:
        dyn = runs["dynamo"]
        report.ratio("hit_rate", f"dynamo_{cap}", ours["hit_rate"], dyn["hit_rate"],
                     better="higher")
        if "gap" in ours and "gap" in dyn:
            report.ratio("prediction_gap", f"dynamo_{cap}", max(ours["gap"], GAP_FLOOR),
                         max(dyn["gap"], GAP_FLOOR), better="lower")
    sweep = [f["hit_rate"] for label, f in runs.items() if label.startswith("sweep_")]
    if sweep:
        report.ratio("defaults", f"best_sweep_{cap}", ours["hit_rate"], max(sweep),
                     better="higher")
    report.ratio("ttft_p99", f"least_loaded_{cap}", ours["ttft_p99_ms"],
                 runs["ours_least_loaded"]["ttft_p99_ms"], better="lower")


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_pressure.py",
                                description=(__doc__ or "").split("\n\n")[0].replace("\n", " "))
    p.add_argument("--capacities", default="4096,1024", help="KV blocks per worker, each run")
    p.add_argument("--quick", action="store_true", help="skip the weight sweep")
    p.add_argument("--sweep-overlap", type=floats, default=[1.0, 4.0, 20.0],
                   help="--overlap-weight values swept (1,4,20)")
    p.add_argument("--sweep-scale", type=floats, default=[1.0, 10.0, 100.0],
                   help="--prefill-load-scale values swept (1,10,100)")
    p.add_argument("--users", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--bench-home", type=Path, default=Path(os.environ.get(
        "BENCH_HOME", Path.home() / ".cache" / "kvsidecar-bench")))
    p.add_argument("--main", type=Path, default=ROOT,
                   help="the checkout our stack runs from (default: this one); a copy of the "
                   "tree keeps a run apart from edits made meanwhile (it needs .venv/)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="a flag for our kv-routed gateways (repeat; e.g. "
                   "--gateway-arg=--decode-interference-weight=0)")
    p.add_argument("--no-dynamo", action="store_true",
                   help="leave Dynamo's run out even if its venv is set up")
    add_json_flag(p)
    args = p.parse_args(argv)
    args.main = args.main.resolve()
    if not KIT.is_dir():
        p.error(f"the Dynamo kit is not at {KIT}")
    args.dynamo = (args.bench_home / "dynamo-venv" / ".ready").exists() and not args.no_dynamo
    if not args.dynamo and not args.no_dynamo:
        progress(f"no Dynamo venv at {args.bench_home}/dynamo-venv (run the kit's "
                 "setup_dynamo.sh): Dynamo's rows and ratios are left out")
    elif not (args.bench_home / "tinymodel" / "tokenizer.json").exists():
        p.error(f"no model dir at {args.bench_home}/tinymodel: run setup_dynamo.sh")
    workdir = Path(tempfile.mkdtemp(prefix="bench-pressure-"))
    capacities = [int(c) for c in args.capacities.split(",")]
    plan = configs(args)
    total, done, t0 = len(plan) * len(capacities), 0, time.monotonic()
    results: dict[int, dict[str, dict[str, float]]] = {}
    for cap in capacities:
        results[cap] = {}
        for label, stack, extra in plan:
            done += 1
            progress(f"[{done}/{total}] {label} at {cap} blocks/worker "
                     f"({time.monotonic() - t0:.0f} s so far)")
            fig = Run(args, workdir, f"{label}_{cap}").go(stack, cap, extra)
            progress(f"  hit {fig['hit_rate']:.1%} predicted {fig.get('predicted', 0.0):.1%} "
                     f"TTFT p50 {fig['ttft_p50_ms']:.0f} ms p99 {fig['ttft_p99_ms']:.0f} ms")
            results[cap][label] = fig
    print(f"\nChat workload under memory pressure: {args.users} sessions × 3 turns, "
          f"{args.concurrency} in flight, {args.workers} workers; gap = |predicted − hit rate|")
    table(results)
    report = Report()
    for cap, runs in results.items():
        for label, f in runs.items():
            report.add_figures(f, prefix=f"{label}_{cap}_")
    print()
    for cap, runs in results.items():
        ceiling = runs["ours"]["ceiling"]
        line = f"ceiling at {cap} blocks: {ceiling:.1%} (no router can hit more on this load)"
        if "dynamo" in runs:
            reachable = report.figure(f"reachable_hit_rate_vs_dynamo_{cap}",
                                      runs["dynamo"]["ceiling"] / runs["dynamo"]["hit_rate"])
            line += f"; the most any router can score against Dynamo's run: {reachable:.3f}×"
        print(line)
    for cap, runs in results.items():
        add_ratios(report, cap, runs)
    report.print_ratios("our default placement")
    progress(f"stack logs under {workdir}")
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
