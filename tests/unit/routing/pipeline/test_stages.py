"""The pipeline's stages on their own: the record, the relay, aggregated placement, what a
leg sends, and admission of a bad request."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import orjson
from structlog.testing import capture_logs

from kvcore import BlockHasher
from kvcore.requests import Handoff
from kvcore.stream import WorkerStatus
from routing.config import RouterMode, WorkerAddress
from routing.http.client import UpstreamPool
from routing.http.server import HttpRequest, ServerConnection
from routing.metrics import GatewayMetrics
from routing.pipeline.admission import Busy
from routing.pipeline.admit import admit
from routing.pipeline.context import PipelineContext
from routing.pipeline.legs import Leg, LegTarget
from routing.pipeline.place import HOLDER_BUSY, place_aggregated
from routing.pipeline.record import RequestRecord
from routing.pipeline.relay import Relay
from routing.placement.kv_router import KvRouter
from routing.placement.policies import make_policy
from routing.placement.refusal import Refusal
from routing.placement.scorer import Placement, Reason, TierOverlap
from routing.prompt.openai_api import Endpoint, parse_request
from routing.prompt.preparer import PreparedPrompt, PromptPreparer
from routing.workers.registry import Worker, WorkerKind, WorkerRegistry

BS = 16


class Wire(asyncio.Transport):
    """The client's socket: keeps what the gateway writes."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


class Handler:
    def handle(self, conn: ServerConnection, request: HttpRequest) -> None:
        """Requests are driven by the test itself."""


def client() -> tuple[ServerConnection, Wire]:
    conn = ServerConnection(Handler(), 1 << 20)
    wire = Wire()
    conn.connection_made(wire)
    return conn, wire


def record(*workers: str, cached: int = 0) -> RequestRecord:
    rec = RequestRecord("k-1", b"rid-1", "/v1/chat/completions", 40, 100.0)
    if workers:
        rec.placement = Placement(workers[0], 0.0, TierOverlap(cached))
        rec.worker_ids = workers
    return rec


class TestRecord:
    def test_headers_name_every_worker_and_the_cached_blocks(self) -> None:
        """A pair's reply names prefill and decode workers and the prefill's overlap."""
        assert record("p-1", "d-2", cached=2).headers() == (
            b"x-request-id: rid-1\r\nx-kvsidecar-worker: p-1,d-2\r\n"
            b"x-kvsidecar-cached-blocks: 2\r\n"
        )

    def test_finish_counts_the_worker_and_the_predicted_cache(self) -> None:
        """A success credits its worker with requests, prompt and predicted cached tokens."""
        m = GatewayMetrics()
        rec = record("w0", cached=2)
        rec.events, rec.t_first, rec.t_last = 3, 100.1, 100.3
        rec.finish(200, m, BS, log_line=False)
        assert m.responses == {("/v1/chat/completions", 200): 1}
        assert m.worker_requests == {"w0": 1} and m.worker_prompt_tokens == {"w0": 40}
        assert m.predicted_cached_tokens == 32 and m.worker_predicted_cached_tokens == {"w0": 32}
        assert m.completion_tokens == 3 and m.itl.counts[-1] + sum(m.itl.counts[:-1]) == 1

    def test_a_failure_is_counted_but_credits_no_worker(self) -> None:
        """A 5xx counts as a response and nothing else."""
        m = GatewayMetrics()
        record("w0", cached=2).finish(502, m, BS, log_line=False)
        assert m.responses == {("/v1/chat/completions", 502): 1} and m.worker_requests == {}

    def test_the_canonical_log_line(self) -> None:
        """One request_completed line with the worker, cached blocks and latency."""
        with capture_logs() as logs:
            record("w0", cached=1).finish(200, GatewayMetrics(), BS, log_line=True)
        (line,) = [e for e in logs if e["event"] == "request_completed"]
        assert (line["worker_id"], line["cached_blocks"], line["status"]) == ("w0", 1, 200)


class TestRelay:
    def test_chunked_stream_counts_events_and_usage(self) -> None:
        """An SSE reply without a length is re-chunked; events and streamed usage counted."""
        conn, wire = client()
        m = GatewayMetrics()
        relay = Relay(conn, record("w0"), m, include_usage=True)
        relay.head(200, b"text/event-stream", None)
        usage = (b'data: {"usage":{"prompt_tokens":40,'
                 b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n')
        assert relay.body([b"data: {}\n\n", b"data: {}\n\n"]) == 2
        assert relay.body([usage]) == 1
        relay.complete()
        head, _, body = bytes(wire.out).partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head and b"cache-control: no-cache" in head
        assert b"x-kvsidecar-worker: w0" in head
        assert body.endswith(b"0\r\n\r\n") and body.startswith(b"a\r\ndata: {}\n\n\r\n")
        assert m.actual_cached_tokens == 32 and m.worker_actual_cached_tokens == {"w0": 32}

    def test_sized_body_passes_through_and_its_usage_is_read(self) -> None:
        """A reply with a length keeps it; its usage is read at the end."""
        conn, wire = client()
        m = GatewayMetrics()
        relay = Relay(conn, record("w0"), m, include_usage=False)
        body = b'{"usage":{"prompt_tokens":40,"completion_tokens":5}}'
        relay.head(200, b"application/json", len(body))
        assert relay.body([body]) == 0
        relay.complete()
        assert bytes(wire.out).endswith(b"\r\n\r\n" + body)
        assert b"content-length: %d" % len(body) in wire.out
        assert m.completion_tokens == 5 and m.usage_prompt_tokens == 40


def context(*workers: Worker, cap: int | None = None,
            mode: RouterMode = RouterMode.LEAST_LOADED) -> PipelineContext:
    router = KvRouter(block_size=BS)
    registry = WorkerRegistry(on_capacity=router.load.set_capacity)
    for worker in workers:
        registry.add(worker)
    policy = make_policy(mode, router, random.Random(0))
    return PipelineContext(
        router=router,
        policy=policy,
        prompts=PromptPreparer(None, None, BlockHasher(BS), hash_prompts=False,
                               max_model_len=None),
        workers=registry,
        upstream=UpstreamPool(4, 1.0),
        metrics=GatewayMetrics(),
        pd=None,
        spawn=asyncio.ensure_future,  # type: ignore[arg-type]
        in_flight={},
        model_names=lambda: ["m"],
        busy=None if cap is None else Busy(max_in_flight=cap),
        admission=None,
        sessions=None,
        forwarded_headers=(b"traceparent",),
        log_requests=False,
    )


def plain(worker_id: str, port: int = 9000) -> Worker:
    return Worker(worker_id, WorkerAddress.parse(f"http://127.0.0.1:{port}"))


class TestPlace:
    def prompt(self, ctx: PipelineContext):  # type: ignore[no-untyped-def]
        req = parse_request(Endpoint.COMPLETIONS, b'{"model":"m","prompt":"hi"}')
        return ctx.prompts.prepare(req)

    def test_the_policy_picks_a_routable_worker_not_tried(self) -> None:
        """Placement skips the workers a request already failed on."""
        a, b = plain("a"), plain("b", 9001)
        ctx = context(a, b)
        placed = place_aggregated(ctx, self.prompt(ctx), {"a"})
        assert not isinstance(placed, Refusal) and placed[0] is b

    def test_a_followed_owner_placement_goes_there_while_eligible(self) -> None:
        """Released from its hold by its owner's placement, a new prompt goes to that worker,
        however the scorer here ranks it; not when it was tried or is at its cap."""
        a, b = plain("a"), plain("b", 9001)
        ctx = context(a, b)
        ctx.router.dispatch("r1", Placement("b", 0.0, TierOverlap()), [], 4000)  # b: loaded
        placed = place_aggregated(ctx, self.prompt(ctx), set(), follow="b")
        assert not isinstance(placed, Refusal) and placed[0] is b
        placed = place_aggregated(ctx, self.prompt(ctx), {"b"}, follow="b")
        assert not isinstance(placed, Refusal) and placed[0] is a
        ctx = context(a, b, cap=1)
        ctx.router.dispatch("r1", Placement("b", 0.0, TierOverlap()), [], 10)
        placed = place_aggregated(ctx, self.prompt(ctx), set(), follow="b")
        assert not isinstance(placed, Refusal) and placed[0] is a

    def test_refusals_say_why(self) -> None:
        """No worker: 503; every one tried: 502; every one at the cap: 429."""
        ctx = context()
        assert place_aggregated(ctx, self.prompt(ctx), set()) == Refusal(
            503, "no healthy worker is available", "service_unavailable", retry_after_s=1)
        a = plain("a")
        ctx = context(a)
        refused = place_aggregated(ctx, self.prompt(ctx), {"a"})
        assert isinstance(refused, Refusal) and refused.status == 502
        ctx = context(a, cap=1)
        ctx.router.dispatch("r1", Placement("a", 0.0, TierOverlap()), [], 10)
        refused = place_aggregated(ctx, self.prompt(ctx), set())
        assert isinstance(refused, Refusal) and refused.status == 429

    def test_keep_prefix_waits_for_a_busy_holder(self) -> None:
        """A busy worker holds the prompt's prefix and a free one none of it: asked to keep
        its prefix, the request is told the holder is busy; otherwise it goes to the free
        one (reason capacity). A prefix held by no one does not hold it back."""
        a, b = plain("a"), plain("b", 9001)
        ctx = context(a, b, cap=1, mode=RouterMode.KV)
        prefix = list(range(100, 108))
        ctx.router.dispatch("r1", Placement("a", 0.0, TierOverlap()), prefix, 8 * BS)
        prompt = PreparedPrompt(prefix, 8 * BS + 3, None, timed=False)
        assert place_aggregated(ctx, prompt, set(), keep_prefix=True) is HOLDER_BUSY
        placed = place_aggregated(ctx, prompt, set())
        assert not isinstance(placed, Refusal)
        assert placed[0] is b and placed[1].reason == Reason.CAPACITY
        cold = PreparedPrompt(list(range(200, 208)), 8 * BS, None, timed=False)
        placed = place_aggregated(ctx, cold, set(), keep_prefix=True)
        assert not isinstance(placed, Refusal) and placed[0] is b


class TestLegs:
    def target(self, body: bytes, token_ids: list[int] | None) -> LegTarget:
        req = parse_request(Endpoint.CHAT, body)
        return LegTarget(req, b"/v1/chat/completions", body, token_ids, b"rid-1",
                         b"authorization: Bearer k\r\n")

    def test_plain_workers_get_the_clients_bytes(self) -> None:
        """A plain engine is sent the request as the client sent it, with its headers."""
        body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
        worker = plain("a")
        leg = Leg(worker, Placement("a", 0.0, TierOverlap()), "k/a")
        leg.request = self.target(body, [1, 2]).for_worker(worker)
        wire = leg.wire(b"rid-1", b"authorization: Bearer k\r\n")
        assert wire.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:9000\r\n")
        assert b"authorization: Bearer k\r\n" in wire and wire.endswith(body)

    def test_sidecars_get_token_ids_and_a_pairs_handoff(self) -> None:
        """A sidecar gets the tokenized request; with a handoff, on the PD route."""
        body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
        worker = Worker("s", WorkerAddress.parse("http://127.0.0.1:9100"), WorkerKind.SIDECAR,
                        dp_rank=1)
        target = self.target(body, [5, 6, 7])
        path, sent = target.for_worker(worker)
        tokenized = orjson.loads(sent)
        assert path == b"/v1/kvsidecar/generate"
        assert tokenized["prompt_token_ids"] == [5, 6, 7] and tokenized["dp_rank"] == 1
        assert tokenized["max_tokens"] == 4 and tokenized["handoff"] is None
        path, sent = target.for_worker(worker, handoff=Handoff("http://p:1"))
        assert path == b"/v1/kvsidecar/pd/generate"
        assert orjson.loads(sent)["handoff"]["prefill_url"] == "http://p:1"

    def test_without_token_ids_a_sidecar_gets_the_clients_body(self) -> None:
        """No token ids (a batch of prompts, an endpoint the gateway does not tokenize): the
        sidecar is sent the client's body for its engine's OpenAI server, not refused."""
        worker = Worker("s", WorkerAddress.parse("http://127.0.0.1:9100"), WorkerKind.SIDECAR)
        body = b'{"model":"m","messages":[{"role":"user","content":"x"}]}'
        path, sent = self.target(body, None).for_worker(worker)
        tokenized = orjson.loads(sent)
        assert path == b"/v1/kvsidecar/generate" and tokenized["prompt_token_ids"] == []
        assert tokenized["openai"] == {"path": "/v1/chat/completions",
                                       "body": orjson.loads(body)}


def test_a_bad_request_is_answered_and_still_recorded() -> None:
    """Malformed JSON gets a 400 in OpenAI's shape and counts as a response."""
    ctx = context(plain("a"))
    conn, wire = client()
    request = HttpRequest(b"POST", b"/v1/completions", {}, b"{not json", True)
    admit(ctx, conn, request, Endpoint.COMPLETIONS, "k-1", b"rid-9")
    head, _, body = bytes(wire.out).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"x-request-id: rid-9" in head
    assert orjson.loads(body)["error"]["type"] == "invalid_request_error"
    assert ctx.metrics.responses == {("/v1/completions", 400): 1} and not ctx.in_flight


async def test_a_lora_adapter_named_in_the_model_gets_its_own_namespace(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """'<model>:<adapter>' is served when the model is: the blocks are hashed under the
    adapter's namespace, and a sidecar is told the adapter's name."""
    from routing.prompt.chat_template import ChatTemplate
    from routing.prompt.tokenizer import PromptTokenizer

    ctx = context(Worker("s", WorkerAddress.parse("http://127.0.0.1:9100"), WorkerKind.SIDECAR))
    ctx.workers.stream_up("s", "agg")
    ctx.workers.reported(WorkerStatus("s", 1, True))
    prompts = PromptPreparer(PromptTokenizer.from_model_dir(tiny_model_dir),
                             ChatTemplate.from_model_dir(tiny_model_dir), BlockHasher(BS),
                             hash_prompts=True, max_model_len=None)
    ctx = replace(ctx, prompts=prompts)
    text = "the same words " * 20
    hashes = {}
    for model in ("m", "m:adapter-1"):
        conn, _ = client()
        body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": text}]})
        admit(ctx, conn, HttpRequest(b"POST", b"/v1/chat/completions", {}, body, True),
              Endpoint.CHAT, f"k-{model}", b"rid")
        exchange = ctx.in_flight[f"k-{model}"]
        assert exchange.leg is not None
        sent = orjson.loads(exchange.leg.request[1])
        hashes[model] = list(exchange.prompt.block_hashes)
        assert (sent["model"], sent["lora_name"]) == (
            ("m", None) if model == "m" else ("m", "adapter-1"))
        exchange.on_client_lost()
    assert hashes["m"] and not set(hashes["m"]) & set(hashes["m:adapter-1"])


async def test_a_prompt_with_an_image_is_counted() -> None:
    """Image prompts are counted: they are hashed in their own media namespace."""
    ctx = context(plain("a"))
    ctx = replace(ctx, prompts=PromptPreparer(None, None, BlockHasher(BS), hash_prompts=True,
                                              max_model_len=None))
    for content in ("hi", [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]):
        conn, _ = client()
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})
        admit(ctx, conn, HttpRequest(b"POST", b"/v1/chat/completions", {}, body, True),
              Endpoint.CHAT, f"k-{len(ctx.in_flight)}", b"rid")
    assert ctx.metrics.media_requests == 1
    for exchange in list(ctx.in_flight.values()):
        exchange.on_client_lost()


async def test_a_burst_sharing_a_new_system_prompt_tokenizes_it_once(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Requests that all arrive before a new long system prompt is tokenized wait for the
    first one's tokenizing instead of each tokenizing it again; every one still sends
    exactly the ids of its own chat."""
    from routing.prompt.chat_template import ChatTemplate
    from routing.prompt.tokenizer import PromptTokenizer

    tasks: list[asyncio.Task[None]] = []

    def spawn(coro):  # type: ignore[no-untyped-def]
        tasks.append(asyncio.ensure_future(coro))
        return tasks[-1]

    # a sidecar that takes the requests and never answers: the legs stay in flight
    accepted: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    ctx = context(Worker("s", WorkerAddress.parse(f"http://127.0.0.1:{port}"),
                         WorkerKind.SIDECAR))
    ctx.workers.stream_up("s", "agg")
    ctx.workers.reported(WorkerStatus("s", 1, True))
    tokenizer = PromptTokenizer.from_model_dir(tiny_model_dir)
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    assert template is not None
    ctx = replace(ctx, spawn=spawn, prompts=PromptPreparer(
        tokenizer, template, BlockHasher(BS), hash_prompts=True, max_model_len=None))
    system = {"role": "system", "content": "a long and new system prompt " * 400}
    chats = [[system, {"role": "user", "content": f"question {i}"}] for i in range(5)]
    for i, messages in enumerate(chats):  # no await in between: all arrive before any is done
        body = orjson.dumps({"model": "m", "messages": messages})
        admit(ctx, client()[0], HttpRequest(b"POST", b"/v1/chat/completions", {}, body, True),
              Endpoint.CHAT, f"k-{i}", b"rid-%d" % i)
    assert ctx.metrics.tokenized_off_loop == 5 and len(tasks) == 5 and not ctx.in_flight
    await asyncio.gather(*tasks)
    assert ctx.metrics.tokenize_shared == 4 and len(ctx.tokenizing) == 0
    for i, messages in enumerate(chats):
        exchange = ctx.in_flight[f"k-{i}"]
        assert exchange.leg is not None
        sent = orjson.loads(exchange.leg.request[1])
        assert sent["prompt_token_ids"] == tokenizer.encode_full(template.render(messages), False)
        exchange.on_client_lost()  # cancels its leg's connecting, or closes its connection
    await asyncio.gather(*tasks, return_exceptions=True)
    for writer in accepted:
        writer.close()
        await writer.wait_closed()
    silent.close()
    await silent.wait_closed()
