"""What a ``LocalStack`` runs (``kvsidecar.local_stack``): engines by role, the gateways in
front of them, and NATS / Redis when asked for; plain values, validated on construction."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvcore.stream import Role
from kvsidecar.local_vllm import VllmOptions
from routing.config import FailurePolicy, PdMode, RouterMode

__all__ = [
    "DEFAULT_MODEL",
    "EVENTS_CONFIG",
    "EngineSpec",
    "ExternalPublisher",
    "GatewaySpec",
    "K8sDiscovery",
    "StackSpec",
]

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "refengine" / "models" / "tiny"
EVENTS_CONFIG = json.dumps(
    {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv-events",
    }
)


@dataclass(frozen=True)
class ExternalPublisher:
    """An engine's publishers outside the stack, which its sidecar subscribes to instead of
    what its engine announces: SGLang's own ``ZmqEventPublisher`` (``events``, ``replay``)
    or ``SchedulerLoadPublisher`` (``load``) run by a test, TensorRT-LLM's ranks. The engine
    still answers the sidecar's HTTP side (and publishes its own events, unheard)."""

    events: str | None = None  # the sidecar's --kv-events-endpoint
    replay: str | None = None  # --kv-events-replay-endpoint
    load: str | None = None  # --load-endpoint (SGLang's load publisher)

    def __post_init__(self) -> None:
        if self.replay is not None and self.events is None:
            raise ValueError("a replay endpoint replays an events endpoint: give both")


@dataclass(frozen=True)
class EngineSpec:
    """The engines of one role.

    ``kind="refengine"``: the CPU reference engine, given the stack's flags (model, KV pool,
    KV events, the handoff of a P/D role), then ``args``; ``compute="sim"`` serves all
    ``replicas`` from one process, ``"torch"`` runs one process each. Any other ``kind`` is
    a module run as ``python -m <kind> *args``, one process per replica (a stand-in engine
    of the tests), which must write a ready file like ours. ``kind="vllm"``: real vLLM
    servers with the options ``vllm`` (``kvsidecar.local_vllm``), started side by side, each
    sidecar given ``--engine vllm`` (and, with the vLLM KV connector, the block store it
    attaches to).

    How a prefill/decode role's reference engines hand their KV over (``handoff``):
    ``"file"``, through a page store directory of the work dir (``page_store``) that the
    P/D engines naming it share; ``"sidecar"``, each engine's HiCache hook is its own
    sidecar's block store and decode sidecars pull the blocks (``--kv-handoff transfer``);
    ``"none"``, the engine runs aggregated and only its sidecar declares the role (SGLang's
    native P/D mode, where the engines would move the KV themselves).

    A block store beside each replica (``store``, the KV-tier tests): ``"sidecar"``, its
    sidecar owns one at a socket of the work dir (``LocalStack.store_sockets``);
    ``"hook"``, and the reference engine's HiCache hook writes its pages through to it, as
    ``handoff="sidecar"`` does for a P/D role. ``sidecar_args`` size it (a later flag wins).
    """

    replicas: int = 1
    role: Role = "agg"
    compute: Literal["sim", "torch"] = "sim"
    kind: str = "refengine"
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # for the engines and their sidecars
    sidecars: bool = True  # a sidecar beside each replica
    sidecar_args: tuple[str, ...] = ()  # for these replicas' sidecars, after the stack's
    worker_ids: tuple[str, ...] = ()  # one per replica; none: replica-<i> or <role>-<i>
    vllm: VllmOptions | None = None  # kind="vllm": the servers' options
    handoff: Literal["file", "sidecar", "none"] = "file"  # a P/D role's; see above
    page_store: str = "pd-pages"  # handoff="file": the shared directory's name
    store: Literal["none", "sidecar", "hook"] = "none"  # see above
    publisher: ExternalPublisher | None = None  # what its sidecar hears instead; see there

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.publisher is not None and (self.replicas != 1 or not self.sidecars):
            raise ValueError("a publisher outside the stack feeds one sidecar: one replica "
                             f"with its sidecar, got replicas={self.replicas}, "
                             f"sidecars={self.sidecars}")
        if self.hooked and self.compute == "sim" and self.replicas > 1:
            raise ValueError("an engine hooked to its sidecar's store (store='hook', or "
                             "handoff='sidecar' in a P/D role) needs a store socket per engine "
                             "process: one replica per simulated engine spec")
        if self.store == "hook" and self.kind != "refengine":
            raise ValueError("store='hook' loads the reference engine's HiCache hook: "
                             f"kind={self.kind!r} has none")
        if (self.kind == "vllm") != (self.vllm is not None):
            raise ValueError("kind='vllm' and its vllm options go together")
        if self.worker_ids and len(self.worker_ids) != self.replicas:
            raise ValueError(f"worker_ids names {len(self.worker_ids)} workers for "
                             f"{self.replicas} replicas")

    @property
    def hooked(self) -> bool:
        """Whether each engine's HiCache hook writes through to its sidecar's block store."""
        return self.store == "hook" or (self.role != "agg" and self.handoff == "sidecar")


@dataclass(frozen=True)
class K8sDiscovery:
    """A gateway's sidecars found as Kubernetes pods (``--discover-k8s-*``): those that
    ``selector`` picks in ``namespace``. The API server is ``api_url``, or (None) found as
    from inside a pod, through KUBERNETES_SERVICE_HOST/PORT (``GatewaySpec.env``); its
    certificate checked against ``ca_file``, the bearer token read from ``token_file``."""

    selector: str
    namespace: str
    api_url: str | None = None
    ca_file: str | None = None
    token_file: str | None = None


@dataclass(frozen=True)
class GatewaySpec:
    """``count`` gateways alike (named ``name``, then ``name-1``...), in front of every
    sidecar (``workers="sidecars"``), every engine as a plain worker (``"engines"``), the
    sidecars Kubernetes lists (``"k8s"``, with ``k8s``), or only what ``args`` names
    (``"none"``)."""

    name: str = "gateway"
    count: int = 1
    host: str = "127.0.0.1"
    port: int = 0  # the first one's; the others bind any
    router_mode: str = RouterMode.KV.value
    pd_mode: str = PdMode.AUTO.value
    kv_load_failure_policy: str = FailurePolicy.FALLBACK.value
    health_check_interval_s: float | None = 1.0  # None: the gateway's own default
    seed: int | None = None  # gateway i gets seed + i
    workers: Literal["sidecars", "engines", "k8s", "none"] = "sidecars"
    only: tuple[str, ...] = ()  # workers="sidecars": these worker ids' alone; none: all
    k8s: K8sDiscovery | None = None  # workers="k8s": where the pods are
    model_path: str | None = None  # its tokenizer and template; None: the stack's
    env: Mapping[str, str] = field(default_factory=dict)  # on top of the stack's
    nats: bool = True  # where the stack runs NATS: join it (--nats)
    args: tuple[str, ...] = ()  # after the stack's own, so they win
    wait_routable: bool = True  # start() returns once every worker is routable through it

    def __post_init__(self) -> None:
        if (self.workers == "k8s") != (self.k8s is not None):
            raise ValueError("workers='k8s' and its k8s discovery go together")


@dataclass(frozen=True)
class StackSpec:
    """What runs: engines, their sidecars, gateways, and NATS / Redis when asked for."""

    engines: tuple[EngineSpec, ...] = (EngineSpec(),)
    gateways: tuple[GatewaySpec, ...] = (GatewaySpec(),)
    model_path: str = str(DEFAULT_MODEL)
    max_total_tokens: int | None = None  # None: the engine's default pool
    speedup: float | None = None  # sim compute; None: the engine's default
    events_config: str = EVENTS_CONFIG
    handoff_ms_per_1k_tokens: float = 0.0
    sidecar_args: tuple[str, ...] = ()  # for every sidecar, after the stack's own
    log_level: str | None = None  # for every engine, sidecar and gateway of ours
    env: Mapping[str, str] = field(default_factory=dict)  # for each of them; an engine's on top
    nats: bool = False  # a nats-server (JetStream); every gateway gets --nats
    nats_events: bool = False  # with nats: sidecars also publish their events there
    redis: bool = False  # a redis-server; every sidecar gets --remote-tier-url
    redis_maxmemory: str | None = None

    def __post_init__(self) -> None:
        if self.nats_events and not self.nats:
            raise ValueError("nats_events needs nats: the sidecars publish to its JetStream")
