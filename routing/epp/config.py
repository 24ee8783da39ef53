"""``kvsidecar epp``'s typed configuration: the gateway's worker, model and placement flags,
and the picker's own (gRPC port, the body mode Envoy is assumed to use)."""

from __future__ import annotations

import argparse
import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvcore.options import OptionParser, check_bounds, option
from routing.config import RouterConfig
from routing.flags import gateway_config, gateway_parser

__all__ = ["BodyMode", "EppConfig"]

# Gateway flags that mean nothing to a picker: it proxies nothing, serves no pair, and the
# client's request reaches the engine through Envoy, not through it (its keys, tenants, rate
# limits and TLS are the Gateway's). Hidden from --help, refused when given.
_NOT_FOR_EPP = (
    "pd_mode",
    "kv_load_failure_policy",
    "kv_transfer_timeout_s",
    "kv_transport",
    "pd_queue_timeout_s",
    "upstream_timeout_s",
    "forward_authorization",
    "api_key_file",
    "rate_limit_rps",
    "rate_limit_tps",
    "rate_limit_burst_s",
    "tenant_salt_secret_file",
    "tls_cert",
    "tls_key",
)
DEFAULT_GRPC_PORT = 9002  # the reference endpoint picker's, which InferencePools point at
DEFAULT_HTTP_PORT = 9090


class BodyMode(enum.Enum):
    """How Envoy sends the request body, when its first message does not say
    (``ProcessingRequest.protocol_config``, sent by Envoy ≥ 1.34)."""

    FULL_DUPLEX = "full-duplex"  # FULL_DUPLEX_STREAMED: the gateway API's recommended mode
    BUFFERED = "buffered"  # BUFFERED: headers answered first, then one body message


_PICKER = "endpoint picker"


@dataclass(frozen=True, slots=True)
class EppConfig:
    """The picker's own options (each a flag, as ``RouterConfig``'s are) and the gateway's."""

    router: RouterConfig  # workers, model, placement; its host/port serve the HTTP views
    grpc_host: str = option(
        "0.0.0.0", group=_PICKER,
        help="address the ext_proc and gRPC health services listen on (Envoy reaches the "
        "picker through its Service)")
    grpc_port: int = option(
        DEFAULT_GRPC_PORT, group=_PICKER, ge=0, le=65535,
        help="port of the ext_proc and grpc.health.v1 services (0: any free port, printed in "
        "epp_started)")
    body_mode: BodyMode = option(
        BodyMode.FULL_DUPLEX, group=_PICKER,
        help="how Envoy's ext_proc filter sends request bodies when its messages do not say "
        "(protocol_config): full-duplex (FULL_DUPLEX_STREAMED, the InferencePool default) or "
        "buffered (BUFFERED)")

    def __post_init__(self) -> None:
        check_bounds(self)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> EppConfig:
        """From the command line (and ``--config FILE``, which may hold the gateway's options
        and the picker's); a gateway-only option, given either way, is refused."""
        parser = _parser()
        untouched = {a.dest: a.default for a in parser._actions if a.dest in _NOT_FOR_EPP}
        args = parser.parse_args(argv)
        for action in parser._actions:
            if action.dest in untouched and getattr(args, action.dest) != untouched[action.dest]:
                parser.error(f"{action.option_strings[0]} does not apply to the endpoint picker "
                             "(Envoy, not the picker, carries the client's request)")
        return parser.build(cls, args, router=gateway_config(argv, parser))


def _parser() -> OptionParser:
    p = gateway_parser()
    p.prog = "kvsidecar epp"
    p.description = (
        "The Gateway API Inference Extension endpoint picker: Envoy's ext_proc gRPC service "
        "that places each request of an InferencePool as the kvsidecar gateway would (prefix "
        "overlap from the sidecars' KV events, and load) and answers with the picked engine's "
        "ip:port (header and envoy.lb metadata 'x-gateway-destination-endpoint')."
    )
    for action in p._actions:
        if action.dest in _NOT_FOR_EPP:
            action.help = argparse.SUPPRESS
        elif action.dest == "port":
            action.help = (
                f"port of the HTTP views: /health, /metrics, /v1/workers, /v1/models "
                f"(default {DEFAULT_HTTP_PORT}; 0: any free port)"
            )
        elif action.dest == "host":
            action.help = "address the HTTP views listen on"
    p.set_defaults(port=DEFAULT_HTTP_PORT)
    p.add_options(EppConfig)
    return p
