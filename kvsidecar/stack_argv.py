"""The command lines ``LocalStack`` gives its children: a sidecar's, a gateway's, a reference
engine's, and the flags that wire a P/D role's KV handoff (the engine's HiCache hook, its
sidecar's block store), a sidecar to publishers outside the stack, a gateway to Kubernetes.
A lone process of ours (a sidecar against a test's publisher, a reference engine alone, the
endpoint picker, a block store owner, ``kvsidecar indexer``) takes its command line from here
too, run by ``ManagedProcess``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsidecar.stack_spec import EngineSpec, ExternalPublisher, GatewaySpec, K8sDiscovery, StackSpec

__all__ = ["STORE_FLAGS", "epp_argv", "gateway_argv", "indexer_argv", "k8s_flags",
           "lone_refengine_argv", "part_name", "publisher_flags", "refengine_argv", "role_flags",
           "sidecar_argv", "store_flags", "store_owner_argv"]


def sidecar_argv(url: str, worker_id: str, role: str, handoff_ms: float,
                 extra: list[str] | None = None) -> list[str]:
    """A sidecar's arguments: the stack's own, then ``extra`` (a later flag wins)."""
    return ["--engine-url", url, "--worker-id", worker_id, "--role", role, "--port", "0",
            "--sim-handoff-ms-per-1k-tokens", str(handoff_ms), *(extra or [])]


def publisher_flags(publisher: ExternalPublisher) -> list[str]:
    """A sidecar's flags subscribing it to ``publisher``'s endpoints, those it names."""
    return _given(("--kv-events-endpoint", publisher.events),
                  ("--kv-events-replay-endpoint", publisher.replay),
                  ("--load-endpoint", publisher.load))


def k8s_flags(k8s: K8sDiscovery) -> list[str]:
    """A gateway's flags finding its sidecars as the pods ``k8s`` names."""
    return _given(("--discover-k8s-selector", k8s.selector),
                  ("--discover-k8s-namespace", k8s.namespace), ("--k8s-api-url", k8s.api_url),
                  ("--k8s-ca-file", k8s.ca_file), ("--k8s-token-file", k8s.token_file))


def _given(*pairs: tuple[str, str | None]) -> list[str]:
    """``flag value`` for each pair whose value is given."""
    return [f for flag, value in pairs if value is not None for f in (flag, value)]


def lone_refengine_argv(*extra: str) -> list[str]:
    """The reference engine alone (its defaults: loopback, the tiny model, no KV events), on
    any port, then ``extra`` (a later flag wins); a stack's engines start from it."""
    return ["refengine", "--port", "0", *extra]


def epp_argv(*extra: str) -> list[str]:
    """``python -m routing.epp`` on loopback, any HTTP and gRPC ports, then ``extra``."""
    return ["routing.epp", "--host", "127.0.0.1", "--port", "0", "--grpc-host", "127.0.0.1",
            "--grpc-port", "0", *extra]


def store_owner_argv(owner_id: str, socket: Path, *, capacity_bytes: int, block_bytes: int,
                     peer: bool = False, log_level: str = "warning",
                     extra: Sequence[str] = ()) -> list[str]:
    """A block store owner alone (``kvsidecar.local_store``): ``python -m shm``, or with
    ``peer`` ``python -m sidecar.transfer`` (its transfer service on any port), then
    ``extra`` (a later flag wins)."""
    return ["sidecar.transfer" if peer else "shm", "--owner-id", owner_id, "--socket",
            str(socket), "--capacity-bytes", str(capacity_bytes), "--block-bytes",
            str(block_bytes), "--log-level", log_level, *(["--port", "0"] if peer else []),
            *extra]


def indexer_argv(*extra: str) -> list[str]:
    """``kvsidecar indexer`` on loopback, any port, then ``extra`` (a later flag wins)."""
    return ["kvsidecar", "indexer", "--host", "127.0.0.1", "--port", "0", *extra]


def gateway_argv(spec: GatewaySpec, model_path: str | None, sidecars: list[str], *,
                 port: int | None = None, more: list[str] | None = None) -> list[str]:
    """A gateway's arguments: the stack's own, ``--sidecar`` per sidecar URL, ``more`` (the
    stack's wiring: workers, seed, NATS), then the spec's ``args`` (a later flag wins).
    Without ``model_path`` (a lone gateway of plain workers) it forwards bodies unchanged."""
    interval = spec.health_check_interval_s
    return [
        "--host", spec.host, "--port", str(spec.port if port is None else port),
        "--router-mode", spec.router_mode,
        *_given(("--model-path", model_path),
                ("--health-check-interval-s", None if interval is None else f"{interval:g}")),
        "--pd-mode", spec.pd_mode, "--kv-load-failure-policy", spec.kv_load_failure_policy,
        *[flag for url in sidecars for flag in ("--sidecar", url)],
        *(more or []),
        *spec.args,
    ]


def refengine_argv(spec: StackSpec, engine: EngineSpec, workdir: Path, socket: Path | None,
                   ours: list[str]) -> list[str]:
    """A reference engine's arguments: the stack's model, pool and KV events, the flags of
    its P/D role, ``ours`` (every child's), then the spec's ``args`` (a later flag wins)."""
    argv = lone_refengine_argv("--compute", engine.compute)
    if engine.compute == "sim":
        argv += ["--replicas", str(engine.replicas)]
        if spec.speedup is not None:
            argv += ["--speedup", str(spec.speedup)]
    argv += ["--model-path", spec.model_path]
    if spec.max_total_tokens is not None:
        argv += ["--max-total-tokens", str(spec.max_total_tokens)]
    return [*argv, "--kv-events-config", spec.events_config,
            *role_flags(engine, workdir, socket), *ours, *engine.args]


# handoff="sidecar": a sidecar's block store of raw one-page blocks (the tiny model's KV is
# 2 KiB per token in fp32, 16 tokens a page), and the pull of a decode sidecar.
STORE_FLAGS = ("--store-block-bytes", str(16 * 2048), "--store-capacity-bytes", "32MiB",
               "--kv-handoff", "transfer")
# store="sidecar"/"hook": a block store the sidecar sizes from the engine's KV layout.
_AGG_STORE_FLAGS = ("--store-capacity-bytes", "32MiB")


def role_flags(engine: EngineSpec, workdir: Path, socket: Path | None) -> list[str]:
    """Engine flags of a P/D role (its mode) and of the HiCache hook its KV goes through: the
    page store directory of ``handoff="file"``, or its sidecar's block store at ``socket``."""
    pd = engine.role != "agg" and engine.handoff != "none"
    mode = ["--disaggregation-mode", engine.role] if pd else []
    if socket is not None:
        backend = "dynamic"
        config: dict[str, Any] = {
            "backend_name": "kvsidecar", "module_path": "adapters.sglang.hicache",
            "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1,
            "socket": str(socket), "model_id": "tiny"}
    elif pd:
        backend = "file"
        config = {"file_path": str(workdir / engine.page_store)}
    else:
        return []
    return [*mode, "--hicache-storage-backend", backend,
            "--hicache-storage-backend-extra-config", json.dumps(config)]


def store_flags(engine: EngineSpec, socket: Path) -> list[str]:
    """A sidecar's flags for the block store at ``socket``: a P/D role's handoff store, or
    the store of ``EngineSpec.store``."""
    pd = engine.role != "agg" and engine.handoff == "sidecar"
    return [*(STORE_FLAGS if pd else _AGG_STORE_FLAGS), "--store-socket", str(socket)]


def part_name(kind: str, role: str, i: int | None = None) -> str:
    """``engines``, ``engine-0``, ``sidecar-prefill-1``: the role named unless aggregated."""
    base = kind if role == "agg" else f"{kind}-{role}"
    return base if i is None else f"{base}-{i}"

