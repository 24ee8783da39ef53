"""The block store owner's typed configuration, and its command-line form."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from kvcore.layout import DTYPE_BYTES, LayoutKind
from shm.disk_format import HEADER_BYTES as DISK_HEADER_BYTES
from shm.segment import check_owner_id

__all__ = ["OwnerConfig"]

LAYOUTS = tuple(kind.value for kind in LayoutKind)
_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30}


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

    owner_id: str
    socket_path: Path
    capacity_bytes: int
    block_bytes: int
    dtype: str = "uint8"
    layout: str = "raw"
    worker_id: str | None = None
    ready_file: Path | None = None
    log_level: str = "info"
    sched_batch: bool = False
    grant_fraction: float = 0.25
    disk_dir: Path | None = None  # the disk tier below the store (``shm.disk_tier``)
    disk_capacity_bytes: int = 0
    # The remote tier (``shm.remote_tier``): a Redis-protocol store's URL, the scope its
    # keys live under (the model), and when blocks are written ("through" or "evict").
    remote_url: str | None = None
    remote_scope: str = "default"
    remote_write: str = "through"

    def __post_init__(self) -> None:
        check_owner_id(self.owner_id)
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {self.block_bytes}")
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
        if not 0 <= self.grant_fraction <= 1:
            raise ValueError(f"grant_fraction must be within 0..1, got {self.grant_fraction}")
        if self.disk_dir is not None and self.disk_capacity_bytes < (
                self.block_bytes + DISK_HEADER_BYTES):
            raise ValueError(f"a disk tier needs a capacity of at least one block file "
                             f"({self.block_bytes + DISK_HEADER_BYTES} bytes), got "
                             f"{self.disk_capacity_bytes}")
        if self.disk_dir is None and self.disk_capacity_bytes:
            raise ValueError("a disk tier capacity needs a disk tier directory")
        if self.remote_write not in ("through", "evict"):
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
    def from_args(cls, argv: list[str] | None, prog: str = "python -m shm") -> OwnerConfig:
        parser = argparse.ArgumentParser(
            prog=prog,
            description=(
                "Run a shared-memory KV block store owner: create the segment in /dev/shm "
                "(unlinking stale ones left by a dead owner with the same id), serve clients "
                "on a Unix socket, and unlink everything on SIGTERM or SIGINT. Prints one JSON "
                "ready line on stdout once clients can connect."
            ),
        )
        parser.add_argument("--owner-id", required=True,
                            help="unique id on this host, part of every segment name")
        parser.add_argument("--socket", required=True, type=Path,
                            help="Unix socket path for the control channel")
        parser.add_argument("--capacity-bytes", required=True, type=parse_bytes,
                            help="byte budget for blocks, e.g. 256MiB (sets the slot count)")
        parser.add_argument("--block-bytes", required=True, type=parse_bytes,
                            help="bytes per block, e.g. 256KiB")
        parser.add_argument("--dtype", default="uint8", choices=sorted(DTYPE_BYTES),
                            help="element type of a block (default: uint8)")
        parser.add_argument("--layout", default="raw", choices=LAYOUTS,
                            help="block layout name recorded in the header (default: raw)")
        parser.add_argument("--worker-id", default=None,
                            help="worker id in host-tier events (default: the owner id)")
        parser.add_argument("--ready-file", type=Path, default=None,
                            help="also write the ready line to this file")
        parser.add_argument("--log-level", default="info",
                            choices=["debug", "info", "warning", "error"])
        parser.add_argument(
            "--sched-batch", action="store_true",
            help="run the owner under Linux SCHED_BATCH, so that a client's one-way frames "
                 "(Release, Publish) do not preempt the client when both share a CPU; the "
                 "owner handles them once the client waits for a reply. Off by default: it "
                 "helps single-CPU placements and costs small batches across CPUs")
        parser.add_argument(
            "--grant-fraction", type=float, default=0.25, metavar="F",
            help="share of the slots the owner may grant writers ahead of their puts, so "
                 "that a put copies while its slots are claimed instead of after a reserve "
                 "round trip (default 0.25; 0 turns write-ahead grants off; a granted slot "
                 "holds no block)")
        parser.add_argument(
            "--disk-dir", type=Path, default=None, metavar="DIR",
            help="keep blocks evicted from shared memory in this directory (the disk tier: "
                 "a get that misses in shared memory reads them back; they survive a "
                 "restart and are announced as tier 'disk'). Default: none")
        parser.add_argument(
            "--disk-capacity-bytes", type=parse_bytes, default=0, metavar="SIZE",
            help="byte budget of the disk tier, e.g. 64GiB (required with --disk-dir)")
        parser.add_argument(
            "--remote-url", default=None, metavar="URL",
            help="a Redis-protocol store shared by every replica of the model (the remote "
                 "tier), e.g. redis://cache:6379/0: blocks are written to it, gets that miss "
                 "below read them back, and what it holds is announced as tier 'remote'")
        parser.add_argument(
            "--remote-scope", default="default", metavar="NAME",
            help="what the remote tier's keys are scoped by (the model; default 'default')")
        parser.add_argument(
            "--remote-write", choices=("through", "evict"), default="through",
            help="write every block committed (through, default) or only those evicted")
        args = parser.parse_args(argv)
        try:
            return cls(
                owner_id=args.owner_id,
                socket_path=args.socket,
                capacity_bytes=args.capacity_bytes,
                block_bytes=args.block_bytes,
                dtype=args.dtype,
                layout=args.layout,
                worker_id=args.worker_id,
                ready_file=args.ready_file,
                log_level=args.log_level,
                sched_batch=args.sched_batch,
                grant_fraction=args.grant_fraction,
                disk_dir=args.disk_dir,
                disk_capacity_bytes=args.disk_capacity_bytes,
                remote_url=args.remote_url,
                remote_scope=args.remote_scope,
                remote_write=args.remote_write,
            )
        except ValueError as exc:
            parser.error(str(exc))
            raise  # unreachable: parser.error exits
