"""Checks of Kubernetes objects in tests: the API's OpenAPI schema (offline), plus the pod
rules the schema cannot express (unique names, mounts of volumes that exist).

A LeaderWorkerSet is a custom resource the offline schema does not hold: its own fields are
checked here by hand, and each of its pod templates validated as the Pod it becomes."""

from __future__ import annotations

from collections import Counter
from typing import Any

import kubernetes_validate

K8S_VERSION = "1.30.0"

__all__ = ["K8S_VERSION", "pod_specs", "validate_object"]


def pod_specs(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs inside ``obj`` (a Pod, a workload's template, a List's items)."""
    kind = obj.get("kind")
    if kind == "Pod":
        return [obj["spec"]]
    if kind in {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}:
        return [obj["spec"]["template"]["spec"]]
    if kind == "List":
        return [spec for item in obj["items"] for spec in pod_specs(item)]
    if kind == "LeaderWorkerSet":
        return [t["spec"] for t in _lws_templates(obj)]
    return []


def _lws_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """A LeaderWorkerSet's pod templates: the leader's first, when it has its own."""
    lwt = obj["spec"]["leaderWorkerTemplate"]
    return [lwt[k] for k in ("leaderTemplate", "workerTemplate") if k in lwt]


def _validate_lws(obj: dict[str, Any]) -> None:
    """What leaderworkerset.x-k8s.io/v1 requires of the object itself; its templates as Pods."""
    assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1", obj["apiVersion"]
    assert isinstance(obj["metadata"]["name"], str)
    lwt = obj["spec"]["leaderWorkerTemplate"]
    assert "workerTemplate" in lwt, "workerTemplate is required"
    assert set(lwt) <= {"leaderTemplate", "workerTemplate", "size", "restartPolicy",
                        "subGroupPolicy", "volumeClaimTemplates", "resizePolicy"}, set(lwt)
    assert isinstance(lwt.get("size", 1), int) and lwt.get("size", 1) >= 1
    for template in _lws_templates(obj):
        assert set(template) <= {"metadata", "spec"}, set(template)
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": template.get("metadata") or {},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def validate_object(obj: dict[str, Any]) -> None:
    """Raise unless ``obj`` is valid for Kubernetes ``K8S_VERSION`` (strict: no unknown fields)."""
    items = obj["items"] if obj.get("kind") == "List" else [obj]
    for item in items:  # the schema of kind List does not descend into its items
        if item.get("kind") == "LeaderWorkerSet":
            _validate_lws(item)
        else:
            kubernetes_validate.validate(item, K8S_VERSION, strict=True)
    for spec in pod_specs(obj):
        containers = spec["containers"] + spec.get("initContainers", [])
        names = Counter(c["name"] for c in containers)
        assert all(n == 1 for n in names.values()), f"duplicate container names: {names}"
        volumes = Counter(v["name"] for v in spec.get("volumes", []))
        assert all(n == 1 for n in volumes.values()), f"duplicate volumes: {volumes}"
        for c in containers:
            mounts = c.get("volumeMounts", [])
            paths = Counter(m["mountPath"] for m in mounts)
            assert all(n == 1 for n in paths.values()), f"{c['name']}: same path twice: {paths}"
            for m in mounts:
                assert m["name"] in volumes, f"{c['name']} mounts missing volume {m['name']}"
        ports = Counter(p["containerPort"] for c in containers for p in c.get("ports", []))
        assert all(n == 1 for n in ports.values()), f"a port used twice: {ports}"
