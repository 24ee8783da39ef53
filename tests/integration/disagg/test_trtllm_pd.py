"""TensorRT-LLM prefill/decode through ``disaggregated_params``, end to end: stand-in
trtllm-serve processes (``trtllm_pd_standin``: a context and a generation server that move
the "KV" between themselves, as TensorRT-LLM's transceiver does), our sidecars
(``--engine trtllm``) and a gateway (``--pd-mode auto``)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec
from tests.integration.disagg.pd_stack import MODEL, answer_text, complete, metric, routable
from tests.integration.disagg.trtllm_pd_standin import signature
from tests.support.polling import eventually
from tests.support.stacks import gateway

ROOT = Path(__file__).resolve().parents[3]
KEY = "disagg-secret"
KEY_ENV = "KVSIDECAR_TRTLLM_DISAGG_AUTH_KEY"
STANDIN = "tests.integration.disagg.trtllm_pd_standin"
ROLES = {"agg": "aggregated", "prefill": "context", "decode": "generation"}


@dataclass
class TrtStack:
    tmp: Path
    local: LocalStack | None = None
    engines: dict[str, str] = field(default_factory=dict)
    sidecars: dict[str, str] = field(default_factory=dict)

    def start(self, workers: Sequence[tuple[str, tuple[str, ...]]]) -> None:
        """Stand-in engines, then a sidecar beside each (worker ids ``<role>-<i>``)."""
        env = {"PYTHONPATH": str(ROOT), KEY_ENV: KEY}
        spec = StackSpec(
            engines=tuple(
                EngineSpec(role=role,  # type: ignore[arg-type]  # a key of ROLES
                           kind=STANDIN, env=env, worker_ids=(f"{role}-{i}",),
                           args=("--role", ROLES[role], "--auth-key", KEY, *extra),
                           sidecar_args=("--engine", "trtllm", "--block-size", "16"))
                for i, (role, extra) in enumerate(workers)
            ),
            gateways=(), model_path=str(MODEL),
        )
        self.local = LocalStack(spec, self.tmp).start()
        self.engines = {p.worker_id: p.url for p in self.local.engines}
        self.sidecars = {p.worker_id: p.url for p in self.local.sidecars}

    def gateway(self, name: str, workers: Sequence[str], *flags: str) -> str:
        assert self.local is not None
        return gateway(self.local, name, *flags, workers=workers)

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()


async def records(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(f"{url}/_standin/requests") as resp:
        return list(await resp.json())


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[TrtStack]:
    s = TrtStack(tmp_path)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.slow
async def test_legs_carry_disaggregated_params_and_the_client_gets_one_answer(
    stack: TrtStack, session: aiohttp.ClientSession
) -> None:
    """The context engine gets the request as context_only, the generation engine the same
    request with the context's disaggregated_params verbatim (generation_only, signed), and
    the client one answer equal to aggregated serving's, in every shape."""
    stack.start([("agg", ()), ("prefill", ()), ("decode", ())])
    pd = stack.gateway("gateway-pd", ["prefill-1", "decode-2"])
    agg = stack.gateway("gateway-agg", ["agg-0"], "--pd-mode", "off")
    await routable(session, pd, 2)
    await routable(session, agg, 1)
    text = "cache1 token2 prefix3 block4 engine5 gateway6 replica7 memory8 " * 5
    cases = [(False, False), (True, False), (False, True), (True, True)]
    for stream, chat in cases:
        s1, w1, b1 = await complete(session, agg, text, 9, stream=stream, chat=chat)
        s2, w2, b2 = await complete(session, pd, text, 9, stream=stream, chat=chat)
        assert (s1, w1, s2, w2) == (200, "agg-0", 200, "prefill-1,decode-2")
        if stream:
            assert (b2["text"], b2["finish_reason"]) == (b1["text"], b1["finish_reason"])
            assert b2["chunks"] == b1["chunks"]  # one stream: the first token once, at the top
            assert b2["error"] is None
        else:
            assert answer_text(b2) == answer_text(b1)
        assert b2["usage"]["completion_tokens"] == b1["usage"]["completion_tokens"] == 9
        assert b2["usage"]["prompt_tokens"] == b1["usage"]["prompt_tokens"]

    plain = [r["body"] for r in await records(session, stack.engines["agg-0"])]
    ctx = await records(session, stack.engines["prefill-1"])
    gen = await records(session, stack.engines["decode-2"])
    assert len(plain) == len(ctx) == len(gen) == len(cases)
    assert not [r for r in ctx + gen if "error" in r]
    for (stream, _), body, c, g in zip(cases, plain, ctx, gen, strict=True):
        leg = {k: v for k, v in body.items() if k != "stream_options"}
        assert c["body"] == {**leg, "stream": False,
                             "disaggregated_params": {"request_type": "context_only"}}
        params = {**c["answered"], "request_type": "generation_only"}
        usage = {"stream_options": {"include_usage": True, "continuous_usage_stats": False}}
        assert g["body"] == {**leg, "stream": True, **usage, "disaggregated_params": params}
        assert g["auth"] == signature(KEY, params)
        assert c["body"]["prompt"] == body["prompt"] and stream == body["stream"]

    async def stored_without_errors() -> bool:
        async with session.get(stack.sidecars["prefill-1"] + "/metrics") as resp:
            lines = (await resp.text()).splitlines()
        stored = [x for x in lines if x.startswith("kvsidecar_adapter_blocks_total{")
                  and 'outcome="stored"' in x]
        errors = [x for x in lines if x.startswith("kvsidecar_adapter_decode_errors_total{")]
        assert not errors, errors
        return bool(stored) and float(stored[0].split()[-1]) > 0

    # The context engine's V2 events (hex hashes) reached the index through its sidecar.
    await eventually(stored_without_errors, "the prefill sidecar to normalize V2 events")


@pytest.mark.slow
async def test_a_lost_context_fails_the_transfer_and_reruns_aggregated(
    stack: TrtStack, session: aiohttp.ClientSession
) -> None:
    """A generation engine that cannot receive the KV answers 500 before any chunk: with the
    fallback policy the gateway re-runs the request aggregated, with fail a 502
    kv_transfer_failed naming the engine's reason."""
    stack.start([("agg", ()), ("prefill", ("--drop-kv",)), ("decode", ())])
    fallback = stack.gateway("gateway-fallback", ["agg-0", "prefill-1", "decode-2"],
                             "--kv-load-failure-policy", "fallback")
    fail = stack.gateway("gateway-fail", ["prefill-1", "decode-2"],
                         "--kv-load-failure-policy", "fail")
    await routable(session, fallback, 3)
    await routable(session, fail, 2)
    text = "block4 engine5 cache1 token2 prefix3 gateway6 " * 6
    status, worker, body = await complete(session, fallback, text, 6, stream=True)
    assert (status, worker) == (200, "agg-0")
    assert body["usage"]["completion_tokens"] == 6 and body["error"] is None
    status, _, body = await complete(session, fail, text, 6)
    assert status == 502 and body["error"]["code"] == "kv_transfer_failed"
    assert "KV cache transfer failed" in body["error"]["message"]
    name = 'kvsidecar_gateway_kv_transfer_failures_total{policy="%s"}'
    assert await metric(session, fallback, name % "fallback") == 1
    assert await metric(session, fail, name % "fail") == 1
    assert os.environ.get(KEY_ENV) is None  # the key reached the sidecars only
