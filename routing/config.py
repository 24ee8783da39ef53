"""The gateway's typed configuration; ``routing.flags.gateway_config(argv)`` builds it from the
command line."""

from __future__ import annotations

import enum
import math
import re
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
    # Sidecars found in Kubernetes (routing/workers/k8s_discovery.py): pods by label selector.
    discover_k8s_selector: str | None = None
    discover_k8s_namespace: str | None = None  # None: the gateway pod's own namespace
    discover_k8s_port: str = "kvsidecar"  # the sidecar container port's name, or a number
    k8s_api_url: str | None = None  # None: in-cluster (KUBERNETES_SERVICE_HOST/PORT)
    k8s_token_file: Path | None = None  # None: the service account's, when there is one
    k8s_ca_file: Path | None = None  # None: the service account's CA, else the system's
    k8s_insecure: bool = False
    dead_after_s: float = 5.0
    ready_file: Path | None = None
    router_mode: RouterMode = RouterMode.KV
    model_path: Path | None = None
    served_model_names: tuple[str, ...] = ()
    # None: learned from the fleet's feedback (routing/placement/tuning.py); a number fixes it.
    overlap_weight: float | None = None
    prefill_load_scale: float | None = None
    router_temperature: float = 0.0
    host_weight: float = 0.75
    disk_weight: float = 0.25
    remote_weight: float = 0.1
    block_size: int = 16
    approx_ttl_s: float = 120.0
    max_model_len: int | None = None
    tokenizer_cache_tokens: int = 4_000_000  # token ids of prompt segments kept (0: none)
    max_in_flight_per_worker: int | None = None
    # Admission control (routing/pipeline/admission.py): busy thresholds, the waiting queue,
    # and x-session-id affinity.
    busy_kv_fraction: float | None = None
    busy_prefill_tokens: int | None = None
    queue_timeout_s: float = 0.0  # 0: a request finding every worker busy is refused at once
    queue_max: int = 1024
    session_affinity: bool = False
    session_ttl_s: float = 600.0
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: LogLevel = LogLevel.INFO
    health_check_interval_s: float = 10.0
    parity_interval_s: float = 300.0  # hash parity check of each sidecar worker
    connect_timeout_s: float = 5.0
    upstream_timeout_s: float = 600.0
    migration_limit: int = 0  # times a stream may go on on another worker (0: never)
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight requests may finish
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
    # Security (docs/security.md): client keys → tenants, their limits, TLS, the sidecars' token.
    api_key_file: Path | None = None
    rate_limit_rps: float | None = None
    rate_limit_tps: float | None = None
    rate_limit_burst_s: float = 1.0
    tenant_salt_secret_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    sidecar_token_file: Path | None = None
    # Replicas that agree over NATS (routing/replicas, docs/replicas.md); None: alone.
    nats_url: str | None = None
    nats_subject_prefix: str | None = None  # None: kvsidecar.<model>
    nats_peer_timeout_s: float = 3.0  # a replica silent this long has its load dropped
    # a new prompt another replica owns waits for its placements this long after arriving
    # (routing/replicas/prompt_hold.py)
    nats_new_prompt_window_ms: float = 50.0
    # Durable events (routing/replicas/durable.py): KV events read from JetStream, the index
    # snapshotted to its object store every interval (0: never) and loaded at start.
    events_via: str = "direct"
    snapshot_interval_s: float = 30.0

    def __post_init__(self) -> None:
        if not (self.workers or self.sidecars or self.sidecar_file
                or self.discover_k8s_selector):
            raise ValueError("give at least one --sidecar URL, --sidecar-file or --worker URL "
                             "(or --discover-k8s-selector LABELS)")
        urls = [w.url for w in (*self.workers, *self.sidecars)]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a worker or sidecar is listed twice: {urls}")
        self._check_k8s()
        if (self.sidecars or self.sidecar_file or self.discover_k8s_selector) \
                and self.model_path is None:
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
            "remote_weight",
        ):
            value = getattr(self, name)
            if value is None and name in ("overlap_weight", "prefill_load_scale"):
                continue  # learned
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
        if not math.isfinite(self.drain_timeout_s) or self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
        if not 0 <= self.migration_limit <= 100:
            raise ValueError(f"migration_limit must be in [0, 100], got {self.migration_limit}")
        if self.tokenizer_cache_tokens < 0:
            raise ValueError(
                f"tokenizer_cache_tokens must be >= 0, got {self.tokenizer_cache_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_in_flight_per_worker is not None and self.max_in_flight_per_worker < 1:
            raise ValueError(
                f"max_in_flight_per_worker must be >= 1, got {self.max_in_flight_per_worker}"
            )
        if self.busy_kv_fraction is not None and not 0 < self.busy_kv_fraction <= 1:
            raise ValueError(f"busy_kv_fraction must be in (0, 1], got {self.busy_kv_fraction}")
        if self.busy_prefill_tokens is not None and self.busy_prefill_tokens < 1:
            raise ValueError(f"busy_prefill_tokens must be >= 1, got {self.busy_prefill_tokens}")
        if not math.isfinite(self.queue_timeout_s) or self.queue_timeout_s < 0:
            raise ValueError(f"queue_timeout_s must be >= 0, got {self.queue_timeout_s!r}")
        if self.queue_max < 1:
            raise ValueError(f"queue_max must be >= 1, got {self.queue_max}")
        if not math.isfinite(self.session_ttl_s) or self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s!r}")
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
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both --tls-cert and --tls-key, or neither")
        for name in ("rate_limit_rps", "rate_limit_tps"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not math.isfinite(self.rate_limit_burst_s) or self.rate_limit_burst_s <= 0:
            raise ValueError(f"rate_limit_burst_s must be > 0, got {self.rate_limit_burst_s!r}")
        if self.api_key_file is None and (
            self.rate_limit_rps is not None or self.rate_limit_tps is not None
        ):
            raise ValueError("rate limits are per tenant: give --api-key-file too")
        for name in ("api_key_file", "tenant_salt_secret_file", "tls_cert", "tls_key",
                     "sidecar_token_file"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"--{name.replace('_', '-')} {path} is not a readable file")
        self._check_nats()
        if self.model_path is not None and not (self.model_path / "tokenizer.json").is_file():
            raise ValueError(f"--model-path {self.model_path} has no tokenizer.json")

    def _check_nats(self) -> None:
        if self.nats_url is not None:
            for url in self.nats_url.split(","):
                parts = urlsplit(url.strip())
                if parts.scheme not in ("nats", "tls") or not parts.hostname:
                    raise ValueError(f"--nats must be nats://HOST:PORT (or tls://, comma-"
                                     f"separated for a cluster), got {self.nats_url!r}")
        prefix = self.nats_subject_prefix
        if prefix is not None and not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", prefix):
            raise ValueError("--nats-subject-prefix must be dot-separated tokens of letters, "
                             f"digits, '_' and '-', got {prefix!r}")
        if not math.isfinite(self.nats_peer_timeout_s) or self.nats_peer_timeout_s <= 0:
            raise ValueError(f"nats_peer_timeout_s must be > 0, got {self.nats_peer_timeout_s!r}")
        window = self.nats_new_prompt_window_ms
        if not math.isfinite(window) or not 0 <= window <= 10_000:
            raise ValueError(f"--nats-new-prompt-window-ms must be in [0, 10000], got {window!r}")
        if self.events_via not in ("direct", "nats"):
            raise ValueError(f"events_via must be direct or nats, got {self.events_via!r}")
        if self.events_via == "nats" and self.nats_url is None:
            raise ValueError("--events-via nats reads the events from NATS: give --nats URL")
        if self.events_via == "nats" and not (self.sidecars or self.sidecar_file
                                              or self.discover_k8s_selector):
            raise ValueError("--events-via nats reads sidecars' events: give --sidecar URLs")
        if not math.isfinite(self.snapshot_interval_s) or self.snapshot_interval_s < 0:
            raise ValueError(f"snapshot_interval_s must be >= 0, got {self.snapshot_interval_s!r}")

    def _check_k8s(self) -> None:
        if self.discover_k8s_selector is None:
            return
        if not self.discover_k8s_selector.strip():
            raise ValueError("--discover-k8s-selector must not be empty (e.g. "
                             "kvsidecar.io/inject=enabled)")
        if self.sidecars or self.sidecar_file:
            raise ValueError("--discover-k8s-selector replaces --sidecar and --sidecar-file: "
                             "give one way of finding the sidecars")
        port = self.discover_k8s_port
        if port.isdigit():
            if not 1 <= int(port) <= 65535:
                raise ValueError(f"--discover-k8s-port must be in [1, 65535], got {port}")
        elif not re.fullmatch(r"(?=.*[a-z])[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", port):
            raise ValueError("--discover-k8s-port must be a container port's name (lowercase "
                             f"letters, digits and '-', at most 15) or a number, got {port!r}")
        if self.k8s_api_url is not None and urlsplit(self.k8s_api_url).scheme not in (
            "http", "https"
        ):
            raise ValueError(f"--k8s-api-url must be http(s)://host:port, got "
                             f"{self.k8s_api_url!r}")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names clients may ask for (empty: learned from the workers' /v1/models)."""
        if self.served_model_names:
            return self.served_model_names
        if self.model_path is not None:
            return (self.model_path.resolve().name,)
        return ()
