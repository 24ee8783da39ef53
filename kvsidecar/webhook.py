"""``kvsidecar webhook``: the sidecar injection as a mutating admission webhook.

An HTTPS server (TLS 1.2+) that the API server calls with an ``admission.k8s.io/v1``
``AdmissionReview`` on ``POST /mutate`` for each Pod it creates. A Pod carrying the opt-in
label (``--label kvsidecar.io/inject=enabled``) gets the same edits ``kvsidecar inject``
makes (``kvsidecar.k8s_patch``), answered as a base64 JSON Patch; any other Pod, one that
already has the sidecar, and any other operation are allowed unchanged. A Pod that opted in
but cannot be patched (no engine container, an engine started by a shell script that lacks
the KV-event flags, with the exact flags to add) is denied with the reason, so it never
starts without the sidecar it asked for. A body that is not an
AdmissionReview is a 400 with an OpenAI-shaped error. ``GET /healthz`` answers 200;
``GET /metrics`` counts reviews by outcome.

Per pod, annotations override the webhook's flags: ``kvsidecar.io/container`` (the engine's
container), ``kvsidecar.io/engine`` (``sglang`` or ``trtllm``) and
``kvsidecar.io/store-capacity-bytes`` (a host-tier store, SGLang's HiCache backend on it).
``kvsidecar.io/role`` (the sidecar's P/D role, otherwise read off the engine's flags) is read
by the plan itself, so ``kvsidecar inject`` honours it on pod templates too.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import ssl
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from adapters.base import EngineKind
from kvcore.errors import OpenAIError
from kvcore.logs import configure_logging
from kvsidecar.inject_options import InjectOptions
from kvsidecar.k8s_edits import json_patch
from kvsidecar.k8s_patch import InjectError, describe, plan_object
from kvsidecar.webhook_config import WebhookConfig, build_parser

__all__ = ["WebhookConfig", "admit", "build_parser", "main"]

ADMISSION_VERSION = "admission.k8s.io/v1"
CONTAINER_ANNOTATION = "kvsidecar.io/container"
ENGINE_ANNOTATION = "kvsidecar.io/engine"
STORE_ANNOTATION = "kvsidecar.io/store-capacity-bytes"

log = structlog.get_logger(component="webhook")


class BadReview(ValueError):
    """A request body that is not an AdmissionReview we can answer."""


def admit(review: Any, cfg: WebhookConfig) -> tuple[dict[str, Any], str]:
    """The AdmissionReview answering ``review``, and the outcome (for logs and metrics).

    Raises ``BadReview`` when ``review`` is not an ``admission.k8s.io/v1`` AdmissionReview
    with a request uid.
    """
    request = _request(review)
    uid = request["uid"]
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    pod = request.get("object")
    outcome = _skip_reason(request, pod, cfg)
    if outcome is None:
        assert isinstance(pod, dict)
        try:
            plan = plan_object(pod, _pod_options(pod, cfg.inject))
        except ValueError as exc:  # InjectError, a bad annotation
            return _denied(uid, str(exc)), "denied"
        else:
            if plan.edits:
                patch = orjson.dumps(json_patch(plan.edits))
                response["patchType"] = "JSONPatch"
                response["patch"] = base64.b64encode(patch).decode()
                outcome = "patched"
            else:
                outcome = "already_injected"
            if plan.notes:
                response["warnings"] = list(plan.notes)
    return _review(response), outcome


def _denied(uid: str, message: str) -> dict[str, Any]:
    status = {"code": 400, "reason": "BadRequest", "message": f"kvsidecar: {message}"}
    return _review({"uid": uid, "allowed": False, "status": status})


def _review(response: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": ADMISSION_VERSION, "kind": "AdmissionReview", "response": response}


def _request(review: Any) -> dict[str, Any]:
    if not isinstance(review, dict):
        raise BadReview("the body must be a JSON AdmissionReview object")
    if review.get("apiVersion") != ADMISSION_VERSION or review.get("kind") != "AdmissionReview":
        raise BadReview(
            f"expected apiVersion {ADMISSION_VERSION} kind AdmissionReview, got "
            f"apiVersion {review.get('apiVersion')!r} kind {review.get('kind')!r}"
        )
    request = review.get("request")
    if not isinstance(request, dict):
        raise BadReview("the AdmissionReview has no request object")
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        raise BadReview("the AdmissionReview's request has no uid")
    return request


def _skip_reason(request: dict[str, Any], pod: Any, cfg: WebhookConfig) -> str | None:
    """Why this request passes unchanged (``None``: it is one to patch)."""
    kind = request.get("kind")
    if not isinstance(kind, dict) or kind.get("kind") != "Pod" or kind.get("group", "") != "":
        return "not_a_pod"
    if request.get("operation") != "CREATE":
        return "not_create"
    if not isinstance(pod, dict):
        return "no_object"
    meta = pod.get("metadata")
    labels = meta.get("labels") if isinstance(meta, dict) else None
    if not isinstance(labels, dict) or labels.get(cfg.label_key) != cfg.label_value:
        return "not_opted_in"
    return None


def _pod_options(pod: dict[str, Any], opts: InjectOptions) -> InjectOptions:
    annotations = pod["metadata"].get("annotations") or {}
    if not isinstance(annotations, dict):
        raise InjectError("metadata.annotations must be an object")
    for key in (CONTAINER_ANNOTATION, ENGINE_ANNOTATION, STORE_ANNOTATION):
        if not isinstance(annotations.get(key, ""), str):
            raise InjectError(f"annotation {key} must be a string")
    container = annotations.get(CONTAINER_ANNOTATION)
    engine = annotations.get(ENGINE_ANNOTATION)
    if engine is not None and engine not in {e.value for e in EngineKind}:
        raise InjectError(
            f"annotation {ENGINE_ANNOTATION} must be one of "
            f"{', '.join(e.value for e in EngineKind)}, got {engine!r}"
        )
    store = annotations.get(STORE_ANNOTATION)
    return replace(
        opts,
        container=container or opts.container,
        engine=EngineKind(engine) if engine else opts.engine,
        store_capacity_bytes=store or opts.store_capacity_bytes,
    )


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reviews = Counter(
            "kvsidecar_webhook_reviews", "AdmissionReviews answered, by outcome",
            ["outcome"], registry=self.registry,
        )


class Webhook:
    """The HTTPS server: ``/mutate``, ``/healthz``, ``/metrics``."""

    def __init__(self, cfg: WebhookConfig) -> None:
        self.cfg = cfg
        self.metrics = _Metrics()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_post("/mutate", self._mutate)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _mutate(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            review = json.loads(body)
        except ValueError as exc:
            return self._bad(f"the body is not JSON: {exc}", len(body))
        try:
            answer, outcome = admit(review, self.cfg)
        except BadReview as exc:
            return self._bad(str(exc), len(body))
        except Exception as exc:  # a bug of ours must deny this pod, not fail the API call
            log.exception("review_failed", body_bytes=len(body))
            answer, outcome = _denied(review["request"]["uid"], f"internal error: {exc!r}"), "error"
        self.metrics.reviews.labels(outcome).inc()
        req = review["request"]
        pod = req.get("object") if isinstance(req.get("object"), dict) else {}
        log.info(
            "review_answered", uid=req["uid"], outcome=outcome,
            namespace=req.get("namespace"), pod=describe(pod),
            message=answer["response"].get("status", {}).get("message"),
        )
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    def _bad(self, message: str, size: int) -> web.Response:
        self.metrics.reviews.labels("bad_request").inc()
        log.warning("review_refused", reason=message, body_bytes=size)
        error = OpenAIError(400, message, code="bad_admission_review")
        return web.Response(status=400, body=error.body(), content_type="application/json")

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--tls-cert/--tls-key cannot be loaded: {exc}") from exc
    return context


async def serve(cfg: WebhookConfig) -> None:
    context = tls_context(cfg.tls_cert, cfg.tls_key)
    runner = web.AppRunner(Webhook(cfg).app(), access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port, ssl_context=context)
        await site.start()
        port = next(
            (a[1] for a in runner.addresses if isinstance(a, tuple) and len(a) >= 2), cfg.port
        )
        url = f"https://{cfg.host}:{port}"
        log.info("webhook_started", url=url, label=f"{cfg.label_key}={cfg.label_value}")
        if cfg.ready_file is not None:
            tmp = cfg.ready_file.with_name(cfg.ready_file.name + ".tmp")
            tmp.write_text(json.dumps({"url": url}) + "\n")
            tmp.replace(cfg.ready_file)
        await stop.wait()
    finally:
        await runner.cleanup()
        log.info("webhook_stopped")


def main(argv: list[str] | None = None) -> int:
    cfg = WebhookConfig.from_args(argv)
    configure_logging(cfg.log_level.value)
    log.info(
        "config_loaded", host=cfg.host, port=cfg.port, label=f"{cfg.label_key}={cfg.label_value}",
        sidecar_image=cfg.inject.sidecar_image, sidecar_port=cfg.inject.sidecar_port,
    )
    try:
        asyncio.run(serve(cfg))
    except ValueError as exc:
        log.error("webhook_failed", error=str(exc))
        return 1
    return 0
