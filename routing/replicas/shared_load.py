"""The active load shared with the other gateway replicas.

``SharedLoad`` is the router's ``ActiveLoad`` when ``--nats`` is given (without it the plain
class runs, so the hot path pays nothing): each local lifecycle call is also appended to
``outbox`` as a ``messages`` event, which the link publishes once per event-loop tick. The
other replicas' requests live in the same accounting, keyed ``@<replica>/<their key>``, so
their load, refcounted prefixes included, counts exactly as a local request's would; the
``*_remote`` calls fold them in without echoing them back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from routing.placement.active_load import RESERVED_MARK, ActiveLoad
from routing.replicas.messages import Claimed, Finished, FirstToken, Placed, ReplicaEvent

__all__ = ["REMOTE_MARK", "SharedLoad"]

REMOTE_MARK = "@"  # leads every remote key; local keys never start with it


def _nothing() -> None:
    return None


class SharedLoad(ActiveLoad):
    """``ActiveLoad`` that queues its local lifecycle for the peers and holds theirs too."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.outbox: list[ReplicaEvent] = []  # local events of this tick, in order
        # Called when the outbox stops being empty: the link wakes its publisher.
        self.on_outbox: Callable[[], None] = _nothing
        self.num_remote = 0

    # --- local lifecycle, published ------------------------------------------------------

    def add(
        self,
        request_id: str,
        worker_id: str,
        block_hashes: Sequence[int],
        prompt_tokens: int,
        cached_tokens: int = 0,
    ) -> None:
        super().add(request_id, worker_id, block_hashes, prompt_tokens, cached_tokens)
        outbox = self.outbox
        if not outbox:
            self.on_outbox()
        prefill = prompt_tokens - cached_tokens
        outbox.append(Placed(request_id, worker_id, block_hashes, prompt_tokens,
                             prefill if prefill > 0 else 0))

    def first_token(self, request_id: str) -> None:
        super().first_token(request_id)
        outbox = self.outbox
        if not outbox:
            self.on_outbox()
        outbox.append(FirstToken(request_id))

    def finish(self, request_id: str) -> None:
        super().finish(request_id)
        outbox = self.outbox
        if not outbox:
            self.on_outbox()
        outbox.append(Finished(request_id))

    def claimed(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """This replica, owner of a new prompt, chose ``worker_id`` for a peer's session of it
        (routing/replicas/prompt_hold.py): a prediction for the peers, no load."""
        outbox = self.outbox
        if not outbox:
            self.on_outbox()
        outbox.append(Claimed(worker_id, block_hashes))

    def forget_worker(self, worker_id: str) -> list[str]:
        """A worker left: its requests end here, and for the peers too."""
        lost = super().forget_worker(worker_id)
        local = [key for key in lost if not key.startswith(REMOTE_MARK)]
        self.num_remote -= len(lost) - len(local)
        local = [key for key in local if not key.startswith(RESERVED_MARK)]
        if local:
            if not self.outbox:
                self.on_outbox()
            self.outbox += [Finished(key) for key in local]
        return local

    def snapshot(self) -> list[ReplicaEvent]:
        """Every local request in flight, as it stands now (what a snapshot batch lists)."""
        return [
            Placed(key, r.worker_id, r.block_hashes, r.prompt_tokens, r.prefill_tokens)
            for key, r in self._requests.items()
            if not key.startswith((REMOTE_MARK, RESERVED_MARK))
        ]

    # --- the peers' requests, folded in (never published) --------------------------------

    def add_remote(self, key: str, placed: Placed) -> bool:
        """A peer's placement (``key``: already marked); False when it is known already."""
        if key in self._requests:
            return False
        ActiveLoad.add(self, key, placed.worker_id, placed.block_hashes, placed.prompt_tokens,
                       placed.prompt_tokens - placed.prefill_tokens)
        self.num_remote += 1
        return True

    def first_token_remote(self, key: str) -> None:
        if key in self._requests:
            ActiveLoad.first_token(self, key)

    def finish_remote(self, key: str) -> None:
        if key in self._requests:
            ActiveLoad.finish(self, key)
            self.num_remote -= 1
