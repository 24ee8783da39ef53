"""The gateway's typed configuration: ``RouterConfig.from_args(argv)`` is the only builder."""

from __future__ import annotations

import argparse
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["LogLevel", "RouterConfig", "RouterMode", "WorkerAddress"]


class RouterMode(enum.Enum):
    """How the gateway picks a worker for a request."""

    KV = "kv"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"
    APPROX = "approx"


class LogLevel(enum.Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """A plain OpenAI-compatible engine, ``http://host:port[/prefix]``."""

    url: str
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> WorkerAddress:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(
                f"worker URL must start with http:// (https is not supported): {url!r}"
            )
        if not parts.hostname:
            raise ValueError(f"worker URL has no host: {url!r}")
        try:
            port = parts.port or 80
        except ValueError as exc:
            raise ValueError(f"worker URL has a bad port: {url!r}") from exc
        if parts.query or parts.fragment:
            raise ValueError(f"worker URL must not carry a query or fragment: {url!r}")
        base = parts.path.rstrip("/")
        canonical = f"http://{parts.hostname}:{port}{base}"
        return cls(canonical, parts.hostname, port, base)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything ``kvsidecar gateway`` needs; validated on construction."""

    workers: tuple[WorkerAddress, ...]
    sidecars: tuple[WorkerAddress, ...] = ()
    sidecar_file: Path | None = None
    dead_after_s: float = 5.0
    ready_file: Path | None = None
    router_mode: RouterMode = RouterMode.KV
    model_path: Path | None = None
    served_model_names: tuple[str, ...] = ()
    overlap_weight: float = 1.0
    prefill_load_scale: float = 1.0
    router_temperature: float = 0.0
    host_weight: float = 0.75
    disk_weight: float = 0.25
    block_size: int = 16
    approx_ttl_s: float = 120.0
    max_model_len: int | None = None
    max_in_flight_per_worker: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: LogLevel = LogLevel.INFO
    health_check_interval_s: float = 10.0
    parity_interval_s: float = 300.0  # hash parity check of each sidecar worker
    connect_timeout_s: float = 5.0
    upstream_timeout_s: float = 600.0
    max_body_bytes: int = 32 << 20
    forward_authorization: bool = False  # the client's Authorization header to the workers
    max_idle_connections_per_worker: int = 256
    seed: int | None = None
    # Prefill/decode disaggregation (routing/pd/coordinator.py); values are PdMode / FailurePolicy.
    pd_mode: str = "auto"
    kv_load_failure_policy: str = "fallback"
    kv_transfer_timeout_s: float = 10.0
    pd_queue_timeout_s: float = 30.0
    kv_transport: str = "auto"  # auto: shm on one host, else nixl (tcp when nixl is absent)

    def __post_init__(self) -> None:
        if not (self.workers or self.sidecars or self.sidecar_file):
            raise ValueError("give at least one --sidecar URL, --sidecar-file or --worker URL")
        urls = [w.url for w in (*self.workers, *self.sidecars)]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a worker or sidecar is listed twice: {urls}")
        if (self.sidecars or self.sidecar_file) and self.model_path is None:
            raise ValueError(
                "sidecar workers take token ids: give --model-path (the model's tokenizer and "
                "chat template) so the gateway tokenizes exactly what the engine caches"
            )
        if not math.isfinite(self.dead_after_s) or self.dead_after_s <= 0:
            raise ValueError(f"dead_after_s must be > 0, got {self.dead_after_s!r}")
        for name in (
            "overlap_weight",
            "prefill_load_scale",
            "router_temperature",
            "host_weight",
            "disk_weight",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 1 <= self.block_size <= 4096:
            raise ValueError(f"block_size must be in [1, 4096], got {self.block_size}")
        for name in (
            "approx_ttl_s",
            "health_check_interval_s",
            "parity_interval_s",
            "connect_timeout_s",
            "upstream_timeout_s",
        ):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_in_flight_per_worker is not None and self.max_in_flight_per_worker < 1:
            raise ValueError(
                f"max_in_flight_per_worker must be >= 1, got {self.max_in_flight_per_worker}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.pd_mode not in ("auto", "sglang", "off"):
            raise ValueError(f"pd_mode must be auto, sglang or off, got {self.pd_mode!r}")
        if self.kv_transport not in ("auto", "shm", "nixl", "tcp"):
            raise ValueError(f"kv_transport must be auto, shm, nixl or tcp, got "
                             f"{self.kv_transport!r}")
        if self.kv_load_failure_policy not in ("fail", "fallback"):
            raise ValueError("kv_load_failure_policy must be fail or fallback, got "
                             f"{self.kv_load_failure_policy!r}")
        for name in ("kv_transfer_timeout_s", "pd_queue_timeout_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.model_path is not None and not (self.model_path / "tokenizer.json").is_file():
            raise ValueError(f"--model-path {self.model_path} has no tokenizer.json")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names clients may ask for (empty: learned from the workers' /v1/models)."""
        if self.served_model_names:
            return self.served_model_names
        if self.model_path is not None:
            return (self.model_path.resolve().name,)
        return ()

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> RouterConfig:
        args = _parser().parse_args(argv)
        try:
            return cls(
                workers=tuple(WorkerAddress.parse(u) for u in args.worker or ()),
                sidecars=tuple(WorkerAddress.parse(u) for u in args.sidecar or ()),
                sidecar_file=Path(args.sidecar_file) if args.sidecar_file else None,
                dead_after_s=args.dead_after_s,
                ready_file=Path(args.ready_file) if args.ready_file else None,
                router_mode=RouterMode(args.router_mode),
                model_path=Path(args.model_path) if args.model_path else None,
                served_model_names=tuple(args.served_model_name or ()),
                overlap_weight=args.overlap_weight,
                prefill_load_scale=args.prefill_load_scale,
                router_temperature=args.router_temperature,
                host_weight=args.host_weight,
                disk_weight=args.disk_weight,
                block_size=args.block_size,
                approx_ttl_s=args.approx_ttl_s,
                max_model_len=args.max_model_len,
                max_in_flight_per_worker=args.max_in_flight_per_worker,
                host=args.host,
                port=args.port,
                log_level=LogLevel(args.log_level),
                health_check_interval_s=args.health_check_interval_s,
                parity_interval_s=args.parity_interval_s,
                connect_timeout_s=args.connect_timeout_s,
                upstream_timeout_s=args.upstream_timeout_s,
                max_body_bytes=args.max_body_bytes,
                forward_authorization=args.forward_authorization,
                seed=args.seed,
                pd_mode=args.pd_mode,
                kv_load_failure_policy=args.kv_load_failure_policy,
                kv_transfer_timeout_s=args.kv_transfer_timeout_s,
                pd_queue_timeout_s=args.pd_queue_timeout_s,
                kv_transport=args.kv_transport,
            )
        except ValueError as exc:
            _parser().error(str(exc))
            raise  # unreachable: error() exits


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvsidecar gateway",
        description="The OpenAI-compatible entry point: tokenizes, hashes the prompt into KV "
        "blocks, places each request on a worker and proxies the reply (streaming or not).",
    )
    w = p.add_argument_group("workers and model")
    w.add_argument(
        "--sidecar",
        action="append",
        metavar="URL",
        help="a kvsidecar sidecar beside an engine replica, e.g. http://10.0.0.5:9000: the "
        "gateway follows its KV events and sends it token ids; repeat for more",
    )
    w.add_argument(
        "--sidecar-file",
        metavar="PATH",
        help="a file of sidecar URLs, one per line (# comments), re-read when it changes",
    )
    w.add_argument(
        "--dead-after-s",
        type=float,
        default=5.0,
        help="a sidecar unreachable this long leaves placement and its blocks leave the "
        "index until it returns (default 5)",
    )
    w.add_argument(
        "--worker",
        action="append",
        metavar="URL",
        help="a plain OpenAI-compatible engine (no sidecar), e.g. "
        "http://127.0.0.1:30000; repeat for more workers",
    )
    w.add_argument(
        "--model-path",
        metavar="DIR",
        help="local model directory: tokenizer.json, tokenizer_config.json (chat "
        "template) and config.json (context length); without it the gateway "
        "does not tokenize and forwards bodies unchanged",
    )
    w.add_argument(
        "--served-model-name",
        action="append",
        metavar="NAME",
        help="model name clients use (default: the model directory's name, or what "
        "the workers list at /v1/models); repeatable",
    )
    w.add_argument(
        "--max-model-len",
        type=int,
        metavar="TOKENS",
        help="context limit (default: max_position_embeddings of config.json)",
    )
    r = p.add_argument_group("placement")
    r.add_argument(
        "--router-mode",
        default=RouterMode.KV.value,
        choices=[m.value for m in RouterMode],
        help="kv: prefix overlap + load (without sidecar events it behaves like "
        "approx); approx: recently routed prefixes count as cached for "
        "--approx-ttl-s; round-robin, random, least-loaded (in-flight requests)",
    )
    r.add_argument(
        "--overlap-weight",
        type=float,
        default=1.0,
        help="credit per GPU-cached prefix block in the cost, in blocks of prefill work "
        "(default 1.0, Dynamo's; values of 10-50 keep multi-turn conversations on the "
        "worker that holds them; docs/bench/replay.md has the sweep)",
    )
    r.add_argument(
        "--prefill-load-scale",
        type=float,
        default=1.0,
        help="weight of a block of prefill work against a block held by decoding requests "
        "(Dynamo's prefill_load_scale; default 1.0; raise it for long shared prefixes)",
    )
    r.add_argument(
        "--router-temperature",
        type=float,
        default=0.0,
        help="0 picks the cheapest worker; > 0 samples ∝ exp(-cost/T)",
    )
    r.add_argument(
        "--host-weight",
        type=float,
        default=0.75,
        help="credit per prefix block cached in host memory",
    )
    r.add_argument(
        "--disk-weight", type=float, default=0.25, help="credit per prefix block cached on disk"
    )
    r.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KV block; must match the engines' page size",
    )
    r.add_argument(
        "--approx-ttl-s",
        type=float,
        default=120.0,
        help="how long a routed prefix counts as cached without events",
    )
    r.add_argument(
        "--max-in-flight-per-worker",
        type=int,
        metavar="N",
        help="a worker with N requests in flight takes no more; 429 when all are "
        "saturated (default: unlimited)",
    )
    r.add_argument("--seed", type=int, help="seed of the random choices (tests)")
    d = p.add_argument_group("prefill/decode disaggregation (sidecars with --role prefill/decode)")
    d.add_argument(
        "--pd-mode",
        default="auto",
        choices=["auto", "sglang", "off"],
        help="auto: when prefill and decode workers exist, serve each request by a pair, the "
        "KV handed over between their sidecars; sglang: SGLang's own PD transfer (bootstrap "
        "room), our placement choosing the pair; off: aggregated workers only (default auto)",
    )
    d.add_argument(
        "--kv-load-failure-policy",
        default="fallback",
        choices=["fail", "fallback"],
        help="a failed or timed-out KV handoff: fail (502 kv_transfer_failed; streams get "
        "their first token as soon as the prefill has it, and a failure ends the stream with "
        "an error event) or fallback (re-run on an aggregated worker; the first token waits "
        "for the handoff) (default fallback)",
    )
    d.add_argument(
        "--kv-transfer-timeout-s",
        type=float,
        default=10.0,
        help="longest KV handoff (pull + import) before it counts as failed (default 10)",
    )
    d.add_argument(
        "--kv-transport",
        default="auto",
        choices=["auto", "shm", "nixl", "tcp"],
        help="how decode sidecars pull blocks (--kv-handoff transfer): auto = shm when the "
        "two sidecars share a host, else nixl, falling back to tcp (default auto)",
    )
    d.add_argument(
        "--pd-queue-timeout-s",
        type=float,
        default=30.0,
        help="how long a request waits for room in a full decode pool before 503 "
        "(default 30)",
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument(
        "--port",
        type=int,
        default=8000,
        help="port to listen on (0: any free port, printed in gateway_started)",
    )
    s.add_argument(
        "--log-level",
        default=LogLevel.INFO.value,
        choices=[lv.value for lv in LogLevel],
        help="debug adds one canonical log line per request",
    )
    s.add_argument(
        "--health-check-interval-s",
        type=float,
        default=10.0,
        help="seconds between GET /health probes of each worker",
    )
    s.add_argument(
        "--parity-interval-s",
        type=float,
        default=300.0,
        help="seconds between checks that each sidecar worker's engine tokenizes and caches "
        "as the gateway hashes (a canary conversation, and the cached tokens engines report); "
        "also checked when a worker's stream comes up (default 300)",
    )
    s.add_argument("--connect-timeout-s", type=float, default=5.0)
    s.add_argument(
        "--upstream-timeout-s",
        type=float,
        default=600.0,
        help="longest silence from a worker before the request is abandoned",
    )
    s.add_argument("--max-body-bytes", type=int, default=32 << 20)
    s.add_argument(
        "--forward-authorization",
        action="store_true",
        help="send the client's Authorization header on to the workers (off by default: a "
        "client's credential is the gateway's to check, an engine's key is its sidecar's: "
        "kvsidecar sidecar --engine-api-key-file)",
    )
    s.add_argument("--ready-file", help="write {'url': ...} JSON here once listening")
    return p
