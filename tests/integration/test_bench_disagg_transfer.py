"""bench_disagg's KV handoff transfer figures come out: its helper, which no other test ran,
once built ``TransferServiceHandoff`` by an old signature and every run printed "transfer:
not measured" instead of the figures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


async def test_every_layout_times_a_pull_its_groups_and_the_memcpy_floor() -> None:
    spec = importlib.util.spec_from_file_location(
        "disagg_transfer", ROOT / "scripts" / "_disagg_transfer.py")
    assert spec is not None and spec.loader is not None
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    measured = await helper.measure_transfer(["shm"], rounds=1)
    assert set(measured) == set(helper.LAYOUTS)
    for per in measured.values():
        assert set(per) == {"shm", f"shm_groups_of_{helper.GROUP}", "memcpy"}
        assert all(ms > 0 for ms in per.values()), per
