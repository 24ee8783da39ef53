"""What must hold of every `kvsidecar inject` run, and the webhook's answer for the same pod:
the tests over manifests (tests/unit/deploy) share these, so each property is said once."""

from __future__ import annotations

import base64
import copy
import difflib
import json
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

from kvsidecar.inject import inject_text
from kvsidecar.k8s_edits import json_patch
from kvsidecar.k8s_patch import InjectOptions, plan_object
from kvsidecar.webhook import WebhookConfig, admit
from tests.support.k8s import validate_object

__all__ = ["check_injection", "docs", "inserted_lines", "webhook_patch"]

LABEL = ("kvsidecar.io/inject", "enabled")


def inserted_lines(before: str, after: str, flow: tuple[str, ...] = ()) -> list[str]:
    """The lines ``after`` adds to ``before``; fails if any line of ``before`` changed, but
    for the lines in ``flow``, which may only gain text before their closing brackets."""
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    added: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "replace" and i2 - i1 == j2 - j1:
            for old, new in zip(a[i1:i2], b[j1:j2], strict=True):
                assert old.rstrip("\r\n") in flow, f"changed {old!r} into {new!r}"
                head = old.rstrip("]}\r\n")
                assert new.startswith(head) and new.endswith(old[len(head):]), (old, new)
            continue
        assert tag in ("equal", "insert"), f"changed {a[i1:i2]!r} into {b[j1:j2]!r}"
        if tag == "insert":
            added += b[j1:j2]
    return added


def docs(text: str) -> list[Any]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


def _expected(before: str, opts: InjectOptions) -> list[Any]:
    """What the documents must be: the originals with the plan's JSON Patch applied."""
    return [
        jsonpatch.apply_patch(d, json_patch(plan_object(d, opts, skip_no_engine=True).edits))
        for d in docs(before)
    ]


def check_injection(
    before: str, opts: InjectOptions, block: bool = True, flow: tuple[str, ...] = ()
) -> str:
    """Inject, and check everything that must hold of any injection; the output text."""
    after = inject_text(before, opts).text
    if block:
        inserted_lines(before, after, flow)
    out = docs(after)
    assert out == _expected(before, opts), "the text edits and the JSON Patch disagree"
    for doc in out:
        validate_object(doc)
    assert inject_text(after, opts).text == after, "a second injection changed the text"
    return after


def webhook_patch(
    template: dict[str, Any], opts: InjectOptions, tmp: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Pod a controller makes of a pod ``template`` (opted in), and the webhook's
    AdmissionReview response for it (``kvsidecar.webhook.admit``, the function the HTTPS
    server answers with); the pod comes back patched when the response allows it."""
    meta = copy.deepcopy(template.get("metadata") or {})
    meta.setdefault("labels", {})[LABEL[0]] = LABEL[1]
    meta["generateName"] = "pod-"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
           "spec": copy.deepcopy(template["spec"])}
    review = {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "operation": "CREATE", "object": copy.deepcopy(pod)},
    }
    cfg = WebhookConfig(tls_cert=tmp / "tls.crt", tls_key=tmp / "tls.key",
                        sidecar_image=opts.sidecar_image, sidecar_port=opts.sidecar_port,
                        store_capacity_bytes=opts.store_capacity_bytes,
                        sidecar_args=opts.sidecar_args)
    response = admit(review, cfg)[0]["response"]
    if response.get("patch"):
        patch = json.loads(base64.b64decode(response["patch"]))
        pod = jsonpatch.apply_patch(pod, patch)
        validate_object(pod)
    return pod, response
