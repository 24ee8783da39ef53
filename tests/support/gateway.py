"""A running gateway seen from a test: waiting until its workers can take requests."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.support.polling import eventually

__all__ = ["routable"]


async def routable(
    session: aiohttp.ClientSession, url: str, count: int, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """Poll the gateway's /v1/workers until ``count`` (≥ 1) workers are routable and healthy."""

    async def listing() -> list[dict[str, Any]]:
        async with session.get(f"{url}/v1/workers") as resp:
            workers = (await resp.json())["workers"]
        ready = sum(bool(w["routable"] and w["healthy"]) for w in workers)
        assert ready >= count, f"workers never became routable: {workers}"
        return list(workers)

    return await eventually(listing, f"{count} routable workers at {url}", timeout_s, 0.05)
