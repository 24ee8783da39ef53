"""The sidecar's one typed configuration, built only from the command line (and, for the
engine's API key and the control token alone, the environment variables
``KVSIDECAR_ENGINE_API_KEY`` and ``KVSIDECAR_CONTROL_TOKEN``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from adapters.base import LoraAdapter
from kvcore.control_token import CONTROL_TOKEN_ENV, CONTROL_TOKEN_HEADER, read_secret_file
from kvcore.layout import LayoutKind
from kvcore.options import OptionParser
from shm.config import parse_bytes
from sidecar.zmq_publisher import ZmqPublishConfig

__all__ = ["ENGINE_API_KEY_ENV", "SidecarConfig"]

ENGINE_API_KEY_ENV = "KVSIDECAR_ENGINE_API_KEY"
ENGINES = ("sglang", "trtllm", "vllm")  # the adapters' EngineKind values

Role = Literal["agg", "prefill", "decode"]


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Everything one sidecar process needs; validated when built."""

    engine: str
    engine_url: str
    worker_id: str
    model_id: str | None = None  # None: the engine's served model name
    model_path: str | None = None
    block_size: int | None = None  # None: discovered from the engine
    host: str = "127.0.0.1"
    port: int = 0
    role: Role = "agg"
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    load_endpoint: str | None = None  # the engine's scheduler load socket (SGLang)
    replay_buffer_events: int = 65536
    subscriber_queue_frames: int = 8192
    load_report_interval_s: float = 0.5
    silent_after_s: float = 30.0
    upstream_timeout_s: float = 600.0
    shutdown_timeout_s: float = 20.0
    log_level: str = "info"
    ready_file: str | None = None
    store_capacity_bytes: int = 0  # 0: no host-tier store
    store_socket: str | None = None
    store_block_bytes: int | None = None  # None: from the model's KV layout
    # The order of a block's bytes; None: the one the engine's storage hook writes (adapter).
    store_layout: LayoutKind | None = None
    disk_tier_dir: str | None = None  # blocks evicted from the store kept here (shm.disk_tier)
    disk_tier_capacity_bytes: int = 0
    # A Redis-protocol store shared by the model's replicas (shm.remote_tier), and when
    # blocks are written to it: "through" (each one committed) or "evict".
    remote_tier_url: str | None = field(default=None, repr=False)  # may carry a password
    remote_tier_write: str = "through"
    transfer_tcp_port: int = 0  # the TCP block stream to peers (0: any free port)
    advertise_host: str | None = None  # the address peer sidecars dial (default: --host)
    # Prefill/decode disaggregation (sidecar/disagg.py): how a decode worker gets the blocks,
    # and the prefill engine's SGLang bootstrap port (for the gateway's native PD mode).
    kv_handoff: str = "shared-store"
    disaggregation_bootstrap_port: int | None = None
    sim_handoff_ms_per_1k_tokens: float = 0.0  # simulated engines: the transport's duration
    # Sent to the engine as "Authorization: Bearer" (its --api-key); never in a log or a repr.
    engine_api_key: str | None = field(default=None, repr=False)
    # Required of every caller but /health and /metrics (x-kvsidecar-token); sent to peers.
    control_token: str | None = field(default=None, repr=False)
    lora_adapters: tuple[LoraAdapter, ...] = ()  # for engines that select adapters by id
    # Durable events (sidecar/jetstream_publisher.py): also publish to NATS JetStream.
    events_via: Literal["direct", "nats"] = "direct"
    nats_url: str | None = field(default=None, repr=False)  # may carry a password
    events_max_age_s: float = 3600.0
    events_max_bytes: int = 1 << 30
    # The events republished in vLLM's ZMQ wire format (sidecar/zmq_publisher.py).
    zmq_publish: ZmqPublishConfig = field(default_factory=ZmqPublishConfig)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be sglang, trtllm or vllm, got {self.engine!r}")
        scheme = urlsplit(self.engine_url).scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"--engine-url must be an http(s) URL, got {self.engine_url!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.role not in ("agg", "prefill", "decode"):
            raise ValueError(f"--role must be agg, prefill or decode, got {self.role!r}")
        for name in (
            "replay_buffer_events",
            "subscriber_queue_frames",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in (
            "load_report_interval_s",
            "silent_after_s",
            "upstream_timeout_s",
            "shutdown_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.store_capacity_bytes < 0:
            raise ValueError("--store-capacity-bytes must be >= 0")
        if self.store_block_bytes is not None and self.store_block_bytes < 1:
            raise ValueError("--store-block-bytes must be >= 1")
        if self.disk_tier_dir is not None and not self.store_capacity_bytes:
            raise ValueError("--disk-tier-dir keeps blocks evicted from the host-tier store: "
                             "set --store-capacity-bytes too")
        if (self.disk_tier_dir is None) != (not self.disk_tier_capacity_bytes):
            raise ValueError("--disk-tier-dir and --disk-tier-capacity-bytes go together")
        if self.remote_tier_url is not None and not self.store_capacity_bytes:
            raise ValueError("--remote-tier-url shares the host-tier store's blocks: set "
                             "--store-capacity-bytes too")
        if self.remote_tier_url is not None and not self.remote_tier_url.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError("--remote-tier-url must be a redis://, rediss:// or unix:// URL")
        if self.remote_tier_write not in ("through", "evict"):
            raise ValueError(f"--remote-tier-write must be through or evict, got "
                             f"{self.remote_tier_write!r}")
        LoraAdapter.check_unique(self.lora_adapters)
        self._check_events_via()
        if self.load_endpoint is not None and self.engine != "sglang":
            raise ValueError("--load-endpoint is SGLang's load socket; --engine is not sglang")
        if self.block_size is not None and not 1 <= self.block_size <= 4096:
            raise ValueError(f"--block-size must be in [1, 4096], got {self.block_size}")
        if not 0 <= self.sim_handoff_ms_per_1k_tokens < float("inf"):
            raise ValueError("--sim-handoff-ms-per-1k-tokens must be a finite number >= 0")
        if self.kv_handoff not in ("shared-store", "transfer"):
            raise ValueError(
                f"--kv-handoff must be shared-store or transfer, got {self.kv_handoff!r}"
            )
        if self.kv_handoff == "transfer" and not self.store_capacity_bytes:
            raise ValueError(
                "--kv-handoff transfer pulls blocks into this sidecar's block store: "
                "set --store-capacity-bytes (and point the engine's storage hook at its socket)"
            )

    def _check_events_via(self) -> None:
        if self.events_via not in ("direct", "nats"):
            raise ValueError(f"--events-via must be direct or nats, got {self.events_via!r}")
        if (self.events_via == "nats") != (self.nats_url is not None):
            raise ValueError("--events-via nats and --nats URL go together")
        if self.nats_url is not None and urlsplit(self.nats_url.split(",")[0]).scheme not in (
                "nats", "tls"):
            raise ValueError(f"--nats must be nats://HOST:PORT (or tls://), got {self.nats_url!r}")
        if not 0 < self.events_max_age_s < float("inf") or self.events_max_bytes < 1 << 20:
            raise ValueError("--events-max-age-s must be > 0 and --events-max-bytes >= 1MiB")

    @classmethod
    def parser(cls) -> OptionParser:
        p = OptionParser(
            prog="kvsidecar sidecar",
            description="Run beside one engine replica: relay its KV cache events to gateways "
            "as one resumable stream, proxy requests to it with load accounting, and report "
            "its health. Needs only the engine's URL; event endpoints and block size are "
            "discovered from the engine when it advertises them.",
        )
        g = p.add_argument_group("engine")
        g.add_argument(
            "--engine",
            choices=list(ENGINES),
            default="sglang",
            help="engine kind (default: sglang; the reference engine speaks sglang)",
        )
        g.add_argument("--engine-url", required=True, help="the engine's HTTP base URL")
        g.add_argument(
            "--model-id",
            help="served model name used in the hash namespace "
            "(default: the engine's served_model_name)",
        )
        g.add_argument("--model-path", help="model directory (config.json) for the KV layout")
        g.add_argument(
            "--block-size",
            type=int,
            help="tokens per KV block; checked against the engine's page size when both are known",
        )
        g.add_argument(
            "--kv-events-endpoint",
            help="ZMQ endpoint of the engine's KV events (default: SGLang's /server_info, "
            "vLLM's /kv_event_sources)",
        )
        g.add_argument("--kv-events-replay-endpoint", help="ZMQ ROUTER endpoint for replay")
        g.add_argument(
            "--load-endpoint",
            help="ZMQ endpoint where the engine publishes its scheduler's load (SGLang's "
            "--load-publish-endpoint; default: from /server_info when it advertises one). "
            "Reported to gateways, which place by it beside their own in-flight count",
        )
        g.add_argument(
            "--lora-adapter",
            action="append",
            default=[],
            metavar="NAME=ID[:PATH]",
            help="a LoRA adapter the engine serves, by the name clients use ('<model>:NAME'), "
            "the engine's integer id and its checkpoint path; repeat per adapter. TensorRT-LLM "
            "needs it (its requests and events name adapters by id); SGLang selects by name",
        )
        g.add_argument(
            "--engine-api-key-file",
            metavar="FILE",
            help="a file holding the engine's API key (its --api-key), sent to it as "
            f"'Authorization: Bearer'; or set {ENGINE_API_KEY_ENV}. Never logged",
        )
        s = p.add_argument_group("sidecar")
        s.add_argument(
            "--control-token-file",
            metavar="FILE",
            help="a shared token every caller of this sidecar must send as "
            f"'{CONTROL_TOKEN_HEADER}' (the gateway's --sidecar-token-file; peer sidecars "
            "send theirs): the event stream, block export/import, load, workers and request "
            f"routes; /health and /metrics stay open. Or set {CONTROL_TOKEN_ENV}. Never logged",
        )
        s.add_argument(
            "--worker-id",
            help="this worker's name in the fleet (default: <hostname>-<engine port>)",
        )
        s.add_argument(
            "--role",
            choices=["agg", "prefill", "decode"],
            default="agg",
            help="the pool this worker serves (default: agg)",
        )
        s.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
        s.add_argument(
            "--port",
            type=int,
            default=0,
            help="listen port; 0 picks a free one (printed in the ready line)",
        )
        s.add_argument(
            "--replay-buffer-events",
            type=int,
            default=65536,
            help="events kept for subscribers that reconnect (default 65536)",
        )
        s.add_argument(
            "--subscriber-queue-frames",
            type=int,
            default=8192,
            help="frames a subscriber may lag before it is told to resync",
        )
        s.add_argument(
            "--load-report-interval-s",
            type=float,
            default=0.5,
            help="seconds between load reports on the event stream",
        )
        s.add_argument(
            "--silent-after-s",
            type=float,
            default=30.0,
            help="how long the engine may take to publish the KV events of blocks it "
            "stored: past it, a canary prompt re-checks, and with no event for that either "
            "the worker is unroutable (re-checked this often, routable at the first event) "
            "(default 30)",
        )
        s.add_argument(
            "--upstream-timeout-s",
            type=float,
            default=600.0,
            help="longest wait for an engine reply between bytes",
        )
        s.add_argument(
            "--shutdown-timeout-s",
            type=float,
            default=20.0,
            help="how long SIGTERM waits for in-flight requests (default 20)",
        )
        t = p.add_argument_group("host-tier block store (shared memory)")
        t.add_argument(
            "--store-capacity-bytes",
            type=parse_bytes,
            default=0,
            help="size of the shared-memory block store, e.g. 4GiB (default 0: none)",
        )
        t.add_argument(
            "--store-socket",
            help="Unix socket engine hooks attach to (default: /tmp/kvsidecar-<worker-id>.sock)",
        )
        t.add_argument(
            "--store-block-bytes",
            type=parse_bytes,
            help="bytes per stored block (default: from the model's KV layout)",
        )
        t.add_argument(
            "--store-layout",
            type=LayoutKind,
            choices=list(LayoutKind),
            metavar="{" + ",".join(k.value for k in LayoutKind) + "}",
            help="order of a stored block's bytes: raw (the engine's own page order), "
            "layer_first or page_first (default: the one the engine's storage hook writes, "
            "from the engine: raw for the reference engine and TensorRT-LLM, SGLang's "
            "--hicache-mem-layout; raw with --store-block-bytes)",
        )
        t.add_argument(
            "--disk-tier-dir",
            metavar="DIR",
            help="keep blocks evicted from the store in this local directory (the disk tier): "
            "engines' gets that miss in shared memory read them back, and the tier survives "
            "a restart, announced as 'disk' events (default: none)",
        )
        t.add_argument(
            "--disk-tier-capacity-bytes",
            type=parse_bytes,
            default=0,
            metavar="SIZE",
            help="byte budget of the disk tier, e.g. 64GiB (required with --disk-tier-dir)",
        )
        t.add_argument(
            "--remote-tier-url",
            metavar="URL",
            help="a Redis-protocol store (Redis, Valkey) shared by every replica of the model "
            "(the remote tier), e.g. redis://kv-cache:6379/0: blocks are written to it, gets "
            "that miss in shared memory and on disk load from it, and what it holds is "
            "announced as 'remote' events, so the gateway credits it on every worker. Needs "
            "keyspace notifications (turned on with CONFIG SET when allowed; else set "
            "notify-keyspace-events K$gxe). Default: none",
        )
        t.add_argument(
            "--remote-tier-write",
            choices=("through", "evict"),
            default="through",
            help="write every block the store commits to the remote tier (through, default: "
            "a prefix computed once is shared at once) or only those it evicts",
        )
        t.add_argument(
            "--transfer-tcp-port",
            type=int,
            default=0,
            help="port of the TCP block stream peers pull from when NIXL is absent (0: any)",
        )
        t.add_argument(
            "--advertise-host",
            help="the address peer sidecars reach this one at (default: --host)",
        )
        d = p.add_argument_group("prefill/decode disaggregation")
        d.add_argument(
            "--kv-handoff",
            choices=["shared-store", "transfer"],
            default="shared-store",
            help="how a decode worker gets a request's KV from its prefill worker: "
            "shared-store = the engines' storage hooks share one page store (default); "
            "transfer = pull the blocks from the prefill sidecar's store into this one "
            "(shm on one host, NIXL or TCP across hosts; engines hooked to their sidecar)",
        )
        d.add_argument(
            "--disaggregation-bootstrap-port",
            type=int,
            help="the prefill engine's SGLang bootstrap port (gateway --pd-mode sglang)",
        )
        d.add_argument(
            "--sim-handoff-ms-per-1k-tokens",
            type=float,
            default=0.0,
            metavar="MS",
            help="for simulated engines (pages without bytes): make each KV handoff take this "
            "long per 1,000 prompt tokens, as a transport of that speed would (default 0)",
        )
        n = p.add_argument_group("durable events (docs/replicas.md)")
        n.add_argument(
            "--events-via",
            choices=["direct", "nats"],
            default="direct",
            help="nats: also publish the event stream to the model's NATS JetStream stream, "
            "where gateways with --events-via nats read it and restart warm; the HTTP stream "
            "keeps working (the 'nats' extra; default: direct only)",
        )
        n.add_argument("--nats", metavar="URL", help="nats://HOST:PORT (with --events-via nats)")
        n.add_argument(
            "--events-max-age-s",
            type=float,
            default=3600.0,
            help="the stream keeps events this long (default 3600), when this sidecar creates it",
        )
        n.add_argument(
            "--events-max-bytes",
            type=parse_bytes,
            default=1 << 30,
            help="and at most this much of them, oldest dropped first (default 1GiB)",
        )
        p.add_options(ZmqPublishConfig)
        s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
        s.add_argument("--ready-file", help="write {'url': ...} JSON here once serving")
        return p

    @classmethod
    def from_args(
        cls, argv: list[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> SidecarConfig:
        parser = cls.parser()
        args = parser.parse_args(argv)
        worker_id = args.worker_id or _default_worker_id(args.engine_url)
        env = os.environ if environ is None else environ
        try:
            api_key = _engine_api_key(args.engine_api_key_file, env)
            control_token = (
                env.get(CONTROL_TOKEN_ENV) or None if args.control_token_file is None
                else read_secret_file(args.control_token_file, "--control-token-file")
            )
            loras = tuple(LoraAdapter.parse(spec) for spec in args.lora_adapter)
            return cls(
                engine=args.engine,
                engine_url=args.engine_url.rstrip("/"),
                worker_id=worker_id,
                model_id=args.model_id,
                model_path=args.model_path,
                block_size=args.block_size,
                host=args.host,
                port=args.port,
                role=args.role,
                kv_events_endpoint=args.kv_events_endpoint,
                kv_events_replay_endpoint=args.kv_events_replay_endpoint,
                load_endpoint=args.load_endpoint,
                replay_buffer_events=args.replay_buffer_events,
                subscriber_queue_frames=args.subscriber_queue_frames,
                load_report_interval_s=args.load_report_interval_s,
                silent_after_s=args.silent_after_s,
                upstream_timeout_s=args.upstream_timeout_s,
                shutdown_timeout_s=args.shutdown_timeout_s,
                log_level=args.log_level,
                ready_file=args.ready_file,
                store_capacity_bytes=args.store_capacity_bytes,
                store_socket=args.store_socket,
                store_block_bytes=args.store_block_bytes,
                store_layout=args.store_layout,
                disk_tier_dir=args.disk_tier_dir,
                disk_tier_capacity_bytes=args.disk_tier_capacity_bytes,
                remote_tier_url=args.remote_tier_url,
                remote_tier_write=args.remote_tier_write,
                transfer_tcp_port=args.transfer_tcp_port,
                advertise_host=args.advertise_host,
                kv_handoff=args.kv_handoff,
                disaggregation_bootstrap_port=args.disaggregation_bootstrap_port,
                sim_handoff_ms_per_1k_tokens=args.sim_handoff_ms_per_1k_tokens,
                engine_api_key=api_key,
                control_token=control_token,
                lora_adapters=loras,
                events_via=args.events_via,
                nats_url=args.nats,
                events_max_age_s=args.events_max_age_s,
                events_max_bytes=args.events_max_bytes,
                zmq_publish=parser.build(ZmqPublishConfig, args),
            )
        except ValueError as exc:
            parser.error(str(exc))


def _engine_api_key(path: str | None, env: Mapping[str, str]) -> str | None:
    """The engine's key: from ``path`` (first line), else the environment, else none."""
    if path is None:
        return env.get(ENGINE_API_KEY_ENV) or None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--engine-api-key-file {path}: {exc.strerror}") from exc
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise ValueError(f"--engine-api-key-file {path} is empty")
    return key


def _default_worker_id(engine_url: str) -> str:
    parts = urlsplit(engine_url)
    return f"{socket.gethostname()}-{parts.port or parts.hostname or 'engine'}"
