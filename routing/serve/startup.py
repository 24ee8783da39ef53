"""What the gateway builds from its configuration before it serves: the client API keys
(``auth``, ``rate_limit``), the TLS context, and the summary it logs at start."""

from __future__ import annotations

import ssl
from typing import Any

from kvcore.control_token import read_secret_file
from routing.config import RouterConfig
from routing.serve.auth import ApiKeys
from routing.serve.rate_limit import RateLimits

__all__ = ["api_keys", "load_config_summary", "tls_context"]


def api_keys(cfg: RouterConfig) -> ApiKeys | None:
    """The client API keys and their tenants' limits (``--api-key-file``), or None."""
    if cfg.api_key_file is None:
        return None
    secret = b""
    if cfg.tenant_salt_secret_file is not None:
        secret = read_secret_file(cfg.tenant_salt_secret_file, "--tenant-salt-secret-file").encode()
    limits = RateLimits(cfg.rate_limit_rps, cfg.rate_limit_tps, cfg.rate_limit_burst_s)
    return ApiKeys(cfg.api_key_file, limits, secret)


def tls_context(cfg: RouterConfig) -> ssl.SSLContext | None:
    """The server's TLS context (TLS 1.2 or later), or None for plain HTTP."""
    if cfg.tls_cert is None or cfg.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--tls-cert/--tls-key cannot be loaded: {exc}") from exc
    context.set_alpn_protocols(["http/1.1"])
    return context


def load_config_summary(cfg: RouterConfig) -> dict[str, Any]:
    """What the gateway logs of its configuration when it starts."""
    return {
        "workers": [w.url for w in cfg.workers],
        "router_mode": cfg.router_mode.value,
        "model_path": str(cfg.model_path) if cfg.model_path else None,
        "block_size": cfg.block_size,
        "max_in_flight_per_worker": cfg.max_in_flight_per_worker,
        "busy_kv_fraction": cfg.busy_kv_fraction,
        "busy_prefill_tokens": cfg.busy_prefill_tokens,
        "queue_timeout_s": cfg.queue_timeout_s,
        "session_affinity": cfg.session_affinity,
        "api_keys": cfg.api_key_file is not None,
        "tls": cfg.tls_cert is not None,
        "sidecar_token": cfg.sidecar_token_file is not None,
    }
