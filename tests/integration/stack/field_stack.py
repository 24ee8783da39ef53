"""One gateway → sidecar → engine stack per engine kind, and the client side of a request
through it: the reply assembled choice by choice, every body and chunk checked against
SGLang's response models on the way.

Engine kinds: ``refengine`` (the CPU reference engine, computing with its tiny model),
``sglang`` (``tests.support.sglang_standin``: SGLang 0.5.23's HTTP surface and request
models) and ``trtllm`` (``tests.support.trtllm_standin``: trtllm-serve's OpenAI surface).
The stand-ins serve one LoRA adapter, ``ad1``, and record every body they receive.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvsidecar.local_stack import EngineSpec, GatewaySpec, LocalStack, StackSpec
from tests.support.openai_shapes import check_error, check_reply, check_stream_chunk

__all__ = ["ADAPTER", "KINDS", "MODEL", "Assembled", "EngineStack", "Reply", "send", "start_stack"]

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "refengine" / "models" / "tiny"
KINDS = ("refengine", "sglang", "trtllm")
ADAPTER = "ad1"
_EVENTS = json.dumps({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                      "replay_endpoint": "tcp://127.0.0.1:*", "topic": "kv"})


@dataclass
class EngineStack:
    kind: str
    local: LocalStack
    engine_url: str
    url: str

    @property
    def records_bodies(self) -> bool:
        """Whether the engine is a stand-in that records what it receives."""
        return self.kind != "refengine"

    async def records(self, session: aiohttp.ClientSession, request_id: str) -> list[Any]:
        """What the engine received for ``request_id`` (path, body, validation verdict)."""
        url = f"{self.engine_url}/_standin/requests"
        async with session.get(url, params={"request_id": request_id}) as resp:
            assert resp.status == 200
            return list(await resp.json())

    def stop(self) -> None:
        self.local.stop()


def start_stack(kind: str, workdir: Path) -> EngineStack:
    """Engine, sidecar and gateway of ``kind``, each ready (ready files, never sleeps)."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    sidecar_args: tuple[str, ...] = ()
    if kind == "trtllm":
        # trtllm-serve selects adapters by id and checkpoint: the sidecar is told them
        checkpoint = workdir / ADAPTER
        checkpoint.mkdir(exist_ok=True)
        sidecar_args = ("--engine", "trtllm", "--block-size", "16",
                        "--lora-adapter", f"{ADAPTER}=1:{checkpoint}")
    if kind == "refengine":
        engine = EngineSpec(compute="torch", env=env, worker_ids=(f"{kind}-0",))
    else:
        engine = EngineSpec(kind=f"tests.support.{kind}_standin", env=env,
                            worker_ids=(f"{kind}-0",),
                            args=("--model-path", str(MODEL), "--served-model-name", "tiny",
                                  "--lora", ADAPTER), sidecar_args=sidecar_args)
    spec = StackSpec(
        engines=(engine,),
        gateways=(GatewaySpec(health_check_interval_s=0.5, wait_routable=False),),
        model_path=str(MODEL), events_config=_EVENTS,
    )
    local = LocalStack(spec, workdir).start()
    return EngineStack(kind, local, local.engines[0].url, local.url)


@dataclass
class Assembled:
    """One choice of a reply, whole or put together from its chunks."""

    content: str = ""
    reasoning: str = ""
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)  # name, arguments
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    choices: dict[int, Assembled] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    chunks: int = 0

    @property
    def only(self) -> Assembled:
        assert list(self.choices) == [0], self.choices
        return self.choices[0]

    @property
    def completion_tokens(self) -> int:
        assert self.usage is not None, "the reply carries no usage"
        return int(self.usage["completion_tokens"])


def _logprob_entries(logprobs: Any) -> list[Any]:
    if not isinstance(logprobs, dict):
        return []
    if isinstance(logprobs.get("content"), list):  # chat
        return list(logprobs["content"])
    return [{"token": t, "top_logprobs": top} for t, top in
            zip(logprobs.get("tokens") or [], logprobs.get("top_logprobs") or [],
                strict=False)]


def _take(reply: Reply, choice: dict[str, Any], chat: bool) -> None:
    one = reply.choices.setdefault(int(choice["index"]), Assembled())
    if chat:
        part = choice.get("message") or choice.get("delta") or {}
        one.content += part.get("content") or ""
        one.reasoning += part.get("reasoning_content") or ""
        for k, call in enumerate(part.get("tool_calls") or []):
            slot = one.tool_calls.setdefault(int(call.get("index", k)),
                                             {"name": "", "arguments": ""})
            fn = call.get("function") or {}
            slot["name"] = slot["name"] or fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
    else:
        one.content += choice.get("text") or ""
    one.logprobs += _logprob_entries(choice.get("logprobs"))
    if choice.get("finish_reason"):
        one.finish_reason = choice["finish_reason"]


async def send(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], request_id: str
) -> Reply:
    """POST ``body`` to the gateway (chat when it has messages) and check the reply's shape."""
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"x-request-id": request_id}
    async with session.post(url + path, json=body, headers=headers) as resp:
        reply = Reply(resp.status, {k.lower(): v for k, v in resp.headers.items()})
        if resp.status != 200:
            reply.error = check_error(await resp.json(content_type=None))
            return reply
        if not body.get("stream"):
            data = await resp.json()
            check_reply(data, chat)
            for choice in data["choices"]:
                _take(reply, choice, chat)
            reply.usage = data.get("usage")
            return reply
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line.strip() async for line in resp.content if line.startswith(b"data:")]
    assert events and events[-1] == b"data: [DONE]", events[-3:]
    for event in events[:-1]:
        chunk = json.loads(event[5:])
        assert "error" not in chunk, chunk
        check_stream_chunk(chunk, chat)
        reply.chunks += 1
        for choice in chunk["choices"]:
            _take(reply, choice, chat)
        if chunk.get("usage"):
            reply.usage = chunk["usage"]
    return reply
