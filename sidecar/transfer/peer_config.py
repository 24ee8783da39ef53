"""The standalone block peer's configuration, and its command line (``kvsidecar blocks``,
``python -m sidecar.transfer``): each field of ``BlockPeerConfig`` is one flag
(``kvcore.options``: help, group and default written once), and ``--config FILE`` reads the
same options from TOML. The store's options are the block store owner's own (``option_of``);
the transfer's defaults are ``TransferConfig``'s.

The control token is derived, never a flag of its own: read from ``--control-token-file``,
else from ``KVSIDECAR_CONTROL_TOKEN``, as the sidecar reads it."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvcore.control_token import CONTROL_TOKEN_ENV, CONTROL_TOKEN_HEADER, read_secret_file
from kvcore.logs import LogLevel
from kvcore.options import OptionParser, check_bounds, option, option_of
from shm.owner.config import OwnerConfig
from sidecar.transfer.config import TransferConfig

__all__ = ["BlockPeerConfig"]

_TRANSFER = TransferConfig()  # the transfer's defaults, whose home is TransferConfig
_STORE = "block store"
_PEER = "block peer"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockPeerConfig:
    """What one standalone block peer needs: its store, where it serves, how it transfers."""

    owner_id: str = option_of(OwnerConfig, "owner_id", group=_STORE)
    socket_path: Path = option_of(OwnerConfig, "socket_path", group=_STORE)  # --socket
    capacity_bytes: int = option_of(OwnerConfig, "capacity_bytes", group=_STORE)
    block_bytes: int = option_of(OwnerConfig, "block_bytes", group=_STORE)
    dtype: str = option_of(OwnerConfig, "dtype", group=_STORE)
    host: str = option(_TRANSFER.tcp_host, group=_PEER,
                       help="listen address of the HTTP routes and the TCP block stream")
    port: int = option(0, group=_PEER, ge=0, le=65535, help="HTTP port; 0 picks a free one")
    tcp_port: int = option(_TRANSFER.tcp_port, group=_PEER, ge=0, le=65535,
                           help="port of the TCP block stream; 0 picks a free one")
    lease_ttl_s: float = option(_TRANSFER.lease_ttl_s, group=_PEER, gt=0,
                                help="longest an export holds leases without a release")
    no_nixl: bool = option(False, group=_PEER, help="do not offer the nixl transport")
    control_token_file: Path | None = option(
        None, group=_PEER, metavar="FILE",
        help=f"a token callers must send as '{CONTROL_TOKEN_HEADER}' (and this peer sends to "
        f"the peers it pulls from); or set {CONTROL_TOKEN_ENV}")
    log_level: LogLevel = option(LogLevel.INFO, group=_PEER,
                                 help="the least severe log records written to stderr")
    ready_file: Path | None = option(None, group=_PEER, metavar="PATH",
                                     help="also write the ready line to this file once serving")
    # Derived: from --control-token-file or the environment (``from_args``).
    control_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_bounds(self)
        self.owner  # noqa: B018  (the store's own checks, before anything starts)

    @property
    def owner(self) -> OwnerConfig:
        """The block store's configuration (``ValueError`` when its sizes disagree)."""
        return OwnerConfig(owner_id=self.owner_id, socket_path=self.socket_path,
                           capacity_bytes=self.capacity_bytes, block_bytes=self.block_bytes,
                           dtype=self.dtype, log_level=self.log_level.value)

    @property
    def transfer(self) -> TransferConfig:
        """The transfer service's configuration."""
        return TransferConfig(tcp_host=self.host, tcp_port=self.tcp_port,
                              lease_ttl_s=self.lease_ttl_s, enable_nixl=not self.no_nixl)

    @classmethod
    def parser(cls, prog: str = "kvsidecar blocks") -> OptionParser:
        """The block peer's flags: this class's options."""
        p = OptionParser(
            prog=prog,
            description="Run a KV block store owner with its sidecar-to-sidecar transfer "
            "service (export and import of blocks over shared memory, NIXL or TCP), without "
            "an engine.")
        p.add_options(cls)
        return p

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, prog: str = "kvsidecar blocks",
        environ: Mapping[str, str] | None = None,
    ) -> BlockPeerConfig:
        """From the command line (and ``--config FILE``), the token from its file or
        ``environ``; a bad flag, an invalid store or an unreadable token file is an argparse
        error (exit 2)."""
        parser = cls.parser(prog)
        args = parser.parse_args(argv)
        env = os.environ if environ is None else environ
        try:
            token = (env.get(CONTROL_TOKEN_ENV) or None if args.control_token_file is None
                     else read_secret_file(args.control_token_file, "--control-token-file"))
        except ValueError as exc:
            parser.error(str(exc))
        return parser.build(cls, args, control_token=token)
