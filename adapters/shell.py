"""What every engine adapter shares, written once: its event stream, what ``start()`` learned,
``async with``, and the model's KV layout read from its directory.

An adapter subclasses ``AdapterShell`` and adds what is its engine's own: discovery and
consumption in ``start()``, request translation, the layout's engine-specific details.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Self

from adapters.base import AdapterError, EngineInfo, StoreKeys, StoreNameSink
from adapters.normalize_stream import AdapterEventQueue
from kvcore.events import KVEvent
from kvcore.layout import BlockLayout
from kvcore.stream import EngineLoad

__all__ = ["AdapterShell"]


class AdapterShell(ABC):
    """The lifecycle and views an ``EngineAdapter`` needs besides its engine's specifics."""

    # By default a storage hook keys blocks canonically: there is nothing to report.
    store_keys = StoreKeys.CANONICAL

    def __init__(self, queue_size: int) -> None:
        self._stream = AdapterEventQueue(queue_size)
        self._info: EngineInfo | None = None

    @abstractmethod
    async def start(self) -> EngineInfo:
        """Discover the engine and begin consuming its events (each adapter its own way)."""

    @property
    def info(self) -> EngineInfo:
        """What ``start()`` learned; ``AdapterError`` before it."""
        if self._info is None:
            raise AdapterError("the adapter has not started")
        return self._info

    def events(self) -> AsyncIterator[KVEvent]:
        return aiter(self._stream)

    def watch_store_names(self, sink: StoreNameSink) -> None:
        """Nothing to report for canonical keys (an adapter whose engine's hook keys blocks
        by the engine's own hashes overrides this)."""
        return None

    def engine_load(self, worker_id: str) -> EngineLoad | None:
        """None: by default an engine publishes no load of its own (an adapter that reads
        one overrides this)."""
        return None

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def model_layout(self) -> BlockLayout:
        """The KV layout of the model's ``config.json`` (``AdapterError`` if unreadable)."""
        info = self.info
        path = info.model_path
        if path is None or not Path(path).exists():
            raise AdapterError(
                f"the KV layout needs the model's config.json; model path {path!r} is not "
                "readable here: pass --model-path"
            )
        return BlockLayout.from_model_path(path, info.block_size)
