#!/usr/bin/env python3
"""inference-perf's shared-prefix scenario against our stack: one load through ``kvsidecar
up``, once with kv placement and once with round-robin.

inference-perf (kubernetes-sigs' serving benchmark) generates ``--groups`` random system
prompts of ``--system-prompt-len`` tokens, each followed by ``--prompts-per-group`` different
questions of ``--question-len`` tokens, shuffles them with ``--seed`` (the same sequence for
both policies), and sends them at a constant ``--rate`` for ``--duration`` seconds,
streaming, to ``/v1/completions``. It counts tokens with our model directory's tokenizer,
which its ``tokenizer: pretrained_model_name_or_path`` loads from the path as shipped, with
``HF_HUB_OFFLINE=1``: no hub, no cache layout needed.

The capacity, where placement matters: 16 groups of 2,000 tokens are 32,000 prefix tokens;
each of the 4 replicas holds ``--max-total-tokens`` 16,384, less what requests in flight
hold, so one replica keeps about half the groups (the fleet, all of them once). Placement
that keeps each group on one replica needs 4 groups, 8,000 tokens, per replica and computes
each prefix once; round-robin sends every group to every replica, whose LRU then keeps 7 or 8
of the 16 and recomputes the others again and again. The ceiling, every prefix computed once:
``(requests - groups) x system_prompt_len / (requests x prompt length)``.

Each policy gets a fresh stack of the same shape (``--replicas`` simulated engines, their
sidecars, one gateway). Reported per policy, from inference-perf's own
``summary_lifecycle_metrics.json``: TTFT mean and p99, request throughput and output tokens
per second; and the cache hit rate the engines reported (the gateway's
``actual_cached_tokens`` over ``usage_prompt_tokens``, as ``bench_aiperf.py`` reads it).
Ratios compare kv with round-robin, >= 1 when kv is as good or better.

inference-perf needs Python >= 3.12 and has many dependencies of its own, so it runs from a
virtual environment of its own, ``.venv-inference-perf/`` (or ``--venv``), created on first
use with ``--python`` or the first Python 3.12+ found on PATH or under ``~/.pyenv/versions``.

    python scripts/bench_inference_perf.py [--rate 20] [--duration 60] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_aiperf import MODEL, POLICIES, gateway_hit_rate  # the same stack
from benchkit import ROOT, Better, Report, add_json_flag, print_table, progress

from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec

MIN_PYTHON = (3, 12)


def python_version(python: str) -> tuple[int, int] | None:
    """``python``'s (major, minor), or None if it does not run."""
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        major, minor = out.split()
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def find_python(given: str | None) -> str:
    """``given``, or the first Python >= 3.12 on PATH or under ``~/.pyenv/versions``."""
    if given is not None:
        version = python_version(given)
        if version is None or version < MIN_PYTHON:
            raise SystemExit(f"--python {given}: inference-perf needs Python >= 3.12, "
                             f"that is {version or 'not a runnable Python'}")
        return given
    candidates = [shutil.which(name) for name in ("python3.13", "python3.12", "python3")]
    pyenv = Path.home() / ".pyenv" / "versions"
    candidates += sorted((str(p) for p in pyenv.glob("3.*/bin/python")), reverse=True)
    for python in candidates:
        if python is not None and (python_version(python) or (0, 0)) >= MIN_PYTHON:
            return python
    raise SystemExit("inference-perf needs Python >= 3.12 and none was found on PATH or under "
                     f"{pyenv}; give one with --python PATH")


def inference_perf_binary(venv: Path, python: str | None) -> Path:
    """``venv``'s ``inference-perf``, the venv created and filled on first use."""
    binary = venv / "bin" / "inference-perf"
    if not binary.exists():
        interpreter = find_python(python)
        progress(f"installing inference-perf into {venv} with {interpreter} "
                 "(first use; a few minutes)")
        subprocess.run([interpreter, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "inference-perf"],
                       check=True)
    return binary


def write_config(path: Path, args: argparse.Namespace, url: str,
                 reports: Path) -> dict[str, object]:
    """Write inference-perf's config for one run, the shared-prefix load against ``url``, and
    return it.

    Written as JSON, which is YAML: inference-perf reads it with ``yaml.safe_load``."""
    config: dict[str, object] = {
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": MODEL.name, "base_url": url,
                   "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(MODEL)},
        "data": {"type": "shared_prefix", "shared_prefix": {
            "num_groups": args.groups, "num_prompts_per_group": args.prompts_per_group,
            "system_prompt_len": args.system_prompt_len, "question_len": args.question_len,
            "output_len": args.output_len, "seed": args.seed,
            "enable_multi_turn_chat": False}},
        "load": {"type": "constant", "num_workers": args.workers,
                 "stages": [{"rate": args.rate, "duration": args.duration}]},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False,
                                         "per_request": False}},
        "storage": {"local_storage": {"path": str(reports)}},
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    return config


def lifecycle_figures(summary: dict[str, object]) -> dict[str, float]:
    """The figures we report from inference-perf's ``summary_lifecycle_metrics.json``."""
    def at(*keys: str) -> float:
        node: object = summary
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                raise SystemExit(f"inference-perf's summary has no {'.'.join(keys)}; "
                                 f"it has {sorted(summary)}")
            node = node[key]
        return float(node)  # type: ignore[arg-type]

    return {
        "ttft_mean_ms": at("successes", "latency", "time_to_first_token", "mean") * 1000,
        "ttft_p99_ms": at("successes", "latency", "time_to_first_token", "p99") * 1000,
        "request_throughput_rps": at("successes", "throughput", "requests_per_sec"),
        "output_tokens_per_s": at("successes", "throughput", "output_tokens_per_sec"),
        "requests": at("successes", "count"),
        "failures": at("failures", "count"),
        # cached over prompt tokens as inference-perf counted them from each usage: a
        # cross-check of the gateway's hit rate
        "client_hit_rate": at("successes", "prompt_tokens", "cached")
        / max(at("successes", "prompt_tokens", "total"), 1.0),
    }


def run_policy(args: argparse.Namespace, policy: str, binary: Path,
               workdir: Path) -> dict[str, float]:
    spec = StackSpec(  # the stack of kvsidecar up --replicas N --router-mode POLICY
        engines=(EngineSpec(replicas=args.replicas),),
        gateways=(GatewaySpec(router_mode=policy),),
        model_path=str(MODEL), max_total_tokens=args.max_total_tokens, speedup=1.0)
    stack = LocalStack(spec, workdir / f"stack-{policy}").start()
    try:
        url = stack.url
        reports = workdir / f"reports-{policy}"
        config_file = workdir / f"config-{policy}.yaml"
        write_config(config_file, args, url, reports)
        progress(f"{policy}: stack up at {url}; inference-perf runs {config_file.name}")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        run = subprocess.run([str(binary), "--config_file", str(config_file)],
                             capture_output=True, text=True, timeout=args.timeout_s, env=env,
                             cwd=workdir)
        log = workdir / f"inference-perf-{policy}.log"
        log.write_text(run.stdout + run.stderr)
        if run.returncode:
            raise SystemExit(f"inference-perf failed ({run.returncode}); its log: {log}\n"
                             f"{run.stderr[-3000:]}")
        summary = json.loads(next(reports.rglob("summary_lifecycle_metrics.json")).read_text())
        fig = {**lifecycle_figures(summary), "hit_rate": gateway_hit_rate(url)}
        progress(f"{policy}: {fig}")
        if fig["failures"]:
            progress(f"{policy}: {fig['failures']:.0f} requests failed; see {reports}")
        return fig
    finally:
        stack.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_inference_perf.py",
                                description=(__doc__ or "").split("\n\n")[0].replace("\n", " "))
    p.add_argument("--venv", type=Path, default=ROOT / ".venv-inference-perf",
                   help="inference-perf's virtual environment (.venv-inference-perf/)")
    p.add_argument("--python", help="Python >= 3.12 to create --venv with, if it is missing")
    p.add_argument("--groups", type=int, default=16, help="shared system prompts (16)")
    p.add_argument("--prompts-per-group", type=int, default=32)
    p.add_argument("--system-prompt-len", type=int, default=2000, help="tokens (2,000)")
    p.add_argument("--question-len", type=int, default=64, help="tokens (64)")
    p.add_argument("--output-len", type=int, default=32, help="tokens (32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (20)")
    p.add_argument("--duration", type=int, default=60, help="seconds of load (60)")
    p.add_argument("--workers", type=int, default=2, help="inference-perf's worker processes")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=16384,
                   help="KV pool of each replica, in tokens (16,384: about half the groups)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per inference-perf run")
    add_json_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    binary = inference_perf_binary(args.venv, args.python)
    workdir = Path(tempfile.mkdtemp(prefix="bench-inference-perf-"))
    progress(f"{args.groups} groups x {args.prompts_per_group} prompts, system prompts of "
             f"{args.system_prompt_len} tokens, {args.rate:g} requests/s for "
             f"{args.duration} s; work dir {workdir}")
    results = {policy: run_policy(args, policy, binary, workdir) for policy in POLICIES}
    report = Report()
    for policy, fig in results.items():
        report.add_figures(fig, prefix=f"{policy}_")
    kv, rr = results["kv"], results["round-robin"]
    ceiling = report.figure(
        "hit_rate_ceiling", (kv["requests"] - args.groups) * args.system_prompt_len / (
            kv["requests"] * (args.system_prompt_len + args.question_len)))
    compared: tuple[tuple[str, str, Better], ...] = (
        ("ttft_mean", "ttft_mean_ms", "lower"), ("ttft_p99", "ttft_p99_ms", "lower"),
        ("request_throughput", "request_throughput_rps", "higher"),
        ("output_tokens_per_s", "output_tokens_per_s", "higher"),
        ("hit_rate", "hit_rate", "higher"))
    for name, key, better in compared:
        if rr[key] or better == "lower":
            report.ratio(name, "round_robin", kv[key], rr[key], better=better)
        else:
            progress(f"{name}: round-robin's is 0, so no {name}_vs_round_robin")
    print(f"\ninference-perf shared prefix: {args.groups} groups x {args.prompts_per_group} "
          f"prompts, {args.system_prompt_len:,}-token system prompts, {args.rate:g} requests/s "
          f"for {args.duration} s; {args.replicas} simulated replicas of "
          f"{args.max_total_tokens:,} KV tokens each\n")
    print_table(["policy", "TTFT mean ms", "TTFT p99 ms", "req/s", "output tok/s", "hit rate"],
                [[policy, f"{fig['ttft_mean_ms']:.1f}", f"{fig['ttft_p99_ms']:.1f}",
                  f"{fig['request_throughput_rps']:.2f}", f"{fig['output_tokens_per_s']:.1f}",
                  f"{fig['hit_rate']:.1%}"] for policy, fig in results.items()])
    print(f"\nhit rate ceiling (each prefix computed once): {ceiling:.1%}")
    report.print_ratios("kv placement")
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
