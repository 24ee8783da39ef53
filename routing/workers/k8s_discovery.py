"""The gateway's sidecars found in Kubernetes: pods by label selector, listed then watched.

``--discover-k8s-selector`` is the alternative to ``--sidecar``/``--sidecar-file`` in a
cluster. The gateway lists the pods of one namespace that carry the labels, then watches them
(``?watch=1&resourceVersion=...``). A pod that is Running, Ready, not being deleted and has a
pod IP is a sidecar at ``http://<podIP>:<port>``, the port being the sidecar container's port
of that name (``kvsidecar`` by default; the injected container declares it) or a number. Its
URL goes through ``SidecarDiscovery.add``/``remove``, the path ``--sidecar-file`` takes, so its
workers join and leave exactly as a file's would.

Pods, not EndpointSlices: the engine pods need no Service for this, the opt-in label that
the injection webhook keys on selects them directly, the sidecar's port is resolved by name
from each pod's own spec, and the readiness is the same one EndpointSlices report (the pod's
``Ready`` condition). The RBAC it needs: ``get``/``list``/``watch`` on ``pods`` in the
namespace.

The API server is reached directly with aiohttp: in a pod through ``KUBERNETES_SERVICE_HOST``
/``_PORT`` with the service account's token and CA
(``/var/run/secrets/kubernetes.io/serviceaccount/``), or at ``--k8s-api-url`` (``kubectl
proxy``, tests). The token is re-read on every (re)connect: projected tokens rotate. An
expired watch (410 Gone) relists; any other API failure is logged and retried with backoff,
and the workers found so far stay: a blip of the API never drops the fleet. A relist only
removes the pods that are really gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from routing.config import RouterConfig
from routing.workers.discovery import SidecarDiscovery

__all__ = ["K8sApiAccess", "K8sDiscoveryMetrics", "K8sPodDiscovery", "pod_sidecar_url"]

log = structlog.get_logger(component="k8s_discovery")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_RETRY_S = 0.5
_MAX_RETRY_S = 30.0
_WATCH_TIMEOUT_S = 300  # the server ends a watch after this long; we watch again
_QUIET_CLOSE_S = 1.0  # a watch closed sooner than this with no event: wait before the next


class K8sApiError(RuntimeError):
    """The API server answered with an error (other than an expired watch)."""


@dataclass(frozen=True, slots=True)
class K8sApiAccess:
    """Where the API server is and how to authenticate to it."""

    url: str
    namespace: str
    token_file: Path | None = None
    ca_file: Path | None = None
    insecure: bool = False

    @classmethod
    def resolve(
        cls,
        cfg: RouterConfig,
        env: Mapping[str, str] | None = None,
        sa_dir: Path = SERVICE_ACCOUNT_DIR,
    ) -> K8sApiAccess:
        """The flags, filled in from the pod's environment; ``ValueError`` says what's missing."""
        env = os.environ if env is None else env
        url = cfg.k8s_api_url
        if url is None:
            host = env.get("KUBERNETES_SERVICE_HOST")
            if not host:
                raise ValueError(
                    "--discover-k8s-selector: not running in a Kubernetes pod "
                    "(KUBERNETES_SERVICE_HOST is unset); give --k8s-api-url, e.g. "
                    "http://127.0.0.1:8001 for `kubectl proxy`"
                )
            host = f"[{host}]" if ":" in host else host
            url = f"https://{host}:{env.get('KUBERNETES_SERVICE_PORT', '443')}"
        for flag, path in (("--k8s-token-file", cfg.k8s_token_file),
                           ("--k8s-ca-file", cfg.k8s_ca_file)):
            if path is not None and not path.is_file():
                raise ValueError(f"{flag} {path} is not a readable file")
        token_file = cfg.k8s_token_file or _existing(sa_dir / "token")
        ca_file = cfg.k8s_ca_file or _existing(sa_dir / "ca.crt")
        namespace = cfg.discover_k8s_namespace
        if namespace is None:
            ns_file = sa_dir / "namespace"
            if not ns_file.is_file():
                raise ValueError(
                    "--discover-k8s-selector: give --discover-k8s-namespace (there is no "
                    f"{ns_file} to take the gateway's own namespace from)"
                )
            namespace = ns_file.read_text().strip()
        return cls(url.rstrip("/"), namespace, token_file, ca_file, cfg.k8s_insecure)

    def ssl_context(self) -> ssl.SSLContext | bool:
        """What aiohttp verifies the server with (``True``: the system's CAs)."""
        if self.insecure:
            return False
        if self.ca_file is not None:
            return ssl.create_default_context(cafile=str(self.ca_file))
        return True

    def headers(self) -> dict[str, str]:
        if self.token_file is None:
            return {}
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}


def _existing(path: Path) -> Path | None:
    return path if path.is_file() else None


def pod_sidecar_url(pod: Mapping[str, Any], port: str) -> str | None:
    """``http://<podIP>:<port>`` of a pod that serves now; ``None`` for one that does not.

    ``port`` is a container port's name (looked up in the pod's containers, native sidecars
    among its init containers included) or a number.
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not ip:
        return None
    conditions = status.get("conditions") or []
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return None
    number = _port_number(pod.get("spec") or {}, port)
    if number is None:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{number}"


def _port_number(spec: Mapping[str, Any], port: str) -> int | None:
    if port.isdigit():
        return int(port)
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        for p in container.get("ports") or []:
            if p.get("name") == port and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    return None


class K8sDiscoveryMetrics:
    """Discovery's health, exported on the gateway's ``/metrics``: alert on a watch that
    stays down, or errors that keep coming (the fleet is then frozen as last seen)."""

    def __init__(self) -> None:
        self.lists = 0
        self.watch_expired = 0
        self.api_errors = 0
        self.watching = False
        self.sidecars = 0

    def collect(self) -> Iterator[Metric]:
        p = "kvsidecar_gateway_k8s_"
        yield CounterMetricFamily(p + "lists", "Pod lists from the Kubernetes API (the first, "
                                  "and one after each expired or failed watch)", value=self.lists)
        yield CounterMetricFamily(p + "watch_expired", "Pod watches that expired (410 Gone)",
                                  value=self.watch_expired)
        yield CounterMetricFamily(p + "api_errors", "Failed Kubernetes API calls, retried "
                                  "with backoff; the sidecars found so far stay",
                                  value=self.api_errors)
        yield GaugeMetricFamily(p + "watching", "1 while a pod watch is open",
                                value=int(self.watching))
        yield GaugeMetricFamily(p + "sidecars", "Sidecars followed from ready pods",
                                value=self.sidecars)


class K8sPodDiscovery:
    """Follows the pods of ``selector`` in ``access.namespace``: their sidecars join and leave
    through ``sidecars``."""

    def __init__(
        self,
        sidecars: SidecarDiscovery,
        access: K8sApiAccess,
        selector: str,
        port: str = "kvsidecar",
        *,
        retry_s: float = _RETRY_S,
        max_retry_s: float = _MAX_RETRY_S,
        watch_timeout_s: int = _WATCH_TIMEOUT_S,
    ) -> None:
        self.sidecars = sidecars
        self.access = access
        self.selector = selector
        self.port = port
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.watch_timeout_s = watch_timeout_s
        self._pods: dict[str, str | None] = {}  # pod name -> its sidecar URL while it serves
        self._following: dict[str, str] = {}  # URL -> pod name, as handed to ``sidecars``
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._pods_url = f"{access.url}/api/v1/namespaces/{access.namespace}/pods"
        self._ssl = access.ssl_context()  # now: a bad CA file stops the gateway at start
        self.metrics = K8sDiscoveryMetrics()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"k8s pods {self.selector}")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    @property
    def sidecar_urls(self) -> list[str]:
        return list(self._following)

    # --- list, then watch ---------------------------------------------------------------

    async def _run(self) -> None:
        connector = aiohttp.TCPConnector(ssl=self._ssl)
        self._session = aiohttp.ClientSession(connector=connector)
        log.info("k8s_discovery_started", api=self.access.url, namespace=self.access.namespace,
                 selector=self.selector, port=self.port)
        backoff = self.retry_s
        while True:
            try:
                version: str | None = await self._list()
                backoff = self.retry_s
                while version is not None:
                    started = time.monotonic()
                    version, events = await self._watch(version)
                    if events or time.monotonic() - started >= _QUIET_CLOSE_S:
                        backoff = self.retry_s
                        continue
                    # closed at once with nothing said: a proxy or a restarting server; pace
                    log.info("k8s_watch_closed", retry_in_s=backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.max_retry_s)
            except (K8sApiError, aiohttp.ClientError, TimeoutError, OSError,
                    ValueError, KeyError, TypeError, AttributeError) as exc:  # + bad bodies
                self.metrics.api_errors += 1
                log.warning("k8s_api_error", error=str(exc) or repr(exc), retry_in_s=backoff,
                            sidecars_kept=len(self._following))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_retry_s)

    async def _list(self) -> str:
        """Every matching pod now; returns the list's resourceVersion to watch from."""
        assert self._session is not None
        params = {"labelSelector": self.selector}
        timeout = aiohttp.ClientTimeout(total=30)
        async with self._session.get(self._pods_url, params=params, timeout=timeout,
                                     headers=self.access.headers()) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise K8sApiError(f"listing pods: HTTP {resp.status}: {_status_message(body)}")
        pod_list = json.loads(body)
        self._pods = {}
        for pod in pod_list.get("items") or []:
            self._see(pod)
        version = str(pod_list["metadata"]["resourceVersion"])
        self.metrics.lists += 1
        await self._apply()
        log.info("k8s_pods_listed", pods=len(self._pods), sidecars=len(self._following),
                 resource_version=version)
        return version

    async def _watch(self, version: str) -> tuple[str | None, int]:
        """Apply the pods' changes until the watch ends: the version to watch from next
        (``None`` when the watch expired, 410 Gone, and the pods must be listed again) and
        how many events came."""
        assert self._session is not None
        params = {"labelSelector": self.selector, "watch": "1", "resourceVersion": version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(self.watch_timeout_s)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10,
                                        sock_read=self.watch_timeout_s + 30)
        async with self._session.get(self._pods_url, params=params, timeout=timeout,
                                     headers=self.access.headers()) as resp:
            if resp.status == 410:
                self.metrics.watch_expired += 1
                log.info("k8s_watch_expired", resource_version=version)
                return None, 0
            if resp.status != 200:
                body = await resp.read()
                raise K8sApiError(f"watching pods: HTTP {resp.status}: {_status_message(body)}")
            self.metrics.watching = True
            try:
                return await self._follow(resp, version)
            finally:
                self.metrics.watching = False

    async def _follow(self, resp: aiohttp.ClientResponse, version: str) -> tuple[str | None, int]:
        """The watch's events, applied as they come."""
        events = 0
        async for event in _json_lines(resp.content):
            events += 1
            kind = event.get("type")
            obj = event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    self.metrics.watch_expired += 1
                    log.info("k8s_watch_expired", resource_version=version,
                             message=obj.get("message"))
                    return None, events
                raise K8sApiError(f"watch error: {obj.get('code')}: {obj.get('message')}")
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind in ("ADDED", "MODIFIED"):
                self._see(obj)
            elif kind == "DELETED":
                self._pods.pop(str(obj["metadata"]["name"]), None)
            else:  # BOOKMARK: only the version moves
                continue
            await self._apply()
        return version, events

    # --- pods -> sidecars ---------------------------------------------------------------

    def _see(self, pod: Mapping[str, Any]) -> None:
        name = str(pod["metadata"]["name"])
        url = pod_sidecar_url(pod, self.port)
        if url is None and _serving(pod) and self._pods.get(name, "") is not None:
            log.warning("k8s_pod_without_port", pod=name, port=self.port)
        self._pods[name] = url

    async def _apply(self) -> None:
        """Hand ``sidecars`` the URLs of the serving pods: new ones added, gone ones removed."""
        wanted = {url: name for name, url in self._pods.items() if url is not None}
        for url, name in wanted.items():
            if url not in self._following:
                self._following[url] = name
                self.sidecars.add(url)
                log.info("k8s_sidecar_added", pod=name, url=url)
        for url in [u for u in self._following if u not in wanted]:
            name = self._following.pop(url)
            log.info("k8s_sidecar_removed", pod=name, url=url)
            await self.sidecars.remove(url)
        self.metrics.sidecars = len(self._following)


def _serving(pod: Mapping[str, Any]) -> bool:
    """Ready with an IP (whatever its ports)."""
    return pod_sidecar_url(pod, "1") is not None


async def _json_lines(stream: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The watch's events, one JSON object a line (lines of any length)."""
    buffer = b""
    async for chunk in stream.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield dict(json.loads(line))
    if buffer.strip():
        yield dict(json.loads(buffer))


def _status_message(body: bytes) -> str:
    """The message of a ``Status`` body, or the start of whatever came."""
    try:
        status = json.loads(body)
        return str(status.get("message") or status)[:300]
    except (ValueError, AttributeError):
        return body[:300].decode(errors="replace")
