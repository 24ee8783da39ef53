"""Fixtures for block store tests: unique owner ids, both event loops (``sock_dir``, the
short socket directory, is the suite-wide one of tests/conftest.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
import uvloop


@pytest.fixture
def owner_id() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run the owner's async tests on both the stdlib loop and uvloop (the CLI's loop)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
