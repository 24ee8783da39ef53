"""LeaderWorkerSets (how SGLang and LWS deploy multi-node and P/D serving): the sidecar goes
beside the leader, the pod that serves HTTP; kinds inject does not know are named, never
passed over. The webhook, given the leader's pod, makes the same change."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvsidecar.inject import inject_text
from kvsidecar.k8s_patch import InjectError, InjectOptions, plan_object, pod_spec_paths
from tests.support.inject_checks import check_injection, docs, webhook_patch

FIXTURES = Path(__file__).parent / "fixtures"
OPTS = InjectOptions(sidecar_image="registry.example/kvsidecar:0.1.0")
LWT = ("spec", "leaderWorkerTemplate")
FLOW = ('                      --host, 0.0.0.0, --port, "30000"]',)  # gains the flag in place


def _fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def _names(spec: dict[str, Any]) -> list[str]:
    return [c["name"] for c in spec["containers"]]


def _template(doc: dict[str, Any], which: str) -> dict[str, Any]:
    template: dict[str, Any] = doc["spec"]["leaderWorkerTemplate"][which]
    return template


def test_multinode_sglang_gets_its_sidecar_beside_the_leader() -> None:
    """LWS's SGLang example (TP over two pods): the leader template gains the sidecar on the
    leader's port and the engine's KV-event flag; the worker template and the Service pass
    through unchanged."""
    before = _fixture("lws-sglang-multinode.yaml")
    after = check_injection(before, OPTS)
    lws, service = docs(after)
    original_lws, original_service = docs(before)
    assert service == original_service
    assert _template(lws, "workerTemplate") == _template(original_lws, "workerTemplate")
    leader = _template(lws, "leaderTemplate")["spec"]
    assert _names(leader) == ["sglang-leader", "kvsidecar"]
    engine, sidecar = leader["containers"]
    assert "--kv-events-config" in engine["command"]
    assert sidecar["args"][:4] == ["--engine", "sglang", "--engine-url", "http://127.0.0.1:40000"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in sidecar["volumeMounts"]
    assert "# tensor parallel over both pods" in after


def test_pd_lws_pair_each_leader_announces_its_half() -> None:
    """SGLang's LWS P/D deployment: each LWS's leader gets a sidecar with the role its
    --disaggregation-mode gives; the workers, which serve no HTTP, get none."""
    after = check_injection(_fixture("lws-sglang-pd.yaml"), OPTS)
    for lws, role in zip(docs(after), ["prefill", "decode"], strict=True):
        leader = _template(lws, "leaderTemplate")["spec"]
        sidecar = leader["containers"][-1]
        assert sidecar["name"] == "kvsidecar"
        assert sidecar["args"][sidecar["args"].index("--role") + 1] == role
        assert "kvsidecar" not in _names(_template(lws, "workerTemplate")["spec"])


def test_a_single_pod_group_without_leader_template_uses_the_worker_template() -> None:
    """Without a leaderTemplate LWS builds the leader from workerTemplate: with one pod per
    group that template is the serving pod's, and it gets the sidecar."""
    after = check_injection(_fixture("lws-sglang-workers-only.yaml"), OPTS, flow=FLOW)
    (lws,) = docs(after)
    assert _names(_template(lws, "workerTemplate")["spec"]) == ["sglang", "kvsidecar"]
    assert pod_spec_paths(lws) == [(*LWT, "workerTemplate", "spec")]


def test_several_pods_from_the_worker_template_alone_are_refused_with_the_fix() -> None:
    """A group of two built from workerTemplate alone would put a sidecar on the rank that
    serves no HTTP: refused, saying to add a leaderTemplate."""
    two = _fixture("lws-sglang-workers-only.yaml").replace("size: 1", "size: 2")
    with pytest.raises(InjectError, match=r"LeaderWorkerSet/qwen.*2 pods.*leaderTemplate"):
        inject_text(two, OPTS)


def test_unknown_kinds_are_named() -> None:
    """A DisaggregatedSet (or any kind holding containers that inject does not know) is
    refused by kind and apiVersion; a kind holding no pods is listed as found."""
    with pytest.raises(InjectError, match=r"does not know kind DisaggregatedSet \(apiVersion "
                                          r"disaggregatedset\.x-k8s\.io/v1\).*webhook"):
        inject_text(_fixture("disaggregatedset-sglang.yaml"), OPTS)
    crd = "apiVersion: ray.io/v1\nkind: RayService\nmetadata: {name: r}\nspec:\n  x:\n" \
          "    template:\n      spec:\n        containers: [{name: a, image: b}]\n"
    with pytest.raises(InjectError, match=r"kind RayService \(apiVersion ray\.io/v1\)"):
        inject_text(crd, OPTS)
    service = "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {ports: [{port: 1}]}\n"
    with pytest.raises(InjectError, match=r"LeaderWorkerSet or List \(found: Service/s\)"):
        inject_text(service, OPTS)


def test_an_unknown_kind_beside_a_known_one_is_a_note() -> None:
    """In a file that also holds an injectable workload, the unknown kind is left as is,
    with a note naming it."""
    both = _fixture("lws-sglang-workers-only.yaml") + "---\n" + _fixture(
        "disaggregatedset-sglang.yaml"
    )
    result = inject_text(both, OPTS)
    assert result.patched == 1
    assert any("kind DisaggregatedSet" in m for m in result.messages)


@pytest.mark.parametrize("name", ["lws-sglang-multinode.yaml", "lws-sglang-pd.yaml"])
def test_the_webhook_patches_the_leader_pod_as_inject_patches_its_template(
    name: str, tmp_path: Path
) -> None:
    """The leader pod LWS creates from the leader template, sent to the webhook, comes back
    with the pod spec inject gives that template."""
    for original, injected in zip(docs(_fixture(name)),
                                  docs(check_injection(_fixture(name), OPTS)), strict=True):
        if original["kind"] != "LeaderWorkerSet":
            continue
        pod, response = webhook_patch(_template(original, "leaderTemplate"), OPTS, tmp_path)
        assert response["allowed"] is True, response
        assert pod["spec"] == _template(injected, "leaderTemplate")["spec"]


def test_plan_object_raises_for_what_inject_notes() -> None:
    """Without skip_no_engine (the webhook's way) an unknown kind is an error, not a note."""
    (dset,) = docs(_fixture("disaggregatedset-sglang.yaml"))
    with pytest.raises(InjectError, match="DisaggregatedSet"):
        plan_object(dset, OPTS)
    assert plan_object(dset, OPTS, skip_no_engine=True).skipped
