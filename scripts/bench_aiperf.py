#!/usr/bin/env python3
"""The field's harness against our stack: AIPerf replays a slice of the Mooncake conversation
trace through ``kvsidecar up``, once with kv placement and once with round-robin.

As Dynamo's published router A/B does (``aiperf profile --custom-dataset-type
mooncake_trace --fixed-schedule --streaming --goodput ...``): AIPerf builds each request's
prompt from the trace's ``hash_ids`` (one block of 512 tokens per id, the same text for the
same id, so requests that share ids share a prefix) with the tokenizer of the stack's model
directory, and sends them at the trace's timestamps. No hub access: AIPerf's worker processes
load tokenizers in offline mode from the Hugging Face cache only (a directory path is taken
for a repo id there and refused), so the model directory is laid out as a cached repo
(``models--kvsidecar--<name>/snapshots/<rev>/``, ``refs/main``) in a cache of the run's own,
and AIPerf runs with ``HF_HUB_CACHE`` on it, ``HF_HUB_OFFLINE=1`` and ``--tokenizer
kvsidecar/<name>``: its supported offline path, unpatched.

The slice: the first ``--requests`` rows whose prompt plus output fit the model's context,
output capped at ``--max-output-tokens``, timestamps rebased to 0 and multiplied by
``--time-scale``.

Each policy gets a fresh stack of the same shape (``--replicas`` simulated engines with
``--max-total-tokens`` of KV each, their sidecars, one gateway). Reported per policy: TTFT
average and p99 and goodput (requests per second within the ``--goodput`` SLOs), from AIPerf's
own export, and the cache hit rate the engines reported (the gateway's
``actual_cached_tokens`` over ``usage_prompt_tokens``). Ratios compare kv with round-robin,
>= 1 when kv is as good or better.

AIPerf has many dependencies of its own (it is not one of ours): it runs from a virtual
environment of its own, ``--aiperf PATH`` or ``.venv-aiperf/`` (created and filled with
``pip install aiperf`` on first use, with progress on stderr).

    python scripts/bench_aiperf.py [--requests 200] [--time-scale 0.25] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from benchkit import ROOT, Better, Report, add_json_flag, print_table, progress

from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec

TRACE = ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl"
MODEL = ROOT / "refengine" / "models" / "tiny"
POLICIES = ("kv", "round-robin")
_METRIC = re.compile(rb"^kvsidecar_gateway_(actual_cached_tokens|usage_prompt_tokens)_total "
                     rb"(\S+)$", re.MULTILINE)


def aiperf_binary(given: Path | None) -> Path:
    """AIPerf's command: ``given``, or ``.venv-aiperf/bin/aiperf`` (installed if missing)."""
    if given is not None:
        if not given.exists():
            raise SystemExit(f"--aiperf {given} does not exist")
        return given
    venv = ROOT / ".venv-aiperf"
    binary = venv / "bin" / "aiperf"
    if not binary.exists():
        progress(f"installing aiperf into {venv} (first use; a few minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "aiperf"], check=True)
    return binary


def hf_cache_layout(model_dir: Path, cache: Path) -> str:
    """Lay ``model_dir`` out as a cached Hugging Face repo in ``cache``; the repo id."""
    repo = f"kvsidecar/{model_dir.name}"
    revision = hashlib.sha1(b"".join(f.read_bytes() for f in sorted(model_dir.iterdir())
                                      if f.is_file())).hexdigest()
    root = cache / f"models--kvsidecar--{model_dir.name}"
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and not (snapshot / f.name).exists():
            (snapshot / f.name).symlink_to(f.resolve())
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(revision)
    return repo


def trace_slice(out: Path, requests: int, context: int, max_output: int,
                time_scale: float) -> dict[str, float]:
    """Write the slice AIPerf replays; what it holds."""
    rows = []
    with TRACE.open() as f:
        for line in f:
            row = json.loads(line)
            output = min(int(row["output_length"]), max_output)
            if row["input_length"] + output > context:
                continue
            rows.append({**row, "output_length": output})
            if len(rows) == requests:
                break
    t0 = rows[0]["timestamp"]
    for row in rows:
        row["timestamp"] = int((row["timestamp"] - t0) * time_scale)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"requests": len(rows), "duration_s": rows[-1]["timestamp"] / 1000,
            "mean_input_tokens": sum(r["input_length"] for r in rows) / len(rows)}


def gateway_hit_rate(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        found = {m.group(1).decode(): float(m.group(2)) for m in _METRIC.finditer(resp.read())}
    prompt = found.get("usage_prompt_tokens", 0.0)
    return found.get("actual_cached_tokens", 0.0) / prompt if prompt else 0.0


def metric(export: dict[str, object], tag: str, stat: str) -> float:
    """One statistic of one metric from AIPerf's JSON summary."""
    entry = export.get(tag)
    if isinstance(entry, dict) and stat in entry:
        return float(entry[stat])
    raise SystemExit(f"AIPerf's export has no {tag}.{stat}; it has {sorted(export)}")


def run_policy(args: argparse.Namespace, policy: str, aiperf: Path, dataset: Path,
               workdir: Path, tokenizer: str) -> dict[str, float]:
    spec = StackSpec(  # the stack of kvsidecar up --replicas N --router-mode POLICY
        engines=(EngineSpec(replicas=args.replicas),),
        gateways=(GatewaySpec(router_mode=policy),),
        model_path=str(MODEL), max_total_tokens=args.max_total_tokens, speedup=1.0)
    stack = LocalStack(spec, workdir / f"stack-{policy}").start()
    try:
        url = stack.url
        progress(f"{policy}: stack up at {url}; AIPerf replays {dataset.name}")
        artifacts = workdir / f"aiperf-{policy}"
        cmd = [str(aiperf), "profile", "--model", MODEL.name, "--url", url,
               "--endpoint-type", "chat", "--streaming", "--tokenizer", tokenizer,
               "--custom-dataset-type", "mooncake_trace", "--input-file", str(dataset),
               "--fixed-schedule", "--goodput", f"time_to_first_token:{args.ttft_slo_ms}",
               "--artifact-dir", str(artifacts), "--ui-type", "simple",
               "--no-server-metrics", "--no-gpu-telemetry"]
        env = {**os.environ, "HF_HUB_CACHE": str(workdir / "hf-cache"), "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s,
                             env=env)
        (workdir / f"aiperf-{policy}.log").write_text(run.stdout + run.stderr)
        if run.returncode:
            raise SystemExit(f"aiperf failed ({run.returncode}); its log: "
                             f"{workdir}/aiperf-{policy}.log\n{run.stderr[-3000:]}")
        export = json.loads(next(artifacts.rglob("profile_export_aiperf.json")).read_text())
        fig = {
            "ttft_avg_ms": metric(export, "time_to_first_token", "avg"),
            "ttft_p99_ms": metric(export, "time_to_first_token", "p99"),
            "goodput_rps": metric(export, "goodput", "avg"),
            "request_throughput_rps": metric(export, "request_throughput", "avg"),
            "requests": metric(export, "request_count", "avg"),
            "hit_rate": gateway_hit_rate(url),
        }
        progress(f"{policy}: {fig}")
        return fig
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_aiperf.py",
                                description=(__doc__ or "").split("\n\n")[0].replace("\n", " "))
    p.add_argument("--aiperf", type=Path, help="AIPerf's command (default: .venv-aiperf/)")
    p.add_argument("--requests", type=int, default=200, help="trace rows replayed (200)")
    p.add_argument("--time-scale", type=float, default=0.25,
                   help="multiply the trace's timestamps by this (0.25: four times faster)")
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--context", type=int, default=8192,
                   help="prompt + output limit of the model (the tiny model's 8,192)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=32768,
                   help="KV pool of each replica, in tokens (32768)")
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0,
                   help="the goodput SLO on time to first token (2,000 ms)")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per AIPerf run")
    add_json_flag(p)
    args = p.parse_args(argv)
    if not TRACE.is_file():
        p.error(f"the trace is not at {TRACE}")
    aiperf = aiperf_binary(args.aiperf)
    workdir = Path(tempfile.mkdtemp(prefix="bench-aiperf-"))
    dataset = workdir / "mooncake_slice.jsonl"
    shape = trace_slice(dataset, args.requests, args.context, args.max_output_tokens,
                        args.time_scale)
    progress(f"slice: {shape['requests']:.0f} requests over {shape['duration_s']:.0f} s, "
             f"{shape['mean_input_tokens']:,.0f} prompt tokens on average; work dir {workdir}")
    tokenizer = hf_cache_layout(MODEL, workdir / "hf-cache")
    results = {policy: run_policy(args, policy, aiperf, dataset, workdir, tokenizer)
               for policy in POLICIES}
    report = Report()
    for policy, fig in results.items():
        report.add_figures(fig, prefix=f"{policy}_")
    report.add_figures(shape, prefix="slice_")
    kv, rr = results["kv"], results["round-robin"]
    compared: tuple[tuple[str, str, Better], ...] = (
        ("ttft_avg", "ttft_avg_ms", "lower"), ("ttft_p99", "ttft_p99_ms", "lower"),
        ("goodput", "goodput_rps", "higher"), ("hit_rate", "hit_rate", "higher"))
    for name, key, better in compared:
        if rr[key] or better == "lower":
            report.ratio(name, "round_robin", kv[key], rr[key], better=better)
        else:
            progress(f"{name}: round-robin's is 0, so no {name}_vs_round_robin")
    print(f"\nAIPerf, Mooncake conversation trace slice: {shape['requests']:.0f} requests over "
          f"{shape['duration_s']:.0f} s, {args.replicas} simulated replicas of "
          f"{args.max_total_tokens:,} KV tokens each\n")
    print_table(["policy", "TTFT avg ms", "TTFT p99 ms", "goodput rps", "req/s", "hit rate"],
                [[policy, f"{fig['ttft_avg_ms']:.1f}", f"{fig['ttft_p99_ms']:.1f}",
                  f"{fig['goodput_rps']:.2f}", f"{fig['request_throughput_rps']:.2f}",
                  f"{fig['hit_rate']:.1%}"] for policy, fig in results.items()])
    print(f"\ngoodput: requests within TTFT {args.ttft_slo_ms:g} ms, per second")
    report.print_ratios("kv placement")
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
