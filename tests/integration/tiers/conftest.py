from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvsidecar.launch import ManagedProcess
from tests.support.processes import ProcessGroup


@pytest.fixture
def procs() -> Iterator[ProcessGroup[ManagedProcess]]:
    with ProcessGroup[ManagedProcess]() as group:
        yield group
