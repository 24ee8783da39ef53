"""The engine's typed configuration and its command line (flag names follow SGLang's): each
field of ``EngineConfig`` is one flag of ``kvsidecar engine`` (``kvcore.options``: default, help
and group written once), and ``--config FILE`` reads the same options from TOML.

What the flags describe in SGLang's words is derived, never a flag of its own: the KV events
publisher (``kv_events``, from ``--kv-events-config``'s JSON), the simulated timing
(``timing``, from ``--speedup`` and the ``--sim-*`` flags), the page store's extra config and
its backend (``memory`` when only ``--enable-hierarchical-cache`` is given)."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from kvcore.logs import LOG_LEVELS
from kvcore.options import OptionParser, check_bounds, member, option
from refengine.kv_events import KVEventsConfig
from refengine.presets import PRESETS
from refengine.timing import SIM_GROUP, SimModel, SimTiming, TimingModel
from refengine.tokenizer import DEFAULT_MODEL_PATH

__all__ = ["DEFAULT_POOL_BYTES", "Compute", "DisaggMode", "EngineConfig", "build_parser"]

DEFAULT_POOL_BYTES = 1 << 30  # default KV pool budget when --max-total-tokens is not given


class Compute(enum.Enum):
    TORCH = "torch"
    SIM = "sim"


class DisaggMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


# The page stores of refengine.host_tier.create_page_store.
PageStoreBackend = Literal["memory", "file", "dynamic"]

# The flags' groups in --help, in this order (a group appears where its first field is).
_SERVER = "server"
_MODEL = "model"
_CACHE = "KV cache"
_HOST = "host tier (HiCache storage interface)"
_PD = "disaggregation"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything ``kvsidecar engine`` needs; validated on construction. Each field is a flag,
    ``--`` and its name with dashes; ``sim`` holds the ``--sim-*`` flags (``SimTiming``'s)."""

    host: str = option("127.0.0.1", group=_SERVER, help="HTTP bind address")
    port: int = option(30000, group=_SERVER, ge=0, le=65535, default_text="30000",
                       help="HTTP port; 0 picks a free one")
    replicas: int = option(
        1, group=_SERVER, ge=1,
        help="serve N independent engines in this process (sim compute only), on "
        "ports port..port+N-1 (all ephemeral with --port 0)")
    ready_file: Path | None = option(
        None, group=_SERVER, metavar="FILE", help="write the ready line(s) (JSON) to this file too")
    log_level: str = option("info", group=_SERVER, choices=LOG_LEVELS,
                            help="the least severe log records written to stderr")
    api_key: str | None = option(  # never in a log line
        None, group=_SERVER, secret=True,
        help="as SGLang's: every route but /health*, /ready* and /metrics* then needs "
        "'Authorization: Bearer <key>' (401 otherwise)")

    model_path: Path = option(
        DEFAULT_MODEL_PATH, group=_MODEL, metavar="DIR",
        help="directory with tokenizer.json, tokenizer_config.json, config.json")
    model_preset: str | None = option(
        None, group=_MODEL, choices=tuple(PRESETS),
        help="override the directory's model sizes with a preset")
    served_model_name: str | None = option(
        None, group=_MODEL, help="model id reported by the API",
        default_text="the model directory's name")
    compute: Compute = option(
        Compute.TORCH, group=_MODEL, help="torch: run the model; sim: timing model only, no math")
    torch_threads: int | None = option(None, group=_MODEL, ge=1, help="torch intra-op threads")
    random_seed: int = option(0, group=_MODEL, help="seed for sampled decoding")

    page_size: int = option(16, group=_CACHE, ge=1, help="tokens per KV page")
    max_total_tokens: int | None = option(  # None: derived from the model (see with_model)
        None, group=_CACHE, help="KV pool size in tokens",
        default_text="32768, capped at 1 GiB of KV")
    chunked_prefill_size: int = option(
        512, group=_CACHE, ge=1, help="prompt tokens computed per prefill step")
    max_running_requests: int = option(64, group=_CACHE, ge=1, help="requests admitted at once")
    enable_mixed_chunk: bool = option(
        False, group=_CACHE,
        help="as SGLang's: mix prompt chunks into decode steps; a step then runs every "
        "decoding request and prompt chunks up to --chunked-prefill-size tokens in all "
        "(vLLM's and Dynamo's mocker's batched-token budget); without it prefill and "
        "decode steps alternate")
    share_in_flight_prefill: bool = option(
        False, group=_CACHE,
        help="a request whose next prompt pages another request is computing waits a step "
        "and reuses them from the cache, instead of computing them again (SGLang's "
        "in-batch prefix caching; vLLM and Dynamo's mocker share blocks in flight)")
    kv_events_config: str | None = option(  # SGLang's JSON, as given (kv_events: parsed)
        None, group=_CACHE, metavar="JSON",
        help='SGLang\'s JSON, e.g. {"publisher":"zmq","endpoint":"tcp://*:5557",'
        '"replay_endpoint":"tcp://*:5558","topic":"kv-events"}; port * or 0 binds '
        "an ephemeral port")

    enable_hierarchical_cache: bool = option(
        False, group=_HOST,
        help="write pages through to a page store (memory unless a backend is set)")
    hicache_storage_backend: PageStoreBackend | None = option(
        None, group=_HOST,
        help="page store: in-process dict, a directory, or a class named in the "
        "extra config (module_path, class_name, backend_name)")
    hicache_storage_backend_extra_config: str | None = option(
        None, group=_HOST, metavar="JSON", help="JSON passed to the backend")
    hicache_host_pages: int = option(256, group=_HOST, ge=1, help="pages in the host staging pool")
    hicache_write_policy: Literal["write_through"] = option(
        "write_through", group=_HOST, help="when pages reach the store (SGLang's flag; the "
        "one policy served)")

    disaggregation_mode: DisaggMode = option(
        DisaggMode.NULL, group=_PD,
        help="prefill: stop after the first token and export the prompt's pages; "
        "decode: import the prompt's pages from the page store")

    speedup: float = option(1.0, group=SIM_GROUP, gt=0, help="divide every simulated duration")
    sim_model: SimModel = option(
        SimModel.LINEAR, group=SIM_GROUP,
        help="linear: the --sim-* terms; mocker: Dynamo 1.6.1's mocker's polynomial (prefill "
        "by prompt tokens in the step, decode by the KV pool's occupancy; the --sim-* "
        "terms unused)")
    # --sim-prefill-base-ms and the other --sim-* flags (shared with replay: SimTiming's)
    sim: SimTiming = field(default_factory=SimTiming)

    def __post_init__(self) -> None:
        check_bounds(self)  # each option's range, declared with it; relations follow
        # frozen, but not yet shared: a plain string from code becomes its member
        object.__setattr__(self, "compute", member("--compute", self.compute, Compute))
        object.__setattr__(self, "disaggregation_mode", member(
            "--disaggregation-mode", self.disaggregation_mode, DisaggMode))
        object.__setattr__(self, "sim_model", member("--sim-model", self.sim_model, SimModel))
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"--max-total-tokens ({self.max_total_tokens}) must hold at least one page "
                f"(--page-size {self.page_size})"
            )
        if self.replicas > 1 and self.compute is Compute.TORCH:
            raise ValueError("--replicas > 1 needs --compute sim (one torch model per process)")
        if self.disaggregation_mode is not DisaggMode.NULL and not self.page_store:
            raise ValueError(
                "--disaggregation-mode prefill/decode moves pages through the page store: "
                "set --hicache-storage-backend (e.g. file with "
                "--hicache-storage-backend-extra-config '{\"file_path\": DIR}')"
            )
        _ = (self.kv_events, self.timing, self.hicache_extra_config)  # their checks, now
        if not (self.model_path / "tokenizer.json").exists():
            raise ValueError(f"--model-path {self.model_path} has no tokenizer.json")

    @property
    def kv_events(self) -> KVEventsConfig:
        """The KV events publisher, from ``--kv-events-config``."""
        return KVEventsConfig.from_cli(self.kv_events_config)

    @property
    def timing(self) -> TimingModel:
        """The simulated compute's durations, from ``--speedup``, ``--sim-model`` and the
        ``--sim-*`` flags."""
        return replace(self.sim.model(self.speedup), shape=self.sim_model)

    @property
    def page_store(self) -> PageStoreBackend | None:
        """The host tier's page store: the backend named, or ``memory`` when only
        ``--enable-hierarchical-cache`` is given; None: no host tier."""
        if self.hicache_storage_backend is None and self.enable_hierarchical_cache:
            return "memory"
        return self.hicache_storage_backend

    @property
    def hicache_extra_config(self) -> dict[str, Any]:
        """``--hicache-storage-backend-extra-config``'s JSON ({} without it)."""
        if not self.hicache_storage_backend_extra_config:
            return {}
        try:
            extra: Any = json.loads(self.hicache_storage_backend_extra_config)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--hicache-storage-backend-extra-config is not valid JSON: {exc}"
            ) from exc
        if not isinstance(extra, dict):
            raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
        return extra

    @property
    def num_pages(self) -> int:
        if self.max_total_tokens is None:
            raise RuntimeError("max_total_tokens is unresolved: call with_model() first")
        return self.max_total_tokens // self.page_size

    def with_model(self, kv_bytes_per_token: int) -> EngineConfig:
        """Resolve the default pool size: 32,768 tokens, or fewer if that would take more
        than ``DEFAULT_POOL_BYTES`` of KV (torch compute only; sim pools hold no bytes)."""
        if self.max_total_tokens is not None:
            return self
        tokens = 32768
        if self.compute is Compute.TORCH:
            tokens = min(tokens, DEFAULT_POOL_BYTES // kv_bytes_per_token)
        return replace(
            self, max_total_tokens=max(self.page_size, tokens // self.page_size * self.page_size)
        )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path.name

    @classmethod
    def from_args(cls, argv: Sequence[str] | None) -> EngineConfig:
        """From the command line (and ``--config FILE``); a bad flag or an invalid config is
        an argparse error (exit 2)."""
        parser = build_parser()
        args = parser.parse_args(argv)
        return parser.build(cls, args, sim=parser.build(SimTiming, args))


def build_parser() -> OptionParser:
    """The engine's flags: ``EngineConfig``'s fields."""
    p = OptionParser(
        prog="kvsidecar engine",
        description="The CPU reference engine: a small Llama-style model with a paged, "
        "prefix-cached KV cache, serving SGLang's HTTP API and publishing SGLang's KV events.",
    )
    p.add_options(EngineConfig)
    p.add_options(SimTiming)
    return p
