"""Start a disaggregated stack from real processes: engines by role, sidecars, gateways."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvsidecar.launch import ManagedProcess
from tests.support.gateway import routable  # noqa: F401 (the disagg tests import it here)
from tests.support.polling import eventually

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "refengine" / "models" / "tiny"
EVENTS = json.dumps(
    {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "topic": "kv",
    }
)


@dataclass(frozen=True)
class Replica:
    """One engine to start: its role, and (prefill/decode) the page-store directory name."""

    role: str
    store: str = "pages"
    extra: tuple[str, ...] = ()
    engine_disagg: bool = True  # False: an aggregated engine behind a prefill/decode sidecar
    # "file": prefill/decode engines share a page-store directory; "sidecar": each engine's
    # hook is its own sidecar's block store, and decode sidecars pull (--kv-handoff transfer)
    hook: str = "file"
    sidecar_extra: tuple[str, ...] = ()


@dataclass
class PdStack:
    tmp: Path
    procs: list[ManagedProcess] = field(default_factory=list)
    sidecars: dict[str, str] = field(default_factory=dict)  # worker id → sidecar URL
    engines: dict[str, str] = field(default_factory=dict)  # worker id → engine URL

    def start_replicas(self, replicas: Sequence[Replica], compute: str = "sim",
                       speedup: str = "4") -> None:
        engines = []
        for i, r in enumerate(replicas):
            args = ["refengine", "--compute", compute, "--model-path", str(MODEL), "--port", "0",
                    "--kv-events-config", EVENTS, *r.extra]
            if compute == "sim":
                args += ["--speedup", speedup]
            if r.role != "agg" and r.engine_disagg:
                args += ["--disaggregation-mode", r.role, *self._hook(r, i)]
            proc = ManagedProcess.start(f"engine-{r.role}-{i}", args, workdir=self.tmp)
            self.procs.append(proc)
            engines.append((r, i, proc))
        sidecars = []
        for r, i, proc in engines:
            proc.wait_ready(120)
            worker_id = f"{r.role}-{i}"
            self.engines[worker_id] = proc.url
            store: list[str] = []
            if r.hook == "sidecar":
                # Raw blocks of one page each: the tiny model's KV is 2 KiB per token (fp32).
                store = ["--store-block-bytes", str(16 * 2048), "--store-capacity-bytes",
                         "32MiB", "--store-socket", str(self._socket(i)), "--kv-handoff",
                         "transfer"]
            sc = ManagedProcess.start(
                f"sidecar-{worker_id}",
                ["sidecar", "--engine-url", proc.url, "--worker-id", worker_id, "--role", r.role,
                 "--port", "0", *store, *r.sidecar_extra],
                workdir=self.tmp,
            )
            self.procs.append(sc)
            sidecars.append((worker_id, sc))
        for worker_id, sc in sidecars:
            self.sidecars[worker_id] = sc.wait_ready(60)[0]["url"]

    def _socket(self, index: int) -> Path:
        return self.tmp / f"store-{index}.sock"

    def _hook(self, r: Replica, index: int) -> list[str]:
        if r.hook == "file":
            config: dict[str, Any] = {"file_path": str(self.tmp / r.store)}
            return ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
                    json.dumps(config)]
        config = {"backend_name": "kvsidecar", "module_path": "adapters.sglang.hicache",
                  "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1,
                  "socket": str(self._socket(index)), "model_id": "tiny"}
        return ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config",
                json.dumps(config)]

    def start_gateway(self, name: str, *flags: str, workers: Sequence[str] | None = None) -> str:
        chosen = self.sidecars if workers is None else {w: self.sidecars[w] for w in workers}
        sidecar_flags = [f for url in chosen.values() for f in ("--sidecar", url)]
        proc = ManagedProcess.start(
            name,
            ["routing", "--port", "0", "--model-path", str(MODEL), "--health-check-interval-s",
             "0.5", "--seed", "1", *flags, *sidecar_flags],
            workdir=self.tmp,
        )
        self.procs.append(proc)
        return str(proc.wait_ready(60)[0]["url"])

    @contextlib.contextmanager
    def engine_stopped(self, worker_id: str) -> Iterator[None]:
        """SIGSTOP the worker's engine for the block, SIGCONT on leaving: the requests it
        holds stay held, whatever the machine's speed, and its sidecar and the gateways run
        on. Keep the block short: the sidecar's health probe gives up after 5 s."""
        proc = next(p for p in self.procs if p.name == f"engine-{worker_id}")
        os.killpg(proc.proc.pid, signal.SIGSTOP)  # its own session: the group is the engine
        try:
            yield
        finally:
            os.killpg(proc.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    prompt: str,
    max_tokens: int,
    *,
    stream: bool = False,
    chat: bool = False,
) -> tuple[int, str, dict[str, Any]]:
    """(status, x-kvsidecar-worker, body) with a streamed reply folded into one body:
    ``{"text", "finish_reason", "usage", "chunks", "error"}`` (an in-stream error event)."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "stream": stream,
                            "temperature": 0, "ignore_eos": True}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(url + path, json=body) as resp:
        worker = resp.headers.get("x-kvsidecar-worker", "")
        if not stream or resp.status != 200:
            return resp.status, worker, await resp.json(content_type=None)
        lines = [line.strip() async for line in resp.content if line.startswith(b"data:")]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[5:]) for line in lines[:-1]]
    text, finish, usage, error = "", None, None, None
    for c in chunks:
        error = c.get("error") or error
        for choice in c.get("choices", ()):
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content") or ""
            text += piece
            finish = choice.get("finish_reason") or finish
        usage = c.get("usage") or usage
    return 200, worker, {"text": text, "finish_reason": finish, "usage": usage,
                         "chunks": len(chunks), "error": error}


def answer_text(body: dict[str, Any]) -> str:
    """The generated text of a non-streamed completion or chat body."""
    choice = body["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


async def capacity_known(
    session: aiohttp.ClientSession, url: str, worker_id: str, blocks: int
) -> None:
    """Poll the gateway's /v1/workers until it knows ``worker_id``'s KV capacity: a sidecar
    reports it on its status, up to a load-report interval after its stream is up, and
    until then the gateway finds room on that worker for any request."""

    async def known() -> bool:
        async with session.get(f"{url}/v1/workers") as resp:
            workers = (await resp.json())["workers"]
        seen = {w["worker_id"]: w["capacity_blocks"] for w in workers}
        assert seen.get(worker_id) == blocks, f"capacity {seen} at {url}"
        return True

    await eventually(known, f"{worker_id}'s capacity at {url}", 30.0, 0.05)


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """One sample of the gateway's /metrics (exact name with labels)."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


async def metric_reaches(session: aiohttp.ClientSession, url: str, name: str, value: float,
                         timeout_s: float = 4.0) -> None:
    """Poll the gateway's /metrics until ``name`` is ``value`` (by default for 4 s: less
    than an engine may stay stopped, see ``PdStack.engine_stopped``)."""

    async def reached() -> bool:
        seen = await metric(session, url, name)
        assert seen == value, f"{name} is {seen:g}"
        return True

    await eventually(reached, f"{name} = {value:g} at {url}", timeout_s, 0.02)
