"""The block store owner's typed configuration, and its command-line form: each field below is
one flag of ``python -m shm`` (``kvsidecar shm``), declared once with ``kvcore.options``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcore.layout import DTYPE_BYTES, LayoutKind
from kvcore.logs import LOG_LEVELS
from kvcore.options import OptionParser, check_bounds, option
from shm.segment import check_owner_id
from shm.tiers.disk_format import HEADER_BYTES as DISK_HEADER_BYTES

__all__ = ["OwnerConfig", "owner_parser"]

LAYOUTS = tuple(kind.value for kind in LayoutKind)
REMOTE_WRITES = ("through", "evict")
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30}
_STORE = "block store"
_RUN = "process"
_TIERS = "tiers below the store (flags named as the sidecar's)"


def parse_bytes(text: str) -> int:
    """``"256MiB"``, ``"16k"`` or ``"4096"`` as a byte count."""
    stripped = text.strip().lower()
    digits = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a byte size (examples: 4096, 16KiB, 256MiB, 2GiB)")
    return int(digits) * _UNITS[unit]


@dataclass(frozen=True, slots=True)
class OwnerConfig:
    """What one block store owner needs; ``num_slots`` follows from the two sizes."""

    owner_id: str = option(required=True, group=_STORE, metavar="ID",
                           help="unique id on this host, part of every segment name")
    socket_path: Path = option(required=True, group=_STORE, flag="--socket", metavar="PATH",
                               help="Unix socket path for the control channel")
    capacity_bytes: int = option(required=True, group=_STORE, parse=parse_bytes,
                                 metavar="SIZE",
                                 help="byte budget for blocks, e.g. 256MiB (sets the slot count)")
    block_bytes: int = option(required=True, group=_STORE, ge=1, parse=parse_bytes, metavar="SIZE",
                              help="bytes per block, e.g. 256KiB")
    dtype: str = option("uint8", group=_STORE, choices=sorted(DTYPE_BYTES),
                        help="element type of a block")
    layout: str = option("raw", group=_STORE, choices=LAYOUTS,
                         help="block layout name recorded in the header")
    worker_id: str | None = option(None, group=_STORE, metavar="ID", default_text="the owner id",
                                   help="worker id in host-tier events")
    grant_fraction: float = option(
        0.25, group=_STORE, ge=0, le=1, metavar="F",
        help="share of the slots the owner may grant writers ahead of their puts, so that a "
        "put copies while its slots are claimed instead of after a reserve round trip (0 turns "
        "write-ahead grants off; a granted slot holds no block)")
    ready_file: Path | None = option(None, group=_RUN, metavar="PATH",
                                     help="also write the ready line to this file")
    log_level: str = option("info", group=_RUN, choices=LOG_LEVELS,
                            help="the least severe log records written to stderr")
    sched_batch: bool = option(
        False, group=_RUN,
        help="run the owner under Linux SCHED_BATCH, so that a client's one-way frames "
        "(Release, Publish) do not preempt the client when both share a CPU; the owner "
        "handles them once the client waits for a reply. Off by default: it helps single-CPU "
        "placements and costs small batches across CPUs")
    disk_dir: Path | None = option(  # the disk tier below the store (``shm.tiers.disk_tier``)
        None, group=_TIERS, flag="--disk-tier-dir", aliases=("--disk-dir",), metavar="DIR",
        default_text="none",
        help="keep blocks evicted from shared memory in this directory (the disk tier: a get "
        "that misses in shared memory reads them back; they survive a restart and are "
        "announced as tier 'disk')")
    disk_capacity_bytes: int = option(
        0, group=_TIERS, flag="--disk-tier-capacity-bytes", aliases=("--disk-capacity-bytes",),
        ge=0, parse=parse_bytes, metavar="SIZE", default_text="none",
        help="byte budget of the disk tier, e.g. 64GiB (required with --disk-tier-dir)")
    # The remote tier (``shm.tiers.remote_tier``): a Redis-protocol store's URL, the scope its
    # keys live under (the model), and when blocks are written.
    remote_url: str | None = option(
        None, group=_TIERS, flag="--remote-tier-url", aliases=("--remote-url",), metavar="URL",
        help="a Redis-protocol store shared by every replica of the model (the remote tier), "
        "e.g. redis://cache:6379/0: blocks are written to it, gets that miss below read them "
        "back, and what it holds is announced as tier 'remote'")
    remote_scope: str = option("default", group=_TIERS, metavar="NAME", default_text="'default'",
                               help="what the remote tier's keys are scoped by (the model)")
    remote_write: str = option(
        "through", group=_TIERS, flag="--remote-tier-write", aliases=("--remote-write",),
        choices=REMOTE_WRITES,
        help="write every block committed (through) or only those evicted (evict)")

    def __post_init__(self) -> None:
        check_bounds(self)  # each option's range, declared with it; relations follow
        check_owner_id(self.owner_id)
        if self.capacity_bytes < self.block_bytes:
            raise ValueError(
                f"capacity_bytes {self.capacity_bytes} holds no block of {self.block_bytes} bytes"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        if self.block_bytes % DTYPE_BYTES[self.dtype]:
            raise ValueError(f"block_bytes {self.block_bytes} is not a whole number of "
                             f"{self.dtype} elements")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        if self.disk_dir is not None and self.disk_capacity_bytes < (
                self.block_bytes + DISK_HEADER_BYTES):
            raise ValueError(f"a disk tier needs a capacity of at least one block file "
                             f"({self.block_bytes + DISK_HEADER_BYTES} bytes), got "
                             f"{self.disk_capacity_bytes}")
        if self.disk_dir is None and self.disk_capacity_bytes:
            raise ValueError("a disk tier capacity needs a disk tier directory")
        if self.remote_write not in REMOTE_WRITES:
            raise ValueError(f"remote write policy must be 'through' or 'evict', got "
                             f"{self.remote_write!r}")
        if self.remote_url is not None and not self.remote_url.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError(f"the remote tier's URL must be redis://, rediss:// or unix://, "
                             f"got {self.remote_url!r}")
        if len(str(self.socket_path).encode()) > 107:
            raise ValueError(f"socket path {self.socket_path} is longer than 107 bytes")

    @property
    def num_slots(self) -> int:
        return self.capacity_bytes // self.block_bytes

    @property
    def max_granted_slots(self) -> int:
        """Slots writers may hold ahead of their puts, all together (see ``BlockStore.grant``)."""
        return int(self.num_slots * self.grant_fraction)

    @property
    def effective_worker_id(self) -> str:
        return self.worker_id or self.owner_id

    @classmethod
    def from_args(cls, argv: Sequence[str] | None, prog: str = "python -m shm") -> OwnerConfig:
        """From the command line (and ``--config FILE``); a bad flag or an invalid config is
        an argparse error (exit 2)."""
        parser = owner_parser(prog)
        return parser.build(cls, parser.parse_args(argv))


def owner_parser(prog: str = "python -m shm") -> OptionParser:
    """The owner's flags: ``OwnerConfig``'s fields."""
    parser = OptionParser(
        prog=prog,
        description=(
            "Run a shared-memory KV block store owner: create the segment in /dev/shm "
            "(unlinking stale ones left by a dead owner with the same id), serve clients "
            "on a Unix socket, and unlink everything on SIGTERM or SIGINT. Prints one JSON "
            "ready line on stdout once clients can connect."
        ),
    )
    parser.add_options(OwnerConfig)
    return parser
