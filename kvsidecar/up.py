"""``kvsidecar up``: the whole stack on loopback, on the embedded CPU reference engine (or,
with ``--engine vllm``, on real vLLM servers: ``kvsidecar.local_vllm``).

A thin CLI over ``kvsidecar.local_stack``: its flags (``UpConfig``, declared in
``kvsidecar.up_config``, also read from ``--config FILE``) become a ``StackSpec`` of N reference
engines (simulated compute in one process, or N torch processes), a sidecar beside each,
and a gateway following the sidecars; ``LocalStack`` starts them and waits until each is
ready and every worker routable. ``up`` prints the URL and a one-screen status; with
``--demo`` runs a short chat workload through KV-aware placement and through round-robin on
the same engines and prints cache hit rate and TTFT side by side. Ctrl-C (or SIGTERM)
stops everything, gateway first.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Literal

from kvcore.stream import Role
from kvsidecar import local_stack
from kvsidecar.demo import DemoResult, run_demo
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
from kvsidecar.up_config import UpConfig, UpEngine, build_parser
from refengine.config import Compute
from routing.config import RouterMode
from routing.flags import gateway_config
from sidecar.config import SidecarConfig

__all__ = ["check_passed_args", "gateway_argv", "main", "resolve_args", "sidecar_argv",
           "stack_spec", "vllm_options"]


def stack_spec(cfg: UpConfig) -> StackSpec:
    """The stack ``up``'s flags ask for: aggregated engines, then prefill, then decode."""
    counts: tuple[tuple[Role, int], ...] = (
        ("agg", cfg.agg_replicas), ("prefill", cfg.prefill), ("decode", cfg.decode))
    if cfg.engine is UpEngine.VLLM:
        engines: tuple[EngineSpec, ...] = (EngineSpec(
            replicas=cfg.agg_replicas, kind="vllm", vllm=vllm_options(cfg)),)
    else:
        # EngineSpec spells refengine's Compute as a Literal of its values
        compute: Literal["sim", "torch"] = "torch" if cfg.compute is Compute.TORCH else "sim"
        engines = tuple(EngineSpec(replicas=count, role=role, compute=compute)
                        for role, count in counts if count)
    return StackSpec(
        engines=engines,
        gateways=(gateway_spec("gateway", cfg.port, cfg.router_mode, cfg),),
        model_path=str(cfg.model_path),
        max_total_tokens=cfg.kv_tokens,
        speedup=cfg.speedup,
        handoff_ms_per_1k_tokens=cfg.sim_handoff_ms_per_1k_tokens,
        sidecar_args=cfg.sidecar_args,
    )


def vllm_options(cfg: UpConfig) -> VllmOptions:
    """``--engine vllm``: every vLLM server's options."""
    blocks = cfg.kv_tokens // VLLM_BLOCK_SIZE
    return VllmOptions(
        model=cfg.model_path, kv_blocks=blocks,
        max_model_len=min(4096, (blocks - 1) * VLLM_BLOCK_SIZE),
        extra_args=cfg.engine_args,
        kv_connector_store_bytes=cfg.kv_connector_store_bytes)


def gateway_spec(name: str, port: int, mode: RouterMode, cfg: UpConfig) -> GatewaySpec:
    """A gateway of ``up``: its flags, then ``--gateway-arg``'s."""
    # vLLM's CPU engine pages in 32 tokens: the gateway hashes prompts alike
    block_size = ["--block-size", str(VLLM_BLOCK_SIZE)] if cfg.engine is UpEngine.VLLM else []
    return GatewaySpec(
        name=name, host=cfg.host, port=port, router_mode=mode.value, pd_mode=cfg.pd_mode.value,
        kv_load_failure_policy=cfg.kv_load_failure_policy.value,
        args=(*block_size, *cfg.gateway_args))


def gateway_argv(port: int, mode: RouterMode, cfg: UpConfig, sidecars: list[str]) -> list[str]:
    """The gateway's arguments: up's own, then ``--gateway-arg``'s (a later flag wins)."""
    return local_stack.gateway_argv(gateway_spec("gateway", port, mode, cfg),
                                    str(cfg.model_path), sidecars)


def check_passed_args(cfg: UpConfig) -> str | None:
    """Why ``--gateway-arg`` / ``--sidecar-arg`` would stop a gateway or sidecar (their own
    parsers' words, already printed), before any process starts; None: they parse."""
    placeholder = "http://127.0.0.1:9"
    # the flags a vLLM's KV connector gives its sidecar come first, as in the stack
    store = (store_args(vllm_options(cfg), Path("/tmp/placeholder.sock"))
             if cfg.engine is UpEngine.VLLM and cfg.kv_connector_store_bytes else [])
    checks = (
        ("--gateway-arg", lambda: gateway_config(
            gateway_argv(cfg.port, cfg.router_mode, cfg, [placeholder]))),
        ("--sidecar-arg", lambda: SidecarConfig.from_args(
            sidecar_argv(placeholder, "replica-0", "agg", 0.0, [*store, *cfg.sidecar_args]))),
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


async def _serve(cfg: UpConfig, workdir: Path) -> int:
    pd = f" ({cfg.prefill} prefill, {cfg.decode} decode)" if cfg.prefill else ""
    kind = "vLLM" if cfg.engine is UpEngine.VLLM else cfg.compute.value
    print(
        f"starting {cfg.agg_replicas + cfg.prefill + cfg.decode} {kind} engine replica(s){pd}, "
        f"their sidecars and the gateway (logs in {workdir})...",
        file=sys.stderr,
        flush=True,
    )
    async with LocalStack(stack_spec(cfg), workdir) as stack:
        url = stack.url
        _print_status(url, stack.workers, workdir)
        if cfg.ready_file is not None:
            cfg.ready_file.write_text(json.dumps({"url": url}) + "\n")
        if cfg.demo and cfg.prefill:
            print("--demo compares aggregated placement policies; it is skipped with "
                  "--prefill/--decode (scripts/bench_disagg.py measures those)", file=sys.stderr)
        elif cfg.demo:
            gateways = {cfg.router_mode.value: url}
            for mode in (RouterMode.ROUND_ROBIN, RouterMode.LEAST_LOADED):
                if mode.value not in gateways:
                    started = await asyncio.to_thread(
                        stack.add_gateway, gateway_spec(f"gateway-{mode.value}", 0, mode, cfg))
                    gateways[mode.value] = started[0].url
            results = await run_demo(
                gateways,
                [engine.url for engine in stack.engines],
                model=cfg.model_path.resolve().name,
            )
            _print_demo(results, cfg.kv_tokens)
            if cfg.exit_after_demo:
                return 0
        print("\nCtrl-C stops the stack.", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("stopping...", file=sys.stderr)
    return 0


def resolve_args(argv: list[str] | None = None) -> UpConfig:
    """up's flags (and ``--config FILE``), checked and completed as ``up`` runs them: the
    passed-through gateway and sidecar flags parsed by their own parsers, the vLLM model with
    weights; a bad one exits with the parser's message."""
    parser = build_parser()
    cfg = parser.build(UpConfig, parser.parse_args(argv))
    if cfg.engine is UpEngine.VLLM and cfg.model_path == DEFAULT_MODEL:
        try:
            cfg = replace(cfg, model_path=tiny_model_with_weights())
        except RuntimeError as exc:
            parser.error(str(exc))
    refused = check_passed_args(cfg)
    if refused is not None:
        parser.error(refused)
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = resolve_args(argv)
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="kvsidecar-up-"))
    try:
        return asyncio.run(_serve(cfg, workdir))
    except LaunchError as exc:
        print(f"kvsidecar up: {exc}", file=sys.stderr)
        return 1
