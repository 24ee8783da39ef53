"""The sidecar's one typed configuration, and its command line: each field of
``SidecarConfig`` made with ``option()`` is one flag of ``kvsidecar sidecar`` (``kvcore.options``:
help, group and default written once), and ``--config FILE`` reads the same options from TOML.

Two values are derived, never flags of their own: the worker id, when ``--worker-id`` is not
given, from ``--engine-url``; and the two secrets, read from the file their flag names or else
from the environment (``KVSIDECAR_ENGINE_API_KEY``, ``KVSIDECAR_CONTROL_TOKEN``), the only
variables the sidecar reads."""

from __future__ import annotations

import enum
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from adapters.base import EngineKind, EventEndpoint, LoraAdapter
from adapters.zmq_events.endpoints import is_zmq_address, rank_endpoints
from kvcore import nats_extra
from kvcore.control_token import CONTROL_TOKEN_ENV, CONTROL_TOKEN_HEADER, read_secret_file
from kvcore.jetstream import EventsVia
from kvcore.layout import LayoutKind
from kvcore.logs import LOG_LEVELS
from kvcore.options import OptionParser, check_bounds, member, option
from kvcore.stream import Role
from shm.owner.config import REMOTE_WRITES, parse_bytes
from sidecar.zmq_publisher import ZmqPublishConfig

__all__ = ["ENGINE_API_KEY_ENV", "HandoffKind", "SidecarConfig"]

ENGINE_API_KEY_ENV = "KVSIDECAR_ENGINE_API_KEY"


class HandoffKind(enum.StrEnum):
    """How a decode sidecar obtains the prompt's blocks (``--kv-handoff``)."""

    SHARED_STORE = "shared-store"
    TRANSFER = "transfer"


# The flags' groups in --help, in this order (a group appears where its first field is).
_ENGINE = "engine"
_SIDECAR = "sidecar"
_STORE = "host-tier block store (shared memory)"
_PD = "prefill/decode disaggregation"
_EVENTS = "durable events (docs/replicas.md)"


@dataclass(frozen=True, slots=True, kw_only=True)
class SidecarConfig:
    """Everything one sidecar process needs; validated when built. Each ``option`` field is a
    flag, ``--`` and its name with dashes unless it says otherwise."""

    engine: EngineKind = option(
        EngineKind.SGLANG, group=_ENGINE,
        help="engine kind; the reference engine speaks sglang")
    engine_url: str = option(required=True, group=_ENGINE, help="the engine's HTTP base URL")
    model_id: str | None = option(
        None, group=_ENGINE, help="served model name used in the hash namespace",
        default_text="the engine's served_model_name")
    model_path: str | None = option(
        None, group=_ENGINE, help="model directory (config.json) for the KV layout")
    block_size: int | None = option(  # None: discovered from the engine
        None, group=_ENGINE, ge=1, le=4096,
        help="tokens per KV block; checked against the engine's page size when both are known")
    kv_events_endpoint: str | None = option(
        None, group=_ENGINE,
        help="ZMQ endpoint of the engine's KV events (rank 0's, with --kv-events-ranks). "
        "TensorRT-LLM: a tcp://, ipc:// or inproc:// address subscribes to the events it "
        "pushes (1.4's kv_cache_config.kv_events_config); an http(s) URL, or none, polls "
        "its POST /kv_cache_events",
        default_text="SGLang's /server_info, vLLM's /kv_event_sources, TensorRT-LLM's "
        "--engine-url polled")
    kv_events_replay_endpoint: str | None = option(
        None, group=_ENGINE, help="ZMQ ROUTER endpoint for replay (rank 0's)")
    kv_events_ranks: int = option(
        1, group=_ENGINE, ge=1,
        help="DP ranks publishing KV events, each one canonical worker (<worker-id>/dp<r>); "
        "rank r's ZMQ endpoints are rank 0's with the TCP port plus r (ipc/inproc: "
        "suffix _dp<r>), as vLLM's and TensorRT-LLM's publishers bind them; a polled "
        "TensorRT-LLM answers for every rank at once. Needs --kv-events-endpoint")
    load_endpoint: str | None = option(  # the engine's scheduler load socket (SGLang)
        None, group=_ENGINE,
        help="ZMQ endpoint where the engine publishes its scheduler's load (SGLang's "
        "--load-publish-endpoint; default: from /server_info when it advertises one). "
        "Reported to gateways, which place by it beside their own in-flight count")
    lora_adapters: tuple[LoraAdapter, ...] = option(  # for engines that select adapters by id
        (), group=_ENGINE, flag="--lora-adapter", metavar="NAME=ID[:PATH]",
        parse=LoraAdapter.parse,
        help="a LoRA adapter the engine serves, by the name clients use ('<model>:NAME'), "
        "the engine's integer id and its checkpoint path; repeat per adapter. TensorRT-LLM "
        "needs it (its requests and events name adapters by id); SGLang selects by name")
    engine_api_key_file: str | None = option(
        None, group=_ENGINE, metavar="FILE",
        help="a file holding the engine's API key (its --api-key), sent to it as "
        f"'Authorization: Bearer'; or set {ENGINE_API_KEY_ENV}. Never logged")

    control_token_file: str | None = option(
        None, group=_SIDECAR, metavar="FILE",
        help="a shared token every caller of this sidecar must send as "
        f"'{CONTROL_TOKEN_HEADER}' (the gateway's --sidecar-token-file; peer sidecars "
        "send theirs): the event stream, block export/import, load, workers and request "
        f"routes; /health and /metrics stay open. Or set {CONTROL_TOKEN_ENV}. Never logged")
    worker_id: str = option(  # "": derived from --engine-url when built
        "", group=_SIDECAR, help="this worker's name in the fleet",
        default_text="<hostname>-<engine port>")
    role: Role = option("agg", group=_SIDECAR, help="the pool this worker serves")
    host: str = option("127.0.0.1", group=_SIDECAR, help="listen address")
    port: int = option(
        0, group=_SIDECAR, ge=0, le=65535,
        help="listen port; 0 picks a free one, printed in the ready line")
    replay_buffer_events: int = option(
        65536, group=_SIDECAR, ge=1, help="events kept for subscribers that reconnect")
    subscriber_queue_frames: int = option(
        8192, group=_SIDECAR, ge=1, help="frames a subscriber may lag before it is told to resync")
    load_report_interval_s: float = option(
        0.5, group=_SIDECAR, gt=0, help="seconds between load reports on the event stream")
    silent_after_s: float = option(
        30.0, group=_SIDECAR, gt=0,
        help="how long the engine may take to publish the KV events of blocks it "
        "stored: past it, a canary prompt re-checks, and with no event for that either "
        "the worker is unroutable (re-checked this often, routable at the first event)")
    upstream_timeout_s: float = option(
        600.0, group=_SIDECAR, gt=0, help="longest wait for an engine reply between bytes")
    shutdown_timeout_s: float = option(
        20.0, group=_SIDECAR, gt=0, help="how long SIGTERM waits for in-flight requests")
    log_level: str = option("info", group=_SIDECAR, choices=LOG_LEVELS,
                            help="the least severe log records written to stderr")
    ready_file: str | None = option(
        None, group=_SIDECAR, help="write {'url': ...} JSON here once serving")

    store_capacity_bytes: int = option(  # 0: no host-tier store
        0, group=_STORE, ge=0, parse=parse_bytes, metavar="SIZE",
        help="size of the shared-memory block store, e.g. 4GiB; 0: none")
    store_socket: str | None = option(
        None, group=_STORE, help="Unix socket engine hooks attach to",
        default_text="/tmp/kvsidecar-<worker-id>.sock")
    store_block_bytes: int | None = option(  # None: from the model's KV layout
        None, group=_STORE, ge=1, parse=parse_bytes, metavar="SIZE", help="bytes per stored block",
        default_text="from the model's KV layout")
    # The order of a block's bytes; None: the one the engine's storage hook writes (adapter).
    store_layout: LayoutKind | None = option(
        None, group=_STORE,
        help="order of a stored block's bytes: raw (the engine's own page order), "
        "layer_first or page_first",
        default_text="the one the engine's storage hook writes, from the engine: raw for the "
        "reference engine and TensorRT-LLM, SGLang's --hicache-mem-layout; raw with "
        "--store-block-bytes")
    disk_tier_dir: str | None = option(  # blocks evicted from the store (shm.tiers.disk_tier)
        None, group=_STORE, metavar="DIR", default_text="none",
        help="keep blocks evicted from the store in this local directory (the disk tier): "
        "engines' gets that miss in shared memory read them back, and the tier survives "
        "a restart, announced as 'disk' events")
    disk_tier_capacity_bytes: int = option(
        0, group=_STORE, ge=0, parse=parse_bytes, metavar="SIZE", default_text="none",
        help="byte budget of the disk tier, e.g. 64GiB (required with --disk-tier-dir)")
    # A Redis-protocol store shared by the model's replicas (shm.tiers.remote_tier), and when
    # blocks are written to it: "through" (each one committed) or "evict".
    remote_tier_url: str | None = option(  # may carry a password
        None, group=_STORE, metavar="URL", secret=True, default_text="none",
        help="a Redis-protocol store (Redis, Valkey) shared by every replica of the model "
        "(the remote tier), e.g. redis://kv-cache:6379/0: blocks are written to it, gets "
        "that miss in shared memory and on disk load from it, and what it holds is "
        "announced as 'remote' events, so the gateway credits it on every worker. Needs "
        "keyspace notifications (turned on with CONFIG SET when allowed; else set "
        "notify-keyspace-events K$gxe)")
    remote_tier_write: str = option(
        "through", group=_STORE, choices=REMOTE_WRITES,
        help="write every block the store commits to the remote tier (through: a prefix "
        "computed once is shared at once) or only those it evicts")
    transfer_tcp_port: int = option(  # the TCP block stream to peers
        0, group=_STORE, ge=0, le=65535,
        help="port of the TCP block stream peers pull from when NIXL is absent (0: any)")
    advertise_host: str | None = option(
        None, group=_STORE, help="the address peer sidecars reach this one at",
        default_text="--host")

    # Prefill/decode disaggregation (sidecar/disagg.py): how a decode worker gets the blocks,
    # and the prefill engine's SGLang bootstrap port (for the gateway's native PD mode).
    kv_handoff: HandoffKind = option(
        HandoffKind.SHARED_STORE, group=_PD,
        help="how a decode worker gets a request's KV from its prefill worker: "
        "shared-store = the engines' storage hooks share one page store; "
        "transfer = pull the blocks from the prefill sidecar's store into this one "
        "(shm on one host, NIXL or TCP across hosts; engines hooked to their sidecar)")
    disaggregation_bootstrap_port: int | None = option(
        None, group=_PD, ge=1, le=65535,
        help="the prefill engine's SGLang bootstrap port (gateway --pd-mode sglang)")
    sim_handoff_ms_per_1k_tokens: float = option(  # simulated engines: the transport's time
        0.0, group=_PD, ge=0, metavar="MS",
        help="for simulated engines (pages without bytes): make each KV handoff take this "
        "long per 1,000 prompt tokens, as a transport of that speed would")

    # Durable events (sidecar/jetstream_publisher.py): also publish to NATS JetStream.
    events_via: EventsVia = option(
        EventsVia.DIRECT, group=_EVENTS,
        help="nats: also publish the event stream to the model's NATS JetStream stream, "
        "where gateways with --events-via nats read it and restart warm; the HTTP stream "
        "keeps working (the 'nats' extra; direct: only that)")
    nats_url: str | None = option(  # may carry a password
        None, group=_EVENTS, flag="--nats", metavar="URL", secret=True,
        help="nats://HOST:PORT (with --events-via nats)")
    events_max_age_s: float = option(
        3600.0, group=_EVENTS, gt=0,
        help="the stream keeps events this long, when this sidecar creates it")
    events_max_bytes: int = option(
        1 << 30, group=_EVENTS, ge=1 << 20, parse=parse_bytes, metavar="SIZE", default_text="1GiB",
        help="and at most this much of them, oldest dropped first")

    # The events republished in vLLM's ZMQ wire format: its own options (sidecar/zmq_publisher.py).
    zmq_publish: ZmqPublishConfig = field(default_factory=ZmqPublishConfig)
    # Derived, not flags: read from the --*-file flags' files or the environment (from_args).
    # Sent to the engine as "Authorization: Bearer" (its --api-key); never in a log or a repr.
    engine_api_key: str | None = field(default=None, repr=False)
    # Required of every caller but /health and /metrics (x-kvsidecar-token); sent to peers.
    control_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_bounds(self)  # each option's range, declared with it; relations follow
        # frozen, but not yet shared: plain strings from code become their members, the URL
        # loses its trailing slash, and a worker id not given is derived from it
        for name, vocabulary in (("engine", EngineKind), ("kv_handoff", HandoffKind),
                                 ("events_via", EventsVia)):
            flag = "--" + name.replace("_", "-")
            object.__setattr__(self, name, member(flag, getattr(self, name), vocabulary))
        scheme = urlsplit(self.engine_url).scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"--engine-url must be an http(s) URL, got {self.engine_url!r}")
        object.__setattr__(self, "engine_url", self.engine_url.rstrip("/"))
        if not self.worker_id:
            object.__setattr__(self, "worker_id", _default_worker_id(self.engine_url))
        if self.role not in ("agg", "prefill", "decode"):
            raise ValueError(f"--role must be agg, prefill or decode, got {self.role!r}")
        self._check_event_ranks()
        if self.load_endpoint is not None and self.engine is not EngineKind.SGLANG:
            raise ValueError("--load-endpoint is SGLang's load socket; --engine is not sglang")
        LoraAdapter.check_unique(self.lora_adapters)
        self._check_tiers()
        self._check_handoff()
        self._check_events_via()

    def _check_event_ranks(self) -> None:
        if self.kv_events_ranks > 1 and not self.kv_events_endpoint:
            raise ValueError("--kv-events-ranks > 1 needs --kv-events-endpoint (rank 0's)")
        self.event_endpoints()  # every rank's address exists (a port past 65535 does not)

    def event_endpoints(self) -> tuple[EventEndpoint, ...]:
        """Every rank's KV event endpoints from the flags (none: the adapter discovers)."""
        endpoint = self.kv_events_endpoint
        if not endpoint:
            return ()
        if is_zmq_address(endpoint):
            return rank_endpoints(endpoint, self.kv_events_replay_endpoint, self.kv_events_ranks)
        # an engine's URL (TensorRT-LLM's poll): one answer holds every rank's events
        return tuple(EventEndpoint(r, endpoint, self.kv_events_replay_endpoint)
                     for r in range(self.kv_events_ranks))

    def _check_tiers(self) -> None:
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
        if self.remote_tier_write not in REMOTE_WRITES:
            raise ValueError(f"--remote-tier-write must be through or evict, got "
                             f"{self.remote_tier_write!r}")

    def _check_handoff(self) -> None:
        if self.kv_handoff is HandoffKind.TRANSFER and not self.store_capacity_bytes:
            raise ValueError(
                "--kv-handoff transfer pulls blocks into this sidecar's block store: "
                "set --store-capacity-bytes (and point the engine's storage hook at its socket)"
            )

    def _check_events_via(self) -> None:
        if (self.events_via is EventsVia.NATS) != (self.nats_url is not None):
            raise ValueError("--events-via nats and --nats URL go together")
        if self.nats_url is not None:
            nats_extra.check_url(self.nats_url)

    @classmethod
    def parser(cls) -> OptionParser:
        """The sidecar's flags: this class's options."""
        p = OptionParser(
            prog="kvsidecar sidecar",
            description="Run beside one engine replica: relay its KV cache events to gateways "
            "as one resumable stream, proxy requests to it with load accounting, and report "
            "its health. Needs only the engine's URL; event endpoints and block size are "
            "discovered from the engine when it advertises them.",
        )
        p.add_options(cls)
        p.add_options(ZmqPublishConfig)
        return p

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> SidecarConfig:
        """From the command line (and ``--config FILE``), the secrets from their files or
        ``environ``; a bad flag or an invalid config is an argparse error (exit 2)."""
        parser = cls.parser()
        args = parser.parse_args(argv)
        env = os.environ if environ is None else environ
        try:
            api_key = _engine_api_key(args.engine_api_key_file, env)
            control_token = (
                env.get(CONTROL_TOKEN_ENV) or None if args.control_token_file is None
                else read_secret_file(args.control_token_file, "--control-token-file")
            )
        except ValueError as exc:
            parser.error(str(exc))
        return parser.build(cls, args, engine_api_key=api_key, control_token=control_token,
                            zmq_publish=parser.build(ZmqPublishConfig, args))


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
