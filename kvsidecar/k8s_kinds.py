"""Where an object's pod templates are, by kind, and why an object holding pods gets none.

Built-in workloads keep their pod template at ``spec.template`` (a CronJob one level down);
a ``kind: List`` holds objects. A LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``, the way
SGLang and LWS deploy multi-node and P/D serving) holds two: ``leaderTemplate`` for each
group's first pod and ``workerTemplate`` for the rest, or for every pod when there is no
leader template. Only the leader runs the engine's HTTP server (the other ranks join it over
``--dist-init-addr``), so the sidecar goes beside the leader: in ``leaderTemplate``, or in
``workerTemplate`` when that is the leader's template too and the group is one pod. A group
of several pods built from one template is refused, saying how to split it: a sidecar on
every rank would wait forever for an HTTP server that only rank 0 runs, and LWS counts a
group ready only when all its pods are.

Any other kind that holds containers (a DisaggregatedSet, a RoleBasedGroup, an operator's
own resource) is named with its apiVersion, never passed over as "no Pod".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvsidecar.k8s_edits import Path, get_path

__all__ = ["LWS_GROUP", "describe", "pod_spec_paths", "template_name", "unhandled"]

LWS_GROUP = "leaderworkerset.x-k8s.io"
# Workload kinds whose pod template sits at spec.template.spec.
_TEMPLATED = {
    "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "ReplicationController",
}
_LWT: Path = ("spec", "leaderWorkerTemplate")
_MAX_DEPTH = 12  # how deep an unknown kind is searched for containers


def pod_spec_paths(obj: Mapping[str, Any]) -> list[Path]:
    """Where the pod specs of ``obj`` that get a sidecar are: a Pod's ``spec``, a workload's
    template, a LeaderWorkerSet's leader template, a List's items'."""
    kind = obj.get("kind")
    if kind == "Pod":
        return [("spec",)] if isinstance(obj.get("spec"), Mapping) else []
    if kind in _TEMPLATED:
        return _if_spec(obj, ("spec", "template", "spec"))
    if kind == "CronJob":
        return _if_spec(obj, ("spec", "jobTemplate", "spec", "template", "spec"))
    if _is_lws(obj):
        leader = _if_spec(obj, (*_LWT, "leaderTemplate", "spec"))
        if leader or _lws_size(obj) != 1:
            return leader
        return _if_spec(obj, (*_LWT, "workerTemplate", "spec"))
    if _is_list(obj):
        return [
            ("items", i, *inner)
            for i, item in enumerate(obj["items"])
            if isinstance(item, Mapping)
            for inner in pod_spec_paths(item)
        ]
    return []


def unhandled(obj: Mapping[str, Any]) -> list[str]:
    """Why the pod templates ``obj`` holds get no sidecar (nothing: it holds none, or every
    one it holds is at a path ``pod_spec_paths`` gives)."""
    if _is_list(obj):
        return [why for item in obj["items"] if isinstance(item, Mapping)
                for why in unhandled(item)]
    if pod_spec_paths(obj):
        return []
    if _is_lws(obj):
        if not isinstance(_get_or_none(obj, (*_LWT, "workerTemplate", "spec")), Mapping):
            return []
        size = _lws_size(obj)
        return [
            f"{describe(obj)}: its groups are {size!r} pods built from workerTemplate alone, "
            "and only the leader (worker index 0) serves HTTP, so a sidecar on every pod would "
            "never be ready. Add spec.leaderWorkerTemplate.leaderTemplate (a copy of "
            "workerTemplate is enough) and inject again: the sidecar goes beside the leader"
        ]
    if obj.get("kind") in {"Pod", "CronJob", *_TEMPLATED} or not _holds_containers(obj, 0):
        return []
    return [
        f"kvsidecar inject does not know kind {obj.get('kind')} (apiVersion "
        f"{obj.get('apiVersion')}): its pods are left as they are. Inject the workloads it is "
        "made of as Pods, Deployments, StatefulSets or LeaderWorkerSets, or label its pod "
        "templates kvsidecar.io/inject=enabled and let kvsidecar webhook add the sidecar to "
        "each pod as it is created"
    ]


def template_name(path: Path) -> str | None:
    """``leaderTemplate`` or ``workerTemplate`` for a LeaderWorkerSet's pod spec path."""
    if len(path) >= 2 and path[-2] in ("leaderTemplate", "workerTemplate"):
        return str(path[-2])
    return None


def _get_or_none(obj: Any, path: Path) -> Any:
    try:
        return get_path(obj, path)
    except (KeyError, IndexError, TypeError):
        return None


def _if_spec(obj: Mapping[str, Any], path: Path) -> list[Path]:
    return [path] if isinstance(_get_or_none(obj, path), Mapping) else []


def _is_lws(obj: Mapping[str, Any]) -> bool:
    api = obj.get("apiVersion")
    return (
        obj.get("kind") == "LeaderWorkerSet"
        and isinstance(api, str) and api.startswith(LWS_GROUP + "/")
    )


def _is_list(obj: Mapping[str, Any]) -> bool:
    kind = obj.get("kind")
    return isinstance(kind, str) and kind.endswith("List") and isinstance(obj.get("items"), list)


def _lws_size(obj: Mapping[str, Any]) -> Any:
    """The pods in a group: ``leaderWorkerTemplate.size``, 1 when unset (LWS's default)."""
    lwt = _get_or_none(obj, _LWT)
    return lwt.get("size", 1) if isinstance(lwt, Mapping) else 1


def _holds_containers(node: Any, depth: int) -> bool:
    if depth > _MAX_DEPTH:
        return False
    if isinstance(node, Mapping):
        if isinstance(node.get("containers"), list):
            return True
        return any(_holds_containers(v, depth + 1) for v in node.values())
    if isinstance(node, list):
        return any(_holds_containers(v, depth + 1) for v in node)
    return False


def describe(obj: Mapping[str, Any]) -> str:
    """``Deployment/name`` (or ``Pod/<generateName>*``) for messages."""
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    name = meta.get("name") or (f"{meta['generateName']}*" if meta.get("generateName") else "?")
    return f"{obj.get('kind', '?')}/{name}"
