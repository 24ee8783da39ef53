"""Transfer tests run on the stdlib loop and on uvloop (peers: the make_peer fixture)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run every transfer test on the stdlib loop and on uvloop (the sidecar's loop)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
