"""Checks of Kubernetes objects in tests: the API's OpenAPI schema (offline), plus the pod
rules the schema cannot express (unique names, mounts of volumes that exist)."""

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
    return []


def validate_object(obj: dict[str, Any]) -> None:
    """Raise unless ``obj`` is valid for Kubernetes ``K8S_VERSION`` (strict: no unknown fields)."""
    items = obj["items"] if obj.get("kind") == "List" else [obj]
    for item in items:  # the schema of kind List does not descend into its items
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
