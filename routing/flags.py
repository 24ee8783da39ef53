"""The gateway's command line: its flags (argparse groups) and ``gateway_config(argv)``, the one
builder of a ``RouterConfig`` from them (the endpoint picker builds on ``gateway_parser()``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from routing.config import LogLevel, RouterConfig, RouterMode, WorkerAddress

__all__ = ["gateway_config", "gateway_parser"]


def gateway_config(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> RouterConfig:
    """From the command line; ``parser``: one built on ``gateway_parser()`` with more
    flags (the endpoint picker's), whose own flags its caller reads."""
    p = parser or _parser()
    args = p.parse_args(argv)
    try:
        return RouterConfig(
            workers=tuple(WorkerAddress.parse(u) for u in args.worker or ()),
            sidecars=tuple(WorkerAddress.parse(u) for u in args.sidecar or ()),
            sidecar_file=Path(args.sidecar_file) if args.sidecar_file else None,
            discover_k8s_selector=args.discover_k8s_selector,
            discover_k8s_namespace=args.discover_k8s_namespace,
            discover_k8s_port=args.discover_k8s_port,
            k8s_api_url=args.k8s_api_url,
            k8s_token_file=Path(args.k8s_token_file) if args.k8s_token_file else None,
            k8s_ca_file=Path(args.k8s_ca_file) if args.k8s_ca_file else None,
            k8s_insecure=args.k8s_insecure_skip_tls_verify,
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
            remote_weight=args.remote_weight,
            block_size=args.block_size,
            approx_ttl_s=args.approx_ttl_s,
            max_model_len=args.max_model_len,
            tokenizer_cache_tokens=args.tokenizer_cache_tokens,
            max_in_flight_per_worker=args.max_in_flight_per_worker,
            busy_kv_fraction=args.busy_kv_fraction,
            busy_prefill_tokens=args.busy_prefill_tokens,
            queue_timeout_s=args.queue_timeout_s,
            queue_max=args.queue_max,
            session_affinity=args.session_affinity,
            session_ttl_s=args.session_ttl_s,
            host=args.host,
            port=args.port,
            log_level=LogLevel(args.log_level),
            health_check_interval_s=args.health_check_interval_s,
            parity_interval_s=args.parity_interval_s,
            connect_timeout_s=args.connect_timeout_s,
            upstream_timeout_s=args.upstream_timeout_s,
            migration_limit=args.migration_limit,
            drain_timeout_s=args.drain_timeout_s,
            max_body_bytes=args.max_body_bytes,
            forward_authorization=args.forward_authorization,
            seed=args.seed,
            pd_mode=args.pd_mode,
            kv_load_failure_policy=args.kv_load_failure_policy,
            kv_transfer_timeout_s=args.kv_transfer_timeout_s,
            pd_queue_timeout_s=args.pd_queue_timeout_s,
            kv_transport=args.kv_transport,
            api_key_file=_path(args.api_key_file),
            rate_limit_rps=args.rate_limit_rps,
            rate_limit_tps=args.rate_limit_tps,
            rate_limit_burst_s=args.rate_limit_burst_s,
            tenant_salt_secret_file=_path(args.tenant_salt_secret_file),
            tls_cert=_path(args.tls_cert),
            tls_key=_path(args.tls_key),
            sidecar_token_file=_path(args.sidecar_token_file),
            nats_url=args.nats,
            nats_subject_prefix=args.nats_subject_prefix,
            nats_peer_timeout_s=args.nats_peer_timeout_s,
            nats_new_prompt_window_ms=args.nats_new_prompt_window_ms,
            events_via=args.events_via,
            snapshot_interval_s=args.snapshot_interval_s,
        )
    except ValueError as exc:
        p.error(str(exc))
        raise  # unreachable: error() exits


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def gateway_parser() -> argparse.ArgumentParser:
    """The gateway's flags, for a command that places requests as the gateway does."""
    return _parser()


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
    w.add_argument(
        "--tokenizer-cache-tokens",
        type=int,
        default=4_000_000,
        metavar="TOKENS",
        help="token ids of recent prompt segments kept for reuse, about 36 bytes a token "
        "(default 4,000,000: ~145 MiB when full; 0: no cache)",
    )
    k = p.add_argument_group(
        "sidecars in Kubernetes (instead of --sidecar/--sidecar-file; docs/deploy-kubernetes.md)"
    )
    k.add_argument(
        "--discover-k8s-selector",
        metavar="LABELS",
        help="follow the pods with these labels (e.g. kvsidecar.io/inject=enabled): each "
        "Running, Ready pod is a sidecar at http://<pod IP>:<port>, listed, then watched",
    )
    k.add_argument(
        "--discover-k8s-namespace",
        metavar="NS",
        help="the pods' namespace (default: the gateway pod's own)",
    )
    k.add_argument(
        "--discover-k8s-port",
        default="kvsidecar",
        metavar="NAME|NUMBER",
        help="the sidecar's port: a container port's name in the pod, or a number "
        "(default kvsidecar, the injected sidecar's)",
    )
    k.add_argument(
        "--k8s-api-url",
        metavar="URL",
        help="the API server (default: in-cluster, https://$KUBERNETES_SERVICE_HOST:"
        "$KUBERNETES_SERVICE_PORT; http://127.0.0.1:8001 for `kubectl proxy`)",
    )
    k.add_argument(
        "--k8s-token-file",
        metavar="FILE",
        help="bearer token, re-read on every reconnect (default: the service account's)",
    )
    k.add_argument(
        "--k8s-ca-file",
        metavar="PEM",
        help="CA of the API server's certificate (default: the service account's)",
    )
    k.add_argument(
        "--k8s-insecure-skip-tls-verify",
        action="store_true",
        help="do not verify the API server's certificate (tests only)",
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
        default=None,
        help="credit per GPU-cached prefix block in the cost, in blocks of prefill work "
        "(default: learned, from 1 while the engines evict nothing up to 21 when every "
        "store evicts; a number fixes it; docs/bench/pressure.md)",
    )
    r.add_argument(
        "--prefill-load-scale",
        type=float,
        default=None,
        help="weight of a block of prefill work against a block held by decoding requests "
        "(Dynamo's prefill_load_scale; default: learned from time to first token; a number "
        "fixes it)",
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
        "--remote-weight",
        type=float,
        default=0.1,
        help="credit per prefix block in the remote tier (a store shared by every replica of "
        "the model: credited on each of them)",
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
    a = p.add_argument_group("admission control (when a worker is busy, and what then)")
    a.add_argument(
        "--max-in-flight-per-worker",
        type=int,
        metavar="N",
        help="a worker with N requests in flight (from this gateway) is busy "
        "(default: unlimited)",
    )
    a.add_argument(
        "--busy-kv-fraction",
        type=float,
        metavar="F",
        help="a worker whose active requests hold F of its KV capacity (0 < F <= 1; from its "
        "engine's load report where it publishes one) is busy (default: off)",
    )
    a.add_argument(
        "--busy-prefill-tokens",
        type=int,
        metavar="N",
        help="a worker with N prompt tokens waiting for prefill is busy (default: off)",
    )
    a.add_argument(
        "--queue-timeout-s",
        type=float,
        default=0.0,
        metavar="S",
        help="when every worker is busy, a request waits up to S seconds for one (FIFO, "
        "higher x-kvsidecar-priority first), then gets 503 with retry-after; 0 (default): "
        "429 with retry-after at once",
    )
    a.add_argument(
        "--queue-max",
        type=int,
        default=1024,
        metavar="N",
        help="requests that may wait at once; past it, 429 with retry-after (default 1024)",
    )
    a.add_argument(
        "--session-affinity",
        action="store_true",
        help="keep a client's x-session-id on the worker that served it last, while that "
        "worker is routable and not busy (placement reason 'affinity')",
    )
    a.add_argument(
        "--session-ttl-s",
        type=float,
        default=600.0,
        metavar="S",
        help="how long a session stays pinned after its last request (default 600)",
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
    n = p.add_argument_group("gateway replicas (docs/replicas.md)")
    n.add_argument(
        "--nats",
        metavar="URL",
        help="nats://HOST:PORT: share placements and in-flight load with the other gateway "
        "replicas on this NATS server, so replicas behind one balancer place like one gateway "
        "(the 'nats' extra; default: alone)",
    )
    n.add_argument(
        "--nats-subject-prefix",
        metavar="PREFIX",
        help="subjects of this fleet's replicas (default: kvsidecar.<model name>)",
    )
    n.add_argument(
        "--nats-peer-timeout-s",
        type=float,
        default=3.0,
        help="a replica not heard from this long has its load dropped here (default 3)",
    )
    n.add_argument(
        "--nats-new-prompt-window-ms",
        type=float,
        default=50.0,
        metavar="MS",
        help="a prompt no worker holds yet, which another replica owns, waits until that "
        "replica's placements up to MS after its arrival are heard (6 x MS at most), so two "
        "sessions of it arriving that close through both replicas share one worker "
        "(0: never wait; default 50)",
    )
    n.add_argument(
        "--events-via",
        choices=["direct", "nats"],
        default="direct",
        help="nats: read the KV events from the model's JetStream stream (sidecars with "
        "--events-via nats), start from the newest index snapshot; the sidecars' streams "
        "carry status, resyncs, and the events while NATS is away (default: direct)",
    )
    n.add_argument(
        "--snapshot-interval-s",
        type=float,
        default=30.0,
        help="with --events-via nats: write the index to JetStream's object store this often, "
        "for gateways that start later (0: never; default 30)",
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
        help="longest silence from a worker before the request is abandoned (or, a stream "
        "with --migration-limit, continued elsewhere)",
    )
    s.add_argument(
        "--migration-limit",
        type=int,
        default=0,
        metavar="N",
        help="a stream whose worker dies mid-reply goes on on another worker, from the "
        "tokens the client already has, up to N times (0, the default: it is cut)",
    )
    s.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM the gateway stops accepting, reports draining, and gives the "
        "requests in flight this long to finish before it cuts them (default 30)",
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
    a = p.add_argument_group("security (docs/security.md)")
    a.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="client API keys, one 'KEY TENANT [rps=N] [tps=N]' or 'sha256:HEX TENANT ...' a "
        "line; re-read when it changes. A request without a listed key (Authorization: "
        "Bearer, or x-api-key) gets 401; each tenant's blocks live in its own cache "
        "namespace. Only /health and /metrics stay open",
    )
    a.add_argument(
        "--rate-limit-rps",
        type=float,
        metavar="N",
        help="requests per second per tenant (default: unlimited; the key file's rps= "
        "column overrides it); over it: 429 with retry-after",
    )
    a.add_argument(
        "--rate-limit-tps",
        type=float,
        metavar="N",
        help="tokens per second per tenant, counted at admission as prompt tokens + "
        "max_tokens (default: unlimited; tps= in the key file overrides it)",
    )
    a.add_argument(
        "--rate-limit-burst-s",
        type=float,
        default=1.0,
        metavar="S",
        help="a full bucket holds this many seconds of each rate: what an idle tenant may "
        "send at once (default 1)",
    )
    a.add_argument(
        "--tenant-salt-secret-file",
        metavar="FILE",
        help="a secret from which each tenant's cache salt is derived (HMAC); give every "
        "gateway of a fleet the same one (default: salts derive from tenant names alone)",
    )
    a.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate chain")
    a.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    a.add_argument(
        "--sidecar-token-file",
        metavar="FILE",
        help="the sidecars' control token (their --control-token-file), sent to them as "
        "x-kvsidecar-token on every call",
    )
    return p
