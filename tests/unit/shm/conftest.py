"""Fixtures for block store tests: short socket paths and unique owner ids."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvloop


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (their paths must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kvs-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def owner_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run the owner's async tests on both the stdlib loop and uvloop (the CLI's loop)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
