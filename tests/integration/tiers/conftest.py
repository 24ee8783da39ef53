"""The KV-tier tests' shared replicas (the kv-move and tier-credit modules)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvsidecar.local_stack import LocalStack
from tests.support.tier_stack import PAGE_BYTES, plain, replica, tier_spec


@pytest.fixture(scope="package")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The KV-tier stack the kv-move and tier-credit tests share, each adding its gateway:
    replicas A and B, torch engines (real KV bytes) whose HiCache hooks write through to
    their sidecars' 256-page stores, over one ``redis-server`` (A writes to it only what its
    store evicts, B all it commits); C, a plain torch engine: what a full prefill answers.
    The two modules' prompts share no page, so either may run first, or alone."""
    store = ("--store-capacity-bytes", str(256 * PAGE_BYTES))
    spec = tier_spec(
        replica("A", *store, "--remote-tier-write", "evict", compute="torch"),
        replica("B", *store, "--remote-tier-write", "through", compute="torch"),
        plain("C"), redis=True)
    with LocalStack(spec, tmp_path_factory.mktemp("replicas")) as stack:
        yield stack
