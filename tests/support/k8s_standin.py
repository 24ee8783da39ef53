"""A stand-in for the Kubernetes API server's pods endpoint, for the gateway's discovery.

Kubernetes is not ours, so a stand-in is right: this serves
``GET /api/v1/namespaces/{ns}/pods?labelSelector=...`` in Kubernetes' wire shapes, a
``PodList`` (with ``metadata.resourceVersion``) and, with ``watch=1``, a chunked stream of
JSON lines ``{"type": "ADDED|MODIFIED|DELETED|BOOKMARK|ERROR", "object": ...}`` from a
``resourceVersion`` on, ending after ``timeoutSeconds``. A watch from a version older than
the kept history gets what the API server sends: HTTP 200 and one ``ERROR`` event whose
object is a ``Status`` with code 410 (Expired). Requests without the bearer token get a 401
``Status``.

The test drives it: ``put`` (create or replace a pod: ADDED or MODIFIED), ``delete``,
``drop_watches`` (the connection cut, as a load balancer or an API server restart does),
``expire`` (history compacted: the next watch gets 410), ``fail_next`` (the API answering
500 for a while); ``requests`` records every request (``list`` or ``watch``, with its
resourceVersion and status); ``version`` is the latest resourceVersion.

Only equality selectors (``k=v``, ``k==v``, ``k!=v``) and existence (``k``) are understood.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["K8sApiStandin", "make_pod"]


def make_pod(
    name: str,
    ip: str,
    port: int,
    *,
    labels: dict[str, str],
    namespace: str = "default",
    ready: bool = True,
    port_name: str = "kvsidecar",
) -> dict[str, Any]:
    """A Pod as the API server returns it: an engine container and the injected sidecar."""
    conditions = [
        {"type": t, "status": "True" if (ready or t == "PodScheduled") else "False",
         "lastTransitionTime": "2026-12-01T00:00:00Z"}
        for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
    ]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                     "labels": dict(labels), "creationTimestamp": "2026-12-01T00:00:00Z"},
        "spec": {
            "containers": [
                {"name": "engine", "image": "lmsysorg/sglang:v0.5.23",
                 "ports": [{"name": "http", "containerPort": 30000, "protocol": "TCP"}]},
                {"name": "kvsidecar", "image": "ghcr.io/kvsidecar/kvsidecar-gateway:latest",
                 "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}]},
            ],
        },
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                   "hostIP": "10.0.0.1", "conditions": conditions},
    }


def _selects(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term not in labels:
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


@dataclass
class Request:
    kind: str  # list | watch
    resource_version: str | None
    status: int


@dataclass
class K8sApiStandin:
    namespace: str = "default"
    token: str | None = None
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    _version: int = 100
    _history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)
    _oldest: int = 100  # a watch from a version below this gets 410
    _failures: int = 0
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    _generation: int = 0  # drop_watches() ends the watches of earlier generations

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        return app

    # --- driven by the test -------------------------------------------------------------

    async def put(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        kind = "MODIFIED" if name in self.pods else "ADDED"
        await self._record(kind, pod)
        self.pods[name] = pod

    async def delete(self, name: str) -> None:
        pod = self.pods.pop(name)
        await self._record("DELETED", pod)

    async def drop_watches(self) -> None:
        async with self._changed:
            self._generation += 1
            self._changed.notify_all()

    async def expire(self) -> None:
        """Compact the history (and move the version on): watches are cut, the next one from
        any version seen so far gets 410 Gone."""
        self._version += 1
        self._oldest = self._version
        self._history.clear()
        await self.drop_watches()

    def fail_next(self, count: int) -> None:
        """Answer the next ``count`` requests with 500."""
        self._failures = count

    @property
    def version(self) -> str:
        """The latest resourceVersion: where a client that has seen every change is."""
        return str(self._version)

    def count(self, kind: str, status: int = 200) -> int:
        return sum(r.kind == kind and r.status == status for r in self.requests)

    async def _record(self, kind: str, pod: dict[str, Any]) -> None:
        self._version += 1
        pod = json.loads(json.dumps(pod))
        pod["metadata"]["resourceVersion"] = str(self._version)
        self._history.append((self._version, kind, pod))
        if kind != "DELETED":
            self.pods[pod["metadata"]["name"]] = pod
        async with self._changed:
            self._changed.notify_all()

    # --- the endpoint -------------------------------------------------------------------

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        watch = request.query.get("watch") in ("1", "true")
        version = request.query.get("resourceVersion")
        kind = "watch" if watch else "list"
        if self.token is not None and \
                request.headers.get("Authorization") != f"Bearer {self.token}":
            self.requests.append(Request(kind, version, 401))
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        if self._failures > 0:
            self._failures -= 1
            self.requests.append(Request(kind, version, 500))
            return web.json_response(
                _status(500, "InternalError", "etcdserver: request timed out"), status=500)
        if request.match_info["ns"] != self.namespace:
            self.requests.append(Request(kind, version, 200))
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self._version)},
                                      "items": []})
        selector = request.query.get("labelSelector", "")
        self.requests.append(Request(kind, version, 200))
        if not watch:
            items = [p for p in self.pods.values() if _selects(selector, p["metadata"]["labels"])]
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self._version)},
                                      "items": items})
        return await self._watch(request, selector, int(version or self._version))

    async def _watch(self, request: web.Request, selector: str, since: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if since < self._oldest:
            status = _status(410, "Expired", f"too old resource version: {since} "
                             f"({self._oldest})")
            await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            return resp
        generation = self._generation
        timeout = float(request.query.get("timeoutSeconds", "300"))
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        sent = since
        while True:
            for version, kind, pod in list(self._history):
                if version > sent:
                    sent = version
                    if _selects(selector, pod["metadata"]["labels"]):
                        event = {"type": kind, "object": pod}
                        await resp.write(json.dumps(event).encode() + b"\n")
            async with self._changed:
                if self._generation != generation or loop.time() >= end:
                    break
                if not any(v > sent for v, _, _ in self._history):
                    try:
                        await asyncio.wait_for(self._changed.wait(), end - loop.time())
                    except TimeoutError:
                        break
            if self._generation != generation:
                break
        return resp
