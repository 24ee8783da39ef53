"""Between-hosts transport: NIXL (UCX) READs from the exporter's registered segment.

Each sidecar that uses NIXL starts one agent (lazily: creating it takes about half a
second) and registers its whole slot region once, as one DRAM region, with the UCX
backend, which uses RDMA where the fabric has it and shared memory or TCP otherwise. It
also prepares a descriptor list over all its own slots once. An importer learns an
exporter's agent metadata and slot geometry once (``GET /v1/blocks/nixl``), loads it with
``add_remote_agent`` and prepares the exporter's slot list; after that a pull is one
``READ`` of the leased slots (by index) into its reserved slots (by index) and a poll.

The agent is used from one dedicated thread only (its own executor): NIXL's default
thread mode assumes one caller, and polling a transfer must stay off the event loop.
``nixl`` is an optional extra; it is imported on first use and its absence is a
``TransportUnavailableError`` that names the extra.
"""

from __future__ import annotations

import base64
import concurrent.futures
import importlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from sidecar.transfer.errors import PeerUnavailableError, TransportUnavailableError
from sidecar.transfer.messages import NixlPeerInfo
from sidecar.transfer.threads import run_to_completion

__all__ = ["NixlEndpoint", "load_nixl"]

log = structlog.get_logger(component="transfer")

_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
_CANCEL_WAIT_S = 10.0
_EXTRA_HINT = ("NIXL is not installed: install the 'nixl' extra "
               "(pip install 'kvsidecar[nixl]', which brings nixl-cu12)")


def load_nixl() -> Any:
    """The NIXL Python API module, or ``TransportUnavailableError`` naming the extra."""
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            # Its logger prints INFO lines on stdout; keep stdout for our ready lines.
            logging.getLogger("nixl").setLevel(logging.WARNING)
            return module
    raise TransportUnavailableError(_EXTRA_HINT)


@dataclass(slots=True)
class _Peer:
    agent: str
    remote_list: Any  # prepped descriptor list over all the peer's slots
    num_slots: int


class NixlEndpoint:
    """This sidecar's NIXL agent with its slot region registered; ``await start()`` first."""

    def __init__(self, owner_id: str, *, base_address: int, slot_bytes: int, num_slots: int,
                 block_bytes: int) -> None:
        self.name = f"kvsidecar-{owner_id}-{uuid.uuid4().hex[:8]}"
        self.base_address = base_address
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nixl")
        self._agent: Any = None
        self._registered: Any = None
        self._local_list: Any = None
        self._metadata = b""
        self._peers: dict[str, _Peer] = {}

    async def start(self) -> None:
        await run_to_completion(self._start, self._executor)
        log.info("nixl_agent_started", agent=self.name, num_slots=self.num_slots,
                 region_bytes=self.num_slots * self.slot_bytes)

    def _start(self) -> None:
        nixl = load_nixl()
        agent = nixl.nixl_agent(self.name, nixl.nixl_agent_config(backends=["UCX"]))
        if "UCX" not in agent.backends:
            raise TransportUnavailableError("NIXL has no UCX backend plugin here")
        self._agent = agent
        region = self.num_slots * self.slot_bytes
        self._registered = agent.register_memory([(self.base_address, region, 0, "")], "DRAM")
        self._local_list = agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._slot_descs(self.base_address, self.num_slots), "DRAM")
        self._metadata = agent.get_agent_metadata()

    def _slot_descs(self, base: int, count: int) -> np.ndarray:
        descs = np.zeros((count, 3), dtype=np.uint64)
        descs[:, 0] = base + np.arange(count, dtype=np.uint64) * np.uint64(self.slot_bytes)
        descs[:, 1] = self.block_bytes
        return descs

    def info(self) -> NixlPeerInfo:
        return NixlPeerInfo(
            agent=self.name,
            metadata_b64=base64.b64encode(self._metadata).decode(),
            base_address=self.base_address,
            slot_bytes=self.slot_bytes,
            num_slots=self.num_slots,
        )

    def knows(self, agent: str) -> bool:
        return agent in self._peers

    async def add_peer(self, info: NixlPeerInfo) -> None:
        """Load a peer's metadata and prepare its slot list (once per peer agent)."""
        if info.slot_bytes < self.block_bytes:
            raise TransportUnavailableError(
                f"peer agent {info.agent} has {info.slot_bytes}-byte slots, smaller than "
                f"this store's {self.block_bytes}-byte blocks")
        await run_to_completion(lambda: self._add_peer(info), self._executor)

    def _add_peer(self, info: NixlPeerInfo) -> None:
        if info.agent in self._peers:
            return
        name = self._agent.add_remote_agent(base64.b64decode(info.metadata_b64))
        name = name.decode() if isinstance(name, bytes) else str(name)
        descs = np.zeros((info.num_slots, 3), dtype=np.uint64)
        descs[:, 0] = info.base_address + np.arange(info.num_slots, dtype=np.uint64) * np.uint64(
            info.slot_bytes)
        descs[:, 1] = self.block_bytes
        remote = self._agent.prep_xfer_dlist(name, descs, "DRAM")
        self._peers[info.agent] = _Peer(name, remote, info.num_slots)

    async def read(self, agent: str, remote_slots: list[int], local_slots: list[int],
                   timeout_s: float) -> None:
        """READ the peer's ``remote_slots`` into our ``local_slots`` (same order)."""
        await run_to_completion(
            lambda: self.read_blocking(agent, remote_slots, local_slots, timeout_s),
            self._executor)

    def read_blocking(self, agent: str, remote_slots: list[int], local_slots: list[int],
                      timeout_s: float) -> None:
        """``read`` in the calling thread (the agent's thread, or a benchmark's)."""
        peer = self._peers.get(agent)
        if peer is None:
            raise PeerUnavailableError(f"NIXL agent {agent} is not loaded")
        if any(not 0 <= s < peer.num_slots for s in remote_slots):
            raise PeerUnavailableError(f"remote slots outside agent {agent}'s region")
        try:
            handle = self._agent.make_prepped_xfer(
                "READ", self._local_list, np.asarray(local_slots, dtype=np.int32),
                peer.remote_list, np.asarray(remote_slots, dtype=np.int32))
        except Exception as exc:  # nixl's own error types (e.g. the peer disconnected)
            self._forget(agent)
            raise PeerUnavailableError(f"NIXL cannot READ from agent {agent}: {exc!r}") from exc
        state = "ERR"
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self._agent.check_xfer_state(handle)
        except Exception as exc:  # e.g. nixlRemoteDisconnectError: the exporter died
            self._release(handle)
            self._forget(agent)
            raise PeerUnavailableError(f"NIXL READ from agent {agent} failed: {exc!r}") from exc
        self._release(handle)
        if state != "DONE":
            if state == "ERR":
                self._forget(agent)
            raise PeerUnavailableError(
                f"NIXL READ from agent {agent} ended {'in error' if state == 'ERR' else 'late'}")

    def _release(self, handle: Any) -> None:
        """Free the request. NIXL cancels an active one, or refuses while it cannot: then
        wait (bounded) for it to end, so no READ still lands in slots we are about to free."""
        deadline = time.monotonic() + _CANCEL_WAIT_S
        while True:
            try:
                self._agent.release_xfer_handle(handle)
                return
            except Exception as exc:  # nixl raises its own error types
                if time.monotonic() > deadline or not self._active(handle):
                    log.warning("nixl_transfer_unreleased", agent=self.name, error=repr(exc))
                    return
                time.sleep(0.001)

    def _active(self, handle: Any) -> bool:
        try:
            return bool(self._agent.check_xfer_state(handle) == "PROC")
        except Exception:  # the request failed: nothing is moving any more
            return False

    def forget(self, agent: str) -> None:
        """Drop a peer (its agent restarted): the next pull reloads its metadata."""
        self._executor.submit(self._forget, agent)

    def _forget(self, agent: str) -> None:
        peer = self._peers.pop(agent, None)
        if peer is not None:
            try:
                peer.remote_list.release()
                self._agent.remove_remote_agent(peer.agent)
            except Exception as exc:
                log.warning("nixl_peer_forget_failed", agent=agent, error=repr(exc))

    async def aclose(self) -> None:
        """Release everything and deregister the region (before the segment is unmapped)."""
        await run_to_completion(self._close, self._executor)
        self._executor.shutdown(wait=True)

    def _close(self) -> None:
        if self._agent is None:
            return
        for agent in list(self._peers):
            self._forget(agent)
        if self._local_list is not None:
            self._local_list.release()
            self._local_list = None
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None
        self._agent = None
        log.info("nixl_agent_stopped", agent=self.name)
