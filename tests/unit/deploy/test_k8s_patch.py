"""The injection plan over parsed objects: where pod specs are, the JSON Patch it becomes."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest

from kvsidecar.k8s_edits import AddKey, Append, json_patch
from kvsidecar.k8s_patch import InjectOptions, plan_object, pod_spec_paths
from tests.support.k8s import validate_object


def _pod(**container: Any) -> dict[str, Any]:
    engine = {"name": "engine", "image": "nvcr.io/nvidia/tensorrt-llm/release:1.1.0",
              "command": ["trtllm-serve", "/m"], **container}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"containers": [engine]}}


class TestPodSpecs:
    @pytest.mark.parametrize(
        ("kind", "path"),
        [("Deployment", ("spec", "template", "spec")),
         ("StatefulSet", ("spec", "template", "spec")),
         ("DaemonSet", ("spec", "template", "spec")),
         ("Job", ("spec", "template", "spec")),
         ("CronJob", ("spec", "jobTemplate", "spec", "template", "spec")),
         ("Pod", ("spec",)),
         ("Service", None)],
    )
    def test_where_pod_specs_are(self, kind: str, path: tuple[str, ...] | None) -> None:
        """Each workload kind's pod spec is found where Kubernetes keeps it."""
        obj: dict[str, Any] = {"kind": kind}
        if path is not None:
            node = obj
            for key in path:
                node = node.setdefault(key, {})
        assert pod_spec_paths(obj) == ([] if path is None else [path])

    def test_list_items(self) -> None:
        """A List's pod specs are found item by item, skipping other kinds."""
        obj = {"kind": "List", "items": [{"kind": "Service"}, _pod()]}
        assert pod_spec_paths(obj) == [("items", 1, "spec")]


class TestJsonPatch:
    def test_ops_and_escaping(self) -> None:
        """Appends end in '/-', new keys name the key; '~' and '/' are escaped."""
        edits = [Append(("spec", "containers"), {"name": "x"}),
                 AddKey(("metadata", "annotations"), "a/b~c", "v")]
        assert json_patch(edits) == [
            {"op": "add", "path": "/spec/containers/-", "value": {"name": "x"}},
            {"op": "add", "path": "/metadata/annotations/a~1b~0c", "value": "v"},
        ]

    def test_existing_lists_are_appended_missing_ones_created(self) -> None:
        """A Pod with volumes but an engine without volumeMounts: the volumes are appended,
        the engine's volumeMounts created once, holding both new mounts."""
        pod = _pod()
        pod["spec"]["volumes"] = [{"name": "m", "emptyDir": {}}]
        plan = plan_object(pod, InjectOptions())
        ops = json_patch(plan.edits)
        paths = [op["path"] for op in ops]
        assert paths.count("/spec/volumes/-") == 2
        assert paths.count("/spec/containers/0/volumeMounts") == 1
        (mounts,) = [op["value"] for op in ops if op["path"].endswith("/volumeMounts")]
        assert [m["mountPath"] for m in mounts] == ["/dev/shm", "/etc/kvsidecar"]
        patched = jsonpatch.apply_patch(copy.deepcopy(pod), ops)
        validate_object(patched)
        assert plan.patched == 1 and plan.injected == 0

    def test_injected_pod_gets_nothing(self) -> None:
        """A Pod that already has the sidecar gets no edits and is counted as injected."""
        pod = _pod()
        patched = jsonpatch.apply_patch(pod, json_patch(plan_object(pod, InjectOptions()).edits))
        again = plan_object(patched, InjectOptions())
        assert again.edits == () and again.injected == 1 and again.patched == 0

    def test_bad_options(self) -> None:
        """A port out of range, an empty image or a store size that is not one is refused
        when the options are built."""
        with pytest.raises(ValueError, match=r"sidecar_port must be in \[1, 65535\]"):
            InjectOptions(sidecar_port=0)
        with pytest.raises(ValueError, match="image"):
            InjectOptions(sidecar_image="")
        with pytest.raises(ValueError, match="'lots' is not a byte size"):
            InjectOptions(store_capacity_bytes="lots")


def test_vllm_is_detected_and_told_to_publish_kv_events() -> None:
    """A ``vllm serve`` container gets --kv-events-config (zmq, replay) and prompt token
    details; its sidecar is --engine vllm on vLLM's port."""
    pod = _pod(image="vllm/vllm-openai:latest", command=["vllm", "serve", "/m"],
               args=["--port", "8001"])
    patched = jsonpatch.apply_patch(pod, json_patch(plan_object(pod, InjectOptions()).edits))
    engine, sidecar = patched["spec"]["containers"]
    args = engine["args"]
    config = args[args.index("--kv-events-config") + 1]
    assert '"enable_kv_cache_events":true' in config and '"replay_endpoint"' in config
    assert "--enable-prompt-tokens-details" in args
    assert sidecar["args"][:4] == ["--engine", "vllm", "--engine-url", "http://127.0.0.1:8001"]
