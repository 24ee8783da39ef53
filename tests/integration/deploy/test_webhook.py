"""`kvsidecar webhook` as a real HTTPS process: AdmissionReview v1 requests as the API server
sends them for the Pods of the example Deployments, the JSON Patch it answers applied with an
independent implementation (`jsonpatch`) and the result checked against the Kubernetes schema.
"""

from __future__ import annotations

import base64
import copy
import json
import ssl
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import pytest
import yaml

from kvsidecar.launch import ManagedProcess
from tests.support.k8s import validate_object
from tests.support.tls import write_self_signed

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "deploy" / "examples"
IMAGE = "registry.example/kvsidecar:0.1.0"


@dataclass
class Webhook:
    proc: ManagedProcess
    cert: Path

    @property
    def url(self) -> str:
        return self.proc.url.replace("0.0.0.0", "127.0.0.1")


@pytest.fixture(scope="module")
def webhook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webhook]:
    """One webhook process for the module, on a free port, serving a fresh certificate."""
    tmp = tmp_path_factory.mktemp("webhook")
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    write_self_signed(cert, key, "kvsidecar-webhook.test")
    proc = ManagedProcess.start(
        "webhook",
        ["kvsidecar", "webhook", "--host", "127.0.0.1", "--port", "0",
         "--tls-cert", str(cert), "--tls-key", str(key),
         "--label", "kvsidecar.io/inject=enabled", "--sidecar-image", IMAGE],
        workdir=tmp,
    )
    try:
        proc.wait_ready(timeout_s=30)
        yield Webhook(proc, cert)
    finally:
        assert proc.stop() == 0, proc.log_tail()


@pytest.fixture
async def session(webhook: Webhook) -> AsyncIterator[aiohttp.ClientSession]:
    """A client that verifies the webhook's certificate, as the API server does."""
    tls = ssl.create_default_context(cafile=str(webhook.cert))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s:
        yield s


def _template_pod(example: str, kind: str) -> dict[str, Any]:
    """The Pod a controller creates from the example's ``kind`` (generateName, no name)."""
    workload = next(
        d for d in yaml.safe_load_all((EXAMPLES / example).read_text()) if d["kind"] == kind
    )
    template = copy.deepcopy(workload["spec"]["template"])
    meta = {**template["metadata"], "generateName": workload["metadata"]["name"] + "-",
            "namespace": workload["metadata"]["namespace"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def _review(pod: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    """An AdmissionReview v1 request as kube-apiserver sends one for a Pod."""
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": pod["metadata"].get("namespace", "default"),
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                         "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": pod,
            "oldObject": pod if operation == "UPDATE" else None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


async def _admit(
    session: aiohttp.ClientSession, webhook: Webhook, review: dict[str, Any]
) -> dict[str, Any]:
    async with session.post(f"{webhook.url}/mutate", json=review) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    assert body["response"]["uid"] == review["request"]["uid"]
    return dict(body["response"])


def _patched(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    patch = json.loads(base64.b64decode(response["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(pod, patch)
    return result


@pytest.mark.parametrize(
    ("example", "kind", "engine"),
    [("sglang-deployment.yaml", "Deployment", "sglang"),
     ("trtllm-deployment.yaml", "StatefulSet", "trtllm")],
)
async def test_example_pods_are_patched(
    session: aiohttp.ClientSession, webhook: Webhook, example: str, kind: str, engine: str
) -> None:
    """An opted-in Pod of each example gets the sidecar; the patched Pod is valid; sent
    again, it is allowed unchanged."""
    pod = _template_pod(example, kind)
    response = await _admit(session, webhook, _review(pod))
    patched = _patched(pod, response)
    validate_object(patched)
    names = [c["name"] for c in patched["spec"]["containers"]]
    assert names[-1] == "kvsidecar" and len(names) == 2
    sidecar = patched["spec"]["containers"][-1]
    assert sidecar["image"] == IMAGE and sidecar["args"][:2] == ["--engine", engine]
    assert patched["metadata"] == pod["metadata"]
    again = await _admit(session, webhook, _review(patched))
    assert again["allowed"] is True and "patch" not in again


async def test_pods_not_opted_in_pass(session: aiohttp.ClientSession, webhook: Webhook) -> None:
    """Without the label, with another value, or on UPDATE, a Pod is allowed unchanged."""
    pod = _template_pod("sglang-deployment.yaml", "Deployment")
    other = copy.deepcopy(pod)
    other["metadata"]["labels"]["kvsidecar.io/inject"] = "disabled"
    unlabeled = copy.deepcopy(pod)
    del unlabeled["metadata"]["labels"]
    for review in (_review(other), _review(unlabeled), _review(pod, "UPDATE")):
        response = await _admit(session, webhook, review)
        assert response["allowed"] is True
        assert "patch" not in response and "patchType" not in response


async def test_unpatchable_pod_is_denied(session: aiohttp.ClientSession, webhook: Webhook) -> None:
    """An opted-in Pod without an engine, with containers that are not a list, or with its
    engine behind `sh -c` lacking the KV-event flags, is denied with the reason; an
    annotation naming its container lets the first through, the flags the denial names
    the last."""
    pod = _template_pod("sglang-deployment.yaml", "Deployment")
    container = pod["spec"]["containers"][0]
    container.update(image="corp/llm:7", command=["python3", "-m", "corp.serve"])
    response = await _admit(session, webhook, _review(pod))
    assert response["allowed"] is False
    assert "sglang (corp/llm:7)" in response["status"]["message"]
    assert response["status"]["code"] == 400

    pod["metadata"]["annotations"].update(
        {"kvsidecar.io/container": "sglang", "kvsidecar.io/engine": "sglang"}
    )
    validate_object(_patched(pod, await _admit(session, webhook, _review(pod))))

    broken = _template_pod("sglang-deployment.yaml", "Deployment")
    broken["spec"]["containers"] = "sglang"
    response = await _admit(session, webhook, _review(broken))
    assert response["allowed"] is False
    assert "containers must be a list" in response["status"]["message"]

    shell = _template_pod("sglang-deployment.yaml", "Deployment")
    container = shell["spec"]["containers"][0]
    container["command"] = ["sh", "-c", " ".join([*container["command"], *container.pop("args")])]
    response = await _admit(session, webhook, _review(shell))
    assert response["allowed"] is False and "shell script" in response["status"]["message"]

    # Refused once: the script with the words the message gives is admitted, unchanged.
    words = response["status"]["message"].split("`: ", 1)[1].split(" (then", 1)[0]
    container["command"][2] += " " + words
    patched = _patched(shell, await _admit(session, webhook, _review(shell)))
    validate_object(patched)
    assert patched["spec"]["containers"][0]["command"] == container["command"]
    assert patched["spec"]["containers"][1]["name"] == "kvsidecar"


async def test_store_annotation(session: aiohttp.ClientSession, webhook: Webhook) -> None:
    """kvsidecar.io/store-capacity-bytes gives the pod a store and SGLang's HiCache backend;
    a size that is not one denies the pod, saying so."""
    pod = _template_pod("sglang-deployment.yaml", "Deployment")
    pod["metadata"]["annotations"]["kvsidecar.io/store-capacity-bytes"] = "8GiB"
    patched = _patched(pod, await _admit(session, webhook, _review(pod)))
    validate_object(patched)
    engine, sidecar = patched["spec"]["containers"]
    assert "--hicache-storage-backend-extra-config" in engine["args"]
    assert sidecar["args"][sidecar["args"].index("--store-capacity-bytes") + 1] == "8GiB"
    pod["metadata"]["annotations"]["kvsidecar.io/store-capacity-bytes"] = "lots"
    response = await _admit(session, webhook, _review(pod))
    assert response["allowed"] is False and "'lots'" in response["status"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "AdmissionReview object"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview",
                     "request": {"uid": "u"}}).encode(), "admission.k8s.io/v1beta1"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                     "request": {"object": {}}}).encode(), "no uid"),
    ],
)
async def test_malformed_reviews_are_400(
    session: aiohttp.ClientSession, webhook: Webhook, body: bytes, message: str
) -> None:
    """A body that is not an AdmissionReview v1 is a 400 saying what is wrong."""
    async with session.post(f"{webhook.url}/mutate", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert message in error["message"] and error["code"] == "bad_admission_review"


async def test_health_and_metrics(session: aiohttp.ClientSession, webhook: Webhook) -> None:
    """/healthz answers over TLS; /metrics counts reviews by outcome."""
    async with session.get(f"{webhook.url}/healthz") as resp:
        assert resp.status == 200
    await _admit(session, webhook, _review(_template_pod("trtllm-deployment.yaml",
                                                         "StatefulSet")))
    async with session.get(f"{webhook.url}/metrics") as resp:
        text = await resp.text()
    assert 'kvsidecar_webhook_reviews_total{outcome="patched"}' in text


async def test_plain_http_is_refused(webhook: Webhook) -> None:
    """The webhook speaks only TLS."""
    async with aiohttp.ClientSession() as plain:
        with pytest.raises(aiohttp.ClientError):
            async with plain.get(webhook.url.replace("https:", "http:") + "/healthz") as resp:
                await resp.read()
