"""``kvsidecar replay``'s options: each field of ``ReplayConfig`` is one flag (``kvcore.options``:
default, help and group written once), ``--config FILE`` reads them from TOML, and the trace
files are the positional arguments. The offline fleet (``fleet``) and the live run
(``replay.live.main_live``) are built from it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcore.options import OptionParser, check_bounds, option, option_of
from refengine.config import EngineConfig
from refengine.timing import SimTiming
from replay.offline import FleetConfig
from routing.config import RouterConfig, RouterMode
from routing.placement.scorer import ScoringWeights

__all__ = ["POLICY_CHOICES", "ReplayConfig", "build_parser"]

# --policy: the gateway's router modes, "oracle" (the pooled LRU and Belady bounds) and "all".
POLICY_CHOICES = (*(p.value for p in RouterMode), "oracle", "all")
_MODE = "what to do (one of the two)"
_COMMON = "the traces"
_OFFLINE = "offline fleet (--offline)"
_LIVE = "live replay (--url)"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfig:
    """Everything ``kvsidecar replay`` needs. Each field but ``traces`` and ``sim`` (the
    ``--sim-*`` flags, ``SimTiming``'s) is a flag, ``--`` and its name with dashes unless it
    says otherwise."""

    traces: tuple[str, ...]  # the positional TRACE arguments
    offline: bool = option(False, group=_MODE, help="simulate instead of sending")
    url: str | None = option(
        None, group=_MODE, help="the gateway's base URL, e.g. http://127.0.0.1:8000")

    limit: int | None = option(
        None, group=_COMMON, ge=1, help="replay only the first N requests of each trace")
    speedup: float = option(1.0, group=_COMMON, gt=0, help="compress arrival times by this factor")
    prefix_share: float = option(
        0.0, group=_COMMON, ge=0, le=1,
        help="for traces without prefix ids (Azure): share of each prompt taken "
        "from one of a few shared prefixes")
    seed: int = option(0, group=_COMMON, help="seed for random choices")
    report: str | None = option(
        None, group=_COMMON, metavar="DIR", help="write report.md and PNG plots here")
    quiet: bool = option(False, group=_COMMON, help="no progress line on stderr")

    replicas: int = option(8, group=_OFFLINE, ge=1, help="simulated engine replicas")
    capacity_tokens: int | None = option(
        None, group=_OFFLINE, ge=1,
        help="KV cache per replica, in tokens (the engines' --max-total-tokens)")
    capacity_share: float | None = option(
        None, group=_OFFLINE, gt=0, le=1,
        help="instead of --capacity-tokens: all replicas together hold this share "
        "of the trace's distinct blocks")
    policies: tuple[str, ...] = option(
        (), group=_OFFLINE, flag="--policy", choices=POLICY_CHOICES,
        help="placement policy to simulate (repeatable); oracle = the pooled "
        "LRU and Belady bounds; all (the default) = every policy and the bounds")
    # The replicas' options are the reference engine's, the router's the gateway's
    # (``option_of``: their flags, defaults and checks, declared there).
    page_size: int = option_of(EngineConfig, "page_size", group=_OFFLINE)
    chunked_prefill_size: int = option_of(EngineConfig, "chunked_prefill_size", group=_OFFLINE)
    max_running_requests: int = option_of(EngineConfig, "max_running_requests", group=_OFFLINE,
                                          help="requests admitted at once per replica")
    # Fixed here (the gateway learns them by default): a replay compares policies at set
    # weights.
    overlap_weight: float = option_of(RouterConfig, "overlap_weight", group=_OFFLINE,
                                      default=1.0)
    prefill_load_scale: float = option_of(RouterConfig, "prefill_load_scale", group=_OFFLINE,
                                          default=1.0)
    router_temperature: float = option_of(RouterConfig, "router_temperature", group=_OFFLINE)
    approx_ttl_s: float = option_of(
        RouterConfig, "approx_ttl_s", group=_OFFLINE,
        help="how long a routed prefix counts as cached without an event, in every policy")
    event_delay_ms: float = option(
        0.0, group=_OFFLINE, ge=0, help="KV event latency from replica to router")
    # --sim-prefill-base-ms and the other --sim-* flags (the engine's: SimTiming's)
    sim: SimTiming = field(default_factory=SimTiming)

    output: str | None = option(
        None, group=_LIVE, help="JSONL file, one record per request",
        default_text="replay-<trace>.jsonl")
    max_concurrency: int = option(
        64, group=_LIVE, ge=1, help="requests in flight at most (later ones wait)")
    model: str | None = option(
        None, group=_LIVE, help="the model field of each request",
        default_text="the first model the gateway lists at /v1/models")
    model_path: str | None = option(
        None, group=_LIVE, help="model directory whose config.json gives vocab_size")
    vocab_size: int = option(
        1024, group=_LIVE, ge=1, help="token ids are synthesized below this (unless --model-path)")
    block_size: int = option_of(
        RouterConfig, "block_size", group=_LIVE,
        help="the gateway's block size: converts x-kvsidecar-cached-blocks")
    request_timeout_s: float = option(
        600.0, group=_LIVE, gt=0, help="longest silence on a request's stream before it is failed")

    def __post_init__(self) -> None:
        check_bounds(self)  # each option's range, declared with it; relations follow
        if self.offline == (self.url is not None):
            raise ValueError("argument --url: not allowed with argument --offline"
                             if self.offline else
                             "one of the arguments --offline --url is required")

    @property
    def chosen_policies(self) -> tuple[list[RouterMode], bool]:
        """The policies to simulate, and whether the pooled bounds too."""
        chosen = self.policies or ("all",)
        if "all" in chosen:
            return list(RouterMode), True
        return [RouterMode(c) for c in chosen if c != "oracle"], "oracle" in chosen

    def fleet(self, capacity_tokens: int) -> FleetConfig:
        """The simulated fleet of ``--offline``, each replica holding ``capacity_tokens``."""
        return FleetConfig(
            replicas=self.replicas,
            capacity_tokens=capacity_tokens,
            timing=self.sim.model(),
            page_size=self.page_size,
            chunk_size=self.chunked_prefill_size,
            max_running=self.max_running_requests,
            weights=ScoringWeights(
                overlap_weight=self.overlap_weight,
                prefill_load_scale=self.prefill_load_scale,
                temperature=self.router_temperature,
            ),
            approx_ttl_s=self.approx_ttl_s,
            event_delay_s=self.event_delay_ms / 1e3,
            speedup=self.speedup,
            seed=self.seed,
        )

    def capacity(self, distinct_blocks: int, block_tokens: int) -> int:
        """KV tokens per replica: ``--capacity-tokens``, or ``--capacity-share`` of a trace
        with ``distinct_blocks`` blocks of ``block_tokens``, spread over the replicas."""
        if self.capacity_tokens is not None:
            return self.capacity_tokens
        if self.capacity_share is None:
            raise ValueError("--offline needs --capacity-tokens or --capacity-share")
        per_replica = self.capacity_share * distinct_blocks * block_tokens / self.replicas
        return max(block_tokens, int(per_replica) // block_tokens * block_tokens)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> ReplayConfig:
        """From the command line (and ``--config FILE``); a bad flag is an argparse error."""
        parser = build_parser()
        args = parser.parse_args(argv)
        return parser.build(cls, args, traces=tuple(args.traces),
                            sim=parser.build(SimTiming, args))


def build_parser() -> OptionParser:
    """Replay's flags (``ReplayConfig``'s fields) and its trace files."""
    p = OptionParser(
        prog="kvsidecar replay",
        description="Replay request traces (Mooncake JSONL with prefix hash ids, or Azure CSV): "
        "live against a gateway (--url), or offline through a discrete-event model of N "
        "reference-engine replicas placed by the real routing core (--offline).",
    )
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace file(s): .jsonl or .csv")
    p.add_options(ReplayConfig)
    p.add_options(SimTiming)
    return p
