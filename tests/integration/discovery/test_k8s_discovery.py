"""The gateway finding its sidecars in Kubernetes: a real gateway process, real sidecars and
reference engines, and a stand-in API server (``tests.support.k8s_standin``) whose pods name
those sidecars. Workers are checked where a client sees them, at the gateway's /v1/workers.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import (
    DEFAULT_MODEL,
    EngineSpec,
    GatewaySpec,
    K8sDiscovery,
    LocalStack,
    StackSpec,
)
from tests.support.gateway import routable
from tests.support.k8s_standin import K8sApiStandin, make_pod
from tests.support.polling import eventually
from tests.support.stacks import own_gateways
from tests.support.tls import write_self_signed

ROOT = Path(__file__).resolve().parents[3]
MODEL = DEFAULT_MODEL
PODS = ("llm-a", "llm-b")
SELECTOR = "app=llm,kvsidecar.io/inject=enabled"
LABELS = {"app": "llm", "kvsidecar.io/inject": "enabled", "pod-template-hash": "5d8f"}
NAMESPACE = "serving"
TOKEN = "sa-token-1"


@dataclass
class Replicas:
    """Reference engines (simulated compute), each with its sidecar: the pods' contents."""

    stack: LocalStack
    ports: dict[str, int]  # worker id (= pod name) -> sidecar port


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    spec = StackSpec(engines=(EngineSpec(replicas=2, worker_ids=PODS),), gateways=())
    with LocalStack(spec, tmp_path_factory.mktemp("k8s-replicas")) as stack:
        yield Replicas(stack, {name: int(urlsplit(stack.sidecar_urls[name]).port or 0)
                               for name in PODS})


@dataclass
class Cluster:
    api: K8sApiStandin
    api_port: int
    gateway: ManagedProcess
    replicas: Replicas

    def pod(self, name: str, *, ready: bool = True) -> dict[str, object]:
        return make_pod(name, "127.0.0.1", self.replicas.ports[name], labels=LABELS,
                        namespace=NAMESPACE, ready=ready)

    def log_events(self, event: str) -> list[dict[str, object]]:
        lines = self.gateway.log_path.read_text().splitlines()
        return [json.loads(line) for line in lines if f'"{event}"' in line]


def _serving_cert(cert: Path, key: Path) -> None:
    """A self-signed certificate for 127.0.0.1: the API server's, and its own CA."""
    write_self_signed(cert, key, "kubernetes.test")


@pytest.fixture
async def cluster(replicas: Replicas, tmp_path: Path) -> AsyncIterator[Cluster]:
    api = K8sApiStandin(namespace=NAMESPACE, token=TOKEN)
    # served over TLS as the real one is; the gateway finds it as in a pod, from
    # KUBERNETES_SERVICE_HOST/PORT, and verifies it with the CA file
    cert, key = tmp_path / "apiserver.crt", tmp_path / "apiserver.key"
    _serving_cert(cert, key)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    runner = web.AppRunner(api.app(), shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    port = runner.addresses[0][1]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    await api.put(make_pod("llm-a", "127.0.0.1", replicas.ports["llm-a"], labels=LABELS,
                           namespace=NAMESPACE))
    # a pod of the namespace without the opt-in label: never a worker
    await api.put(make_pod("other", "127.0.0.1", 1, labels={"app": "llm"},
                           namespace=NAMESPACE))
    discovery = K8sDiscovery(SELECTOR, NAMESPACE, ca_file=str(cert),
                             token_file=str(token_file))
    spec = GatewaySpec(workers="k8s", k8s=discovery, health_check_interval_s=0.5, env={
        "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)})
    try:
        with own_gateways(replicas.stack) as stack:
            # off the loop: the API server answers on it
            (part,) = await asyncio.to_thread(stack.add_gateway, spec)
            assert isinstance(part.proc, ManagedProcess)
            yield Cluster(api, port, part.proc, replicas)
    finally:
        await runner.cleanup()


async def _workers(session: aiohttp.ClientSession, url: str) -> set[str]:
    async with session.get(f"{url}/v1/workers") as resp:
        return {w["worker_id"] for w in (await resp.json())["workers"]}


async def _until_workers(session: aiohttp.ClientSession, url: str, expected: set[str]) -> None:
    async def listed() -> bool:
        seen = await _workers(session, url)
        assert seen == expected, seen
        return True

    await eventually(listed, f"the workers {sorted(expected)}", timeout_s=20, interval_s=0.05)


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The gateway's unlabelled samples."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    samples = (line.split() for line in text.splitlines() if line and line[0] != "#")
    return {s[0]: float(s[1]) for s in samples if len(s) == 2}


async def _chat(session: aiohttp.ClientSession, url: str, text: str) -> tuple[int, str]:
    body = {"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": text}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-kvsidecar-worker", "")


@pytest.mark.slow
async def test_pods_join_and_leave_as_they_come_go_and_turn_unready(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    url = cluster.gateway.url
    (started,) = cluster.log_events("k8s_discovery_started")
    assert started["api"] == f"https://127.0.0.1:{cluster.api_port}"  # in-cluster, TLS
    await _until_workers(session, url, {"llm-a"})
    await routable(session, url, 1)
    assert await _chat(session, url, "hello from the first pod") == (200, "llm-a")

    # a new pod, not ready yet, then ready
    await cluster.api.put(cluster.pod("llm-b", ready=False))
    await cluster.api.put(cluster.pod("llm-b"))
    await _until_workers(session, url, {"llm-a", "llm-b"})

    # the first one turns unready: it leaves; requests go to the other one
    await cluster.api.put(cluster.pod("llm-a", ready=False))
    await _until_workers(session, url, {"llm-b"})
    await routable(session, url, 1)
    assert await _chat(session, url, "now only the second pod serves") == (200, "llm-b")

    # ready again, then the second pod deleted
    await cluster.api.put(cluster.pod("llm-a"))
    await _until_workers(session, url, {"llm-a", "llm-b"})
    await cluster.api.delete("llm-b")
    await _until_workers(session, url, {"llm-a"})
    assert cluster.api.count("watch", 401) == cluster.api.count("list", 401) == 0
    assert all(e["pod"] != "other" for e in cluster.log_events("k8s_sidecar_added"))


@pytest.mark.slow
async def test_watch_dropped_expired_or_failing_loses_no_worker(
    cluster: Cluster, session: aiohttp.ClientSession
) -> None:
    url = cluster.gateway.url
    await cluster.api.put(cluster.pod("llm-b"))
    await _until_workers(session, url, {"llm-a", "llm-b"})
    await routable(session, url, 2)

    def since(start: int) -> list[tuple[str, str | None, int]]:
        return [(r.kind, r.resource_version, r.status) for r in cluster.api.requests[start:]]

    # the connection cut: the gateway watches again from where it was (it has seen every
    # change: both pods are workers; by its first list or by a watch, whichever came first)
    start = len(cluster.api.requests)
    version = cluster.api.version
    await cluster.api.drop_watches()

    async def watching_again() -> bool:
        assert ("watch", version, 200) in since(start), since(start)
        return True

    await eventually(watching_again, "a new watch from the same version", 20, 0.05)

    # history compacted: the next watch is answered 410 Gone, the pods listed again, and
    # watched from the list's version
    start = len(cluster.api.requests)
    await cluster.api.expire()

    async def relisted() -> bool:
        seen = since(start)
        assert ("list", None, 200) in seen, seen
        after = seen[seen.index(("list", None, 200)):]
        assert any(kind == "watch" and status == 200 for kind, _, status in after), seen
        assert cluster.log_events("k8s_watch_expired"), "no k8s_watch_expired in the log"
        return True

    await eventually(relisted, "a relist and a new watch after 410 Gone", 20, 0.05)

    # the API failing for a while: errors logged, retried, the fleet kept
    start = len(cluster.api.requests)
    cluster.api.fail_next(3)
    await cluster.api.drop_watches()

    async def recovered() -> bool:
        seen = since(start)
        assert sum(status == 500 for _, _, status in seen) == 3, seen
        assert seen[-1][0] == "watch" and seen[-1][2] == 200, seen
        assert cluster.log_events("k8s_api_error"), "no k8s_api_error in the log"
        return True

    await eventually(recovered, "the discovery to recover from 500s", 30, 0.05)
    assert await _workers(session, url) == {"llm-a", "llm-b"}
    assert cluster.log_events("k8s_sidecar_removed") == []
    assert cluster.log_events("sidecar_removed") == []
    status, _ = await _chat(session, url, "still served after the blips")
    assert status == 200
    metrics = await _metrics(session, url)
    assert metrics["kvsidecar_gateway_k8s_api_errors_total"] >= 3
    assert metrics["kvsidecar_gateway_k8s_watch_expired_total"] == 1
    assert metrics["kvsidecar_gateway_k8s_lists_total"] >= 3  # first, after 410, after 500s
    assert metrics["kvsidecar_gateway_k8s_sidecars"] == 2
    assert metrics["kvsidecar_gateway_k8s_watching"] == 1

    # and changes made after all that still arrive
    await cluster.api.delete("llm-a")
    await _until_workers(session, url, {"llm-b"})


@pytest.mark.slow  # real processes, seconds a test
def test_outside_a_cluster_the_gateway_says_what_to_give(tmp_path: Path) -> None:
    """No KUBERNETES_SERVICE_HOST and no --k8s-api-url: exit 2 naming the flag."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    result = subprocess.run(
        [sys.executable, "-m", "routing", "--port", "0", "--model-path", str(MODEL),
         "--discover-k8s-selector", SELECTOR, "--discover-k8s-namespace", NAMESPACE],
        capture_output=True, text=True, env=env, timeout=60, check=False, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert "--k8s-api-url" in result.stderr and "KUBERNETES_SERVICE_HOST" in result.stderr
