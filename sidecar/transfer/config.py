"""The block transfer service's typed configuration (the sidecar builds it from its flags)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TransferConfig"]


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """How this sidecar exports blocks to peers and pulls blocks from them."""

    tcp_host: str = "127.0.0.1"  # where the TCP block stream listens
    tcp_port: int = 0  # 0 picks a free port (advertised in each TCP offer)
    advertise_host: str | None = None  # the address peers dial (default: tcp_host)
    lease_ttl_s: float = 30.0  # longest an export holds leases without a release
    pull_timeout_s: float = 30.0  # default deadline of one pull, end to end
    max_blocks_per_pull: int = 4096
    enable_tcp: bool = True
    enable_nixl: bool = True  # when the nixl extra imports
    start_nixl_eagerly: bool = False  # start the agent in start() (~0.5 s), not on first use
    socket_buffer_bytes: int = 4 << 20  # SO_SNDBUF / SO_RCVBUF of the TCP stream

    def __post_init__(self) -> None:
        if not 0 <= self.tcp_port <= 65535:
            raise ValueError(f"tcp_port must be in [0, 65535], got {self.tcp_port}")
        for name in ("lease_ttl_s", "pull_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_blocks_per_pull < 1:
            raise ValueError(f"max_blocks_per_pull must be >= 1, got {self.max_blocks_per_pull}")
        if self.socket_buffer_bytes < 65536:
            raise ValueError(f"socket_buffer_bytes must be >= 65536, got "
                             f"{self.socket_buffer_bytes}")

    @property
    def tcp_advertised_host(self) -> str:
        return self.advertise_host or self.tcp_host
