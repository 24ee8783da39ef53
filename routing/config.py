"""The gateway's typed configuration, and its command line: each field of ``RouterConfig`` is
one option (``kvcore.options``), whose metadata makes its flag (and, for the few that
``deploy/k8s`` sets, its ``KVSIDECAR_*`` variable); ``routing.flags.gateway_config`` builds
the config from the flags (and ``--config FILE``). The vocabularies of the string options
are the enums of ``routing.vocabulary``, re-exported here, which every other command that
passes them on (``kvsidecar up``, replay) uses too."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from kvcore import nats_extra
from kvcore.events import Tier
from kvcore.options import check_bounds, member, option
from routing.vocabulary import (
    EventsVia,
    FailurePolicy,
    KvMove,
    KvTransport,
    LogLevel,
    PdMode,
    QueueOrder,
    RouterMode,
    WorkerAddress,
)

__all__ = ["DEFAULT_TIER_WEIGHTS", "TIER_WEIGHT_FIELDS", "EventsVia", "FailurePolicy", "KvMove",
           "KvTransport", "LogLevel", "PdMode", "RouterConfig", "RouterMode", "WorkerAddress"]


# The flags' groups in --help, in this order (a group appears where its first field is).
_WORKERS = "workers and model"
_K8S = "sidecars in Kubernetes (instead of --sidecar/--sidecar-file; docs/deploy-kubernetes.md)"
_PLACEMENT = "placement"
_ADMISSION = "admission control (when a worker is busy, and what then)"
_PD = "prefill/decode disaggregation (sidecars with --role prefill/decode)"
_REPLICAS = "gateway replicas (docs/replicas.md)"
_SERVER = "server"
_SECURITY = "security (docs/security.md)"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything ``kvsidecar gateway`` needs; validated on construction. Each field is a
    flag, ``--`` and its name with dashes unless it says otherwise."""

    sidecars: tuple[WorkerAddress, ...] = option(
        (), group=_WORKERS, flag="--sidecar", metavar="URL", parse=WorkerAddress.parse,
        help="a kvsidecar sidecar beside an engine replica, e.g. http://10.0.0.5:9000: the "
        "gateway follows its KV events and sends it token ids; repeat for more")
    sidecar_file: Path | None = option(
        None, group=_WORKERS, metavar="PATH",
        help="a file of sidecar URLs, one per line (# comments), re-read when it changes")
    dead_after_s: float = option(
        5.0, group=_WORKERS, gt=0,
        help="a sidecar unreachable this long leaves placement and its blocks leave the "
        "index until it returns")
    workers: tuple[WorkerAddress, ...] = option(
        (), group=_WORKERS, flag="--worker", metavar="URL", parse=WorkerAddress.parse,
        help="a plain OpenAI-compatible engine (no sidecar), e.g. "
        "http://127.0.0.1:30000; repeat for more workers")
    model_path: Path | None = option(
        None, group=_WORKERS, metavar="DIR", env="KVSIDECAR_MODEL_PATH",
        help="local model directory: tokenizer.json, tokenizer_config.json (chat "
        "template) and config.json (context length); without it the gateway "
        "does not tokenize and forwards bodies unchanged")
    served_model_names: tuple[str, ...] = option(
        (), group=_WORKERS, flag="--served-model-name", metavar="NAME",
        help="model name clients use; repeatable",
        default_text="the model directory's name, or what the workers list at /v1/models")
    max_model_len: int | None = option(
        None, group=_WORKERS, ge=1, metavar="TOKENS", help="context limit",
        default_text="max_position_embeddings of config.json")
    tokenizer_cache_tokens: int = option(
        4_000_000, group=_WORKERS, ge=0, metavar="TOKENS",
        help="token ids of recent prompt segments kept for reuse (about 36 bytes a token: "
        "~145 MiB for the default, when full; 0: no cache)")

    # Sidecars found in Kubernetes (routing/workers/k8s_discovery.py): pods by label selector.
    discover_k8s_selector: str | None = option(
        None, group=_K8S, metavar="LABELS", env="KVSIDECAR_DISCOVER_K8S_SELECTOR",
        help="follow the pods with these labels (e.g. kvsidecar.io/inject=enabled): each "
        "Running, Ready pod is a sidecar at http://<pod IP>:<port>, listed, then watched")
    discover_k8s_namespace: str | None = option(
        None, group=_K8S, metavar="NS", help="the pods' namespace",
        default_text="the gateway pod's own")
    discover_k8s_port: str = option(
        "kvsidecar", group=_K8S, metavar="NAME|NUMBER",
        help="the sidecar's port: a container port's name in the pod (the default is the "
        "injected sidecar's), or a number")
    k8s_api_url: str | None = option(
        None, group=_K8S, metavar="URL", help="the API server",
        default_text="in-cluster, https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT; "
        "http://127.0.0.1:8001 for `kubectl proxy`")
    k8s_token_file: Path | None = option(
        None, group=_K8S, metavar="FILE", help="bearer token, re-read on every reconnect",
        default_text="the service account's")
    k8s_ca_file: Path | None = option(
        None, group=_K8S, metavar="PEM", help="CA of the API server's certificate",
        default_text="the service account's, else the system's")
    k8s_insecure: bool = option(
        False, group=_K8S, flag="--k8s-insecure-skip-tls-verify",
        help="do not verify the API server's certificate (tests only)")

    router_mode: RouterMode = option(
        RouterMode.KV, group=_PLACEMENT, env="KVSIDECAR_ROUTER_MODE",
        help="kv: prefix overlap + load (without sidecar events it behaves like "
        "approx); approx: recently routed prefixes count as cached for "
        "--approx-ttl-s, sidecars' events unused; round-robin, random, least-loaded "
        "(in-flight requests)")
    # None: learned from the fleet's feedback (routing/placement/tuning.py); a number fixes it.
    overlap_weight: float | None = option(
        None, group=_PLACEMENT, ge=0,
        help="credit per GPU-cached prefix block in the cost, in blocks of prefill work",
        default_text="learned, from 1 while the engines evict nothing up to 21 when every "
        "store evicts; a number fixes it; docs/bench/pressure.md")
    prefill_load_scale: float | None = option(
        None, group=_PLACEMENT, ge=0,
        help="weight of a block of prefill work against a block held by decoding requests "
        "(Dynamo's prefill_load_scale)",
        default_text="learned from time to first token; a number fixes it")
    decode_interference_weight: float = option(
        1.0, group=_PLACEMENT, ge=0,
        help="weight of the learned decode-interference term: the time a worker's streams "
        "run past --slo-itl-ms with one more request (its inter-token latency against "
        "requests in flight, learned from the relayed streams; nothing while the target "
        "holds); 0 turns it off (prefill and held blocks only)")
    router_temperature: float = option(
        0.0, group=_PLACEMENT, ge=0, help="0 picks the cheapest worker; > 0 samples ∝ exp(-cost/T)")
    # Each tier's credit below the GPU (``tier_weights``); the defaults are the scorer's too
    # (``DEFAULT_TIER_WEIGHTS``, made from them below).
    host_weight: float = option(
        0.75, group=_PLACEMENT, ge=0, help="credit per prefix block cached in host memory")
    disk_weight: float = option(
        0.25, group=_PLACEMENT, ge=0, help="credit per prefix block cached on disk")
    remote_weight: float = option(
        0.1, group=_PLACEMENT, ge=0,
        help="credit per prefix block in the remote tier (a store shared by every replica of "
        "the model: credited on each of them)")
    kv_move: KvMove = option(
        KvMove.OFF, group=_PLACEMENT,
        help="on: when the worker holding a prefix is busier than its cached prefix is worth, "
        "a lighter worker's sidecar may pull the prefix from the holder's block store (over "
        "--kv-transport) before prefill, priced by the pulls' measured speed against the "
        "prefill's (placement reason 'moved'; a failed pull recomputes); off: never (the "
        "default: on the hot-prefix bench it did not beat herding, docs/bench/kv-move.md)")
    block_size: int = option(
        16, group=_PLACEMENT, ge=1, le=4096, env="KVSIDECAR_BLOCK_SIZE",
        help="tokens per KV block; must match the engines' page size")
    approx_ttl_s: float = option(
        120.0, group=_PLACEMENT, gt=0,
        help="how long a routed prefix counts as cached in approx mode (and kv without sidecars)")
    seed: int | None = option(None, group=_PLACEMENT, help="seed of the random choices (tests)")
    xxh3_seed: int | None = option(
        None, group=_PLACEMENT, ge=0, le=(1 << 64) - 1, metavar="SEED", default_text="off",
        help="also keep each indexed block's XXH3-64 rolling hash with this seed (1337 is "
        "Dynamo's), computed at ingest from its events' token ids, so the KV indexer API's "
        "/query_by_hash answers in the Mooncake RFC's scheme (docs/indexer-api.md)")

    # Admission control (routing/pipeline/admission.py): busy thresholds, the waiting queue,
    # and x-session-id affinity.
    max_in_flight_per_worker: int | None = option(
        None, group=_ADMISSION, ge=1, metavar="N",
        help="a worker with N requests in flight (from this gateway) is busy",
        default_text="unlimited")
    busy_kv_fraction: float | None = option(
        None, group=_ADMISSION, gt=0, le=1, metavar="F",
        help="a worker whose active requests hold F of its KV capacity (0 < F <= 1; from its "
        "engine's load report where it publishes one) is busy", default_text="off")
    busy_prefill_tokens: int | None = option(
        None, group=_ADMISSION, ge=1, metavar="N",
        help="a worker with N prompt tokens waiting for prefill is busy", default_text="off")
    queue_timeout_s: float = option(
        0.0, group=_ADMISSION, ge=0, metavar="S",
        help="when every worker is busy, a request waits up to S seconds for one (higher "
        "x-kvsidecar-priority first, then by --queue-order), then gets 503 with retry-after; "
        "0: 429 with retry-after at once")
    queue_max: int = option(
        1024, group=_ADMISSION, ge=1, metavar="N",
        help="requests that may wait at once; past it, the one ranking last gets 429 with "
        "retry-after")
    queue_order: QueueOrder = option(
        QueueOrder.FAIR, group=_ADMISSION,
        help="within a priority, waiting requests are served by their tenants' weighted fair "
        "shares of tokens (fair; the API key file's weight= column) or first come, first "
        "served (fcfs)")
    queue_lookahead: int = option(
        16, group=_ADMISSION, ge=0, metavar="N",
        help="with a prefix policy (kv, approx): a freed worker takes a waiting request whose "
        "prefix it holds, among the N behind the queue's head in its priority band, before "
        "the head when a busy worker holds the head's; the head is passed over at most N "
        "times; 0: always the head")
    session_affinity: bool = option(
        False, group=_ADMISSION,
        help="keep a client's x-session-id on the worker that served it last, while that "
        "worker is routable and not busy (placement reason 'affinity')")
    session_ttl_s: float = option(
        600.0, group=_ADMISSION, gt=0, metavar="S",
        help="how long a session stays pinned after its last request")
    # What counts as served well (routing/pipeline/slo.py), counted on /metrics as goodput.
    slo_ttft_ms: float = option(
        2000.0, group=_ADMISSION, gt=0, le=3_600_000, metavar="MS",
        help="a request's time-to-first-token target, unless it names its own in "
        "x-kvsidecar-slo-ttft-ms")
    slo_itl_ms: float = option(
        100.0, group=_ADMISSION, gt=0, le=3_600_000, metavar="MS",
        help="a stream's mean inter-token latency target, unless it names its own in "
        "x-kvsidecar-slo-itl-ms")

    # Prefill/decode disaggregation (routing/pd/coordinator.py).
    pd_mode: PdMode = option(
        PdMode.AUTO, group=_PD,
        help="auto: when prefill and decode workers exist, serve each request by a pair, the "
        "KV handed over between their sidecars; sglang: SGLang's own PD transfer (bootstrap "
        "room), our placement choosing the pair; off: aggregated workers only")
    kv_load_failure_policy: FailurePolicy = option(
        FailurePolicy.FALLBACK, group=_PD,
        help="a failed or timed-out KV handoff: fail (502 kv_transfer_failed; streams get "
        "their first token as soon as the prefill has it, and a failure ends the stream with "
        "an error event) or fallback (re-run on an aggregated worker; the first token waits "
        "for the handoff)")
    kv_transfer_timeout_s: float = option(
        10.0, group=_PD, ge=0,
        help="longest KV handoff (pull + import) before it counts as failed")
    kv_transport: KvTransport = option(
        KvTransport.AUTO, group=_PD,
        help="how decode sidecars pull blocks (--kv-handoff transfer): auto = shm when the "
        "two sidecars share a host, else nixl, falling back to tcp")
    pd_queue_timeout_s: float = option(
        30.0, group=_PD, ge=0,
        help="how long a request waits for room in a full decode pool before 503")

    # Replicas that agree over NATS (routing/replicas, docs/replicas.md); None: alone.
    nats_url: str | None = option(
        None, group=_REPLICAS, flag="--nats", metavar="URL",
        help="nats://HOST:PORT: share placements and in-flight load with the other gateway "
        "replicas on this NATS server, so replicas behind one balancer place like one gateway "
        "(the 'nats' extra)", default_text="alone")
    nats_subject_prefix: str | None = option(
        None, group=_REPLICAS, metavar="PREFIX", help="subjects of this fleet's replicas",
        default_text="kvsidecar.<model name>")
    nats_peer_timeout_s: float = option(
        3.0, group=_REPLICAS, gt=0,
        help="a replica not heard from this long has its load dropped here")
    # (routing/replicas/prompt_hold.py)
    nats_new_prompt_window_ms: float = option(
        50.0, group=_REPLICAS, ge=0, le=10_000, metavar="MS",
        help="a prompt no worker holds yet, which another replica owns, waits MS for that "
        "replica's placement of it, then asks it where to go (20 x MS at most), so sessions "
        "of a new prompt through several replicas share one worker (0: never wait)")
    # Durable events (routing/replicas/durable.py): KV events read from JetStream, the index
    # snapshotted to its object store every interval (0: never) and loaded at start.
    events_via: EventsVia = option(
        EventsVia.DIRECT, group=_REPLICAS,
        help="nats: read the KV events from the model's JetStream stream (sidecars with "
        "--events-via nats), start from the newest index snapshot; the sidecars' streams "
        "carry status, resyncs, and the events while NATS is away")
    snapshot_interval_s: float = option(
        30.0, group=_REPLICAS, ge=0,
        help="with --events-via nats: write the index to JetStream's object store this often, "
        "for gateways that start later (0: never)")

    host: str = option("127.0.0.1", group=_SERVER, help="address to listen on")
    port: int = option(
        8000, group=_SERVER, ge=0, le=65535,
        help="port to listen on (0: any free port, printed in gateway_started)")
    log_level: LogLevel = option(
        LogLevel.INFO, group=_SERVER, env="KVSIDECAR_LOG_LEVEL",
        help="debug adds one canonical log line per request")
    health_check_interval_s: float = option(
        10.0, group=_SERVER, gt=0, help="seconds between GET /health probes of each worker")
    parity_interval_s: float = option(
        300.0, group=_SERVER, gt=0,
        help="seconds between checks that each sidecar worker's engine tokenizes and caches "
        "as the gateway hashes (a canary conversation, and the cached tokens engines report); "
        "also checked when a worker's stream comes up")
    connect_timeout_s: float = option(
        5.0, group=_SERVER, gt=0, help="longest wait for a connection to a worker")
    upstream_timeout_s: float = option(
        600.0, group=_SERVER, gt=0,
        help="longest silence from a worker before the request is abandoned (or, a stream "
        "with --migration-limit, continued elsewhere)")
    migration_limit: int = option(
        0, group=_SERVER, ge=0, le=100, metavar="N",
        help="a stream whose worker dies mid-reply goes on on another worker, from the "
        "tokens the client already has, up to N times (0: it is cut)")
    drain_timeout_s: float = option(
        30.0, group=_SERVER, ge=0,
        help="on SIGTERM the gateway stops accepting, reports draining, and gives the "
        "requests in flight this long to finish before it cuts them")
    max_body_bytes: int = option(
        32 << 20, group=_SERVER, ge=1024, help="largest request body accepted (larger: 413)")
    max_idle_connections_per_worker: int = option(
        256, group=_SERVER, ge=0, metavar="N",
        help="keep-alive connections to each worker kept open while idle")
    forward_authorization: bool = option(
        False, group=_SERVER,
        help="send the client's Authorization header on to the workers (off by default: a "
        "client's credential is the gateway's to check, an engine's key is its sidecar's: "
        "kvsidecar sidecar --engine-api-key-file)")
    ready_file: Path | None = option(
        None, group=_SERVER, help="write {'url': ...} JSON here once listening")

    # Security (docs/security.md): client keys → tenants, their limits, TLS, the sidecars' token.
    api_key_file: Path | None = option(
        None, group=_SECURITY, metavar="FILE",
        help="client API keys, one 'KEY TENANT [rps=N] [tps=N]' or 'sha256:HEX TENANT ...' a "
        "line; re-read when it changes. A request without a listed key (Authorization: "
        "Bearer, or x-api-key) gets 401; each tenant's blocks live in its own cache "
        "namespace. Only /health and /metrics stay open")
    rate_limit_rps: float | None = option(
        None, group=_SECURITY, gt=0, metavar="N",
        help="requests per second per tenant (the key file's rps= column overrides it); over "
        "it: 429 with retry-after", default_text="unlimited")
    rate_limit_tps: float | None = option(
        None, group=_SECURITY, gt=0, metavar="N",
        help="tokens per second per tenant, counted at admission as prompt tokens + "
        "max_tokens (tps= in the key file overrides it)", default_text="unlimited")
    rate_limit_burst_s: float = option(
        1.0, group=_SECURITY, gt=0, metavar="S",
        help="a full bucket holds this many seconds of each rate: what an idle tenant may "
        "send at once")
    tenant_salt_secret_file: Path | None = option(
        None, group=_SECURITY, metavar="FILE",
        help="a secret from which each tenant's cache salt is derived (HMAC); give every "
        "gateway of a fleet the same one", default_text="salts derive from tenant names alone")
    tls_cert: Path | None = option(
        None, group=_SECURITY, metavar="PEM", help="serve HTTPS with this certificate chain")
    tls_key: Path | None = option(
        None, group=_SECURITY, metavar="PEM", help="the private key of --tls-cert")
    sidecar_token_file: Path | None = option(
        None, group=_SECURITY, metavar="FILE",
        help="the sidecars' control token (their --control-token-file), sent to them as "
        "x-kvsidecar-token on every call")

    def __post_init__(self) -> None:
        check_bounds(self)  # each option's range, declared with it; relations follow
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
        for name, vocabulary in (("pd_mode", PdMode), ("kv_transport", KvTransport),
                                 ("kv_move", KvMove),
                                 ("kv_load_failure_policy", FailurePolicy),
                                 ("events_via", EventsVia)):
            # frozen, but not yet shared: a plain string from code becomes its member
            object.__setattr__(self, name, member(name, getattr(self, name), vocabulary))
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("give both --tls-cert and --tls-key, or neither")
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
            nats_extra.check_url(self.nats_url)
        prefix = self.nats_subject_prefix
        if prefix is not None and not re.fullmatch(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*", prefix):
            raise ValueError("--nats-subject-prefix must be dot-separated tokens of letters, "
                             f"digits, '_' and '-', got {prefix!r}")
        if self.events_via is EventsVia.NATS and self.nats_url is None:
            raise ValueError("--events-via nats reads the events from NATS: give --nats URL")
        if self.events_via is EventsVia.NATS and not (self.sidecars or self.sidecar_file
                                              or self.discover_k8s_selector):
            raise ValueError("--events-via nats reads sidecars' events: give --sidecar URLs")

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
    def tier_weights(self) -> dict[Tier, float]:
        """The credit per cached block of each tier below the GPU (``ScoringWeights``)."""
        return {tier: getattr(self, name) for tier, name in TIER_WEIGHT_FIELDS.items()}

    @property
    def model_names(self) -> tuple[str, ...]:
        """Names clients may ask for (empty: learned from the workers' /v1/models)."""
        if self.served_model_names:
            return self.served_model_names
        if self.model_path is not None:
            return (self.model_path.resolve().name,)
        return ()


# The field that sets each tier's credit below the GPU, fastest first.
TIER_WEIGHT_FIELDS: Mapping[Tier, str] = MappingProxyType(
    {Tier.HOST: "host_weight", Tier.DISK: "disk_weight", Tier.REMOTE: "remote_weight"})
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
# Credit per cached block of each tier below the GPU, in blocks of prefill work: the flags'
# defaults, which the scorer takes as its own (``ScoringWeights``).
DEFAULT_TIER_WEIGHTS: Mapping[Tier, float] = MappingProxyType(
    {tier: float(_DEFAULTS[name]) for tier, name in TIER_WEIGHT_FIELDS.items()})
