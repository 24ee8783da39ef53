"""The gateway's command line: ``gateway_parser()``, the flags of ``RouterConfig``'s fields
(``routing/config.py`` declares each option once: default, type, help, group), and
``gateway_config(argv)``, the one builder of a ``RouterConfig`` from them (the endpoint picker
builds on ``gateway_parser()``)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

from kvcore.options import OptionParser
from routing.config import RouterConfig

__all__ = ["gateway_config", "gateway_parser"]


def gateway_config(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> RouterConfig:
    """From the command line (and ``--config FILE``); ``parser``: one built on
    ``gateway_parser()`` with more flags (the endpoint picker's), whose own flags its caller
    reads. A bad flag or an invalid config is an argparse error (exit 2)."""
    p = parser or gateway_parser()
    if not isinstance(p, OptionParser):
        raise TypeError("gateway_config needs a parser built by gateway_parser()")
    return p.build(RouterConfig, p.parse_args(argv))


def gateway_parser(environ: Mapping[str, str] | None = None) -> OptionParser:
    """The gateway's flags, for a command that places requests as the gateway does (their
    variables read from ``environ``, by default the process's environment)."""
    p = OptionParser(
        prog="kvsidecar gateway", environ=environ,
        description="The OpenAI-compatible entry point: tokenizes, hashes the prompt into KV "
        "blocks, places each request on a worker and proxies the reply (streaming or not).",
    )
    p.add_options(RouterConfig)
    return p
