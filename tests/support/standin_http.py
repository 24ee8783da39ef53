"""What the engine stand-ins (``sglang_standin``, ``trtllm_standin``) share: recording the bodies
they receive, loading images, a prefix cache of pages, and serving on port 0 with a ready file.

Every body a stand-in receives is recorded with its path, its ``x-request-id`` header and the
verdict of the engine's own request validation; a test reads them back at
``GET /_standin/requests`` (``?request_id=`` filters), the stand-in's only test-only route.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import io
import json
import signal
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.support.standin_model import StandinError, digest

__all__ = [
    "RECORDER",
    "PageCache",
    "Recorder",
    "base_args",
    "image_digest",
    "serve",
]


@dataclass
class Record:
    path: str
    request_id: str | None
    body: Any
    valid: bool = True
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "request_id": self.request_id, "body": self.body,
                "valid": self.valid, "error": self.error}


@dataclass
class Recorder:
    """The last bodies received (bounded), each with its validation verdict."""

    records: deque[Record] = field(default_factory=lambda: deque(maxlen=2000))

    def add(self, request: web.Request, body: Any) -> Record:
        record = Record(request.path, request.headers.get("x-request-id"), body)
        self.records.append(record)
        return record

    async def handler(self, request: web.Request) -> web.Response:
        wanted = request.query.get("request_id")
        out = [r.as_json() for r in self.records if wanted is None or r.request_id == wanted]
        return web.json_response(out)


RECORDER = web.AppKey("recorder", Recorder)


class PageCache:
    """Which full pages of prompts were seen: the cached-token count the engine reports."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._seen: set[int] = set()

    def pages(self, ids: list[int]) -> list[tuple[int, int | None, list[int]]]:
        """(hash, parent hash, tokens) of each full page of ``ids``, chained."""
        out: list[tuple[int, int | None, list[int]]] = []
        parent: int | None = None
        for start in range(0, len(ids) - len(ids) % self.page_size, self.page_size):
            tokens = ids[start : start + self.page_size]
            raw = hashlib.sha256(f"{parent}:{tokens}".encode()).digest()
            page = int.from_bytes(raw[:8], "big") >> 1
            out.append((page, parent, tokens))
            parent = page
        return out

    def admit(self, ids: list[int]) -> tuple[int, list[tuple[int, int | None, list[int]]]]:
        """(cached tokens, pages newly stored) for a prompt about to be served."""
        pages = self.pages(ids)
        hits = 0
        for page, _, _ in pages:
            if page not in self._seen:
                break
            hits += 1
        new = [p for p in pages if p[0] not in self._seen]
        self._seen.update(p[0] for p in new)
        return hits * self.page_size, new


async def image_digest(session: aiohttp.ClientSession, url: str) -> str:
    """Load an image as an engine would (a ``data:`` URL or HTTP), check it is one, and name it.

    ``StandinError`` when it cannot be fetched or is not an image.
    """
    if url.startswith("data:"):
        try:
            data = base64.b64decode(url.split(",", 1)[1], validate=True)
        except (IndexError, ValueError) as exc:
            raise StandinError(f"Failed to load image: malformed data URL ({exc})") from exc
    else:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    raise StandinError(f"Failed to load image from {url}: HTTP {resp.status}")
                data = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise StandinError(f"Failed to load image from {url}: {exc!r}") from exc
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError) as exc:
        raise StandinError(f"Failed to load image: not an image ({exc})") from exc
    return digest(data)


def base_args(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model-path", required=True, help="tokenizer and chat template")
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--lora", action="append", default=[], help="an adapter name it serves")
    p.add_argument("--ready-file", required=True)
    return p


async def serve(app: web.Application, host: str, port: int, ready_file: str) -> web.AppRunner:
    """Serve ``app`` and write ``{"url": ...}`` to ``ready_file`` once listening."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = next(a for a in runner.addresses if isinstance(a, tuple))
    url = f"http://{host}:{bound[1]}"
    Path(ready_file).write_text(json.dumps({"url": url}) + "\n")
    return runner


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def serve_until_signal(
    app: web.Application,
    args: argparse.Namespace,
    server: Any,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Serve ``app`` (with ``/health`` and the request recorder) until SIGTERM or SIGINT;
    ``server.session`` is the stand-in's HTTP client meanwhile (images are fetched with it)."""
    app[RECORDER] = Recorder()
    app.router.add_get("/health", health)
    app.router.add_get("/_standin/requests", app[RECORDER].handler)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with aiohttp.ClientSession() as session:
        server.session = session
        runner = await serve(app, args.host, args.port, args.ready_file)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            if on_stop is not None:
                with contextlib.suppress(Exception):  # best effort: the process is ending
                    on_stop()
