"""``kvsidecar inject -f deployment.yaml``: add the sidecar to existing manifests, offline.

Like ``istioctl kube-inject``: every Deployment, StatefulSet, Pod, LeaderWorkerSet (its
leader's template), ``kind: List`` of them, and the other pod-template workloads, whose pod
runs SGLang or TensorRT-LLM gets the sidecar container, a memory-backed ``/dev/shm``
shared by both containers and the engine flags the sidecar needs when they are absent
(``kvsidecar.k8s_patch``). Everything else in the file, other documents, comments and
formatting included, comes out byte for byte as it went in (``kvsidecar.yaml_splice``);
injecting twice changes nothing the second time.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

from kvcore.options import OptionParser
from kvsidecar.inject_options import InjectOptions
from kvsidecar.k8s_edits import apply_edits
from kvsidecar.k8s_patch import InjectError, describe, plan_object

__all__ = ["build_parser", "inject_text", "main"]


def build_parser() -> OptionParser:
    """``inject``'s flags: the file's, then ``InjectOptions``' (one flag per field)."""
    parser = OptionParser(
        prog="kvsidecar inject",
        description="Add the kvsidecar sidecar to Kubernetes manifests that run SGLang or "
        "TensorRT-LLM, offline. Only additions are made; everything else in the file stays "
        "byte for byte as it was, and a pod that already has the sidecar is left alone.",
    )
    parser.add_argument(
        "-f", "--filename", required=True, metavar="FILE",
        help="the manifest (YAML, one or more documents; '-' reads stdin)",
    )
    parser.add_argument(
        "-o", "--output", metavar="FILE", help="write here instead of stdout (may be FILE itself)"
    )
    parser.add_options(InjectOptions)
    return parser


class InjectResult:
    """The patched text, and what to tell the user about it."""

    def __init__(self, text: str, messages: list[str], patched: int) -> None:
        self.text = text
        self.messages = messages
        self.patched = patched


def inject_text(text: str, opts: InjectOptions) -> InjectResult:
    """``text`` with the sidecar injected; ``InjectError`` when nothing in it can take one."""
    from kvsidecar import yaml_splice  # noqa: PLC0415  (PyYAML, the k8s extra: only here)

    inserts: list[yaml_splice.Insertion] = []
    messages: list[str] = []
    skipped: list[str] = []
    seen: list[str] = []  # the objects, for a refusal that names what it found
    expected: list[Any] = []
    patched = injected = 0
    for doc in yaml_splice.parse_documents(text):
        if not isinstance(doc.value, dict):
            expected.append(doc.value)
            continue
        plan = plan_object(doc.value, opts, skip_no_engine=True)
        seen.append(describe(doc.value))
        inserts += yaml_splice.insertions(text, doc, plan.edits)
        expected.append(apply_edits(copy.deepcopy(doc.value), plan.edits))
        messages += plan.notes
        skipped += plan.skipped
        patched += plan.patched
        injected += plan.injected
    if patched == 0 and injected == 0:
        found = "; ".join(skipped) or (
            "no Pod, Deployment, StatefulSet, LeaderWorkerSet or List (found: "
            f"{', '.join(seen) or 'no objects'})"
        )
        raise InjectError(f"nothing to inject: {found}")
    messages += [f"left as is: {why}" for why in skipped]
    if injected:
        messages.append(f"{injected} pod template(s) already had the sidecar: left as is")
    out = yaml_splice.apply(text, inserts)
    # The text must now say exactly what the plan does: anything else is a layout we
    # misread, refused here rather than written out.
    if [d.value for d in yaml_splice.parse_documents(out)] != expected:
        raise yaml_splice.SpliceError(
            "this file's layout could not be patched faithfully (please report it); "
            "nothing was written"
        )
    return InjectResult(out, messages, patched)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    opts = parser.build(InjectOptions, args)
    try:
        raw = sys.stdin.buffer.read() if args.filename == "-" else Path(args.filename).read_bytes()
        source = raw.decode("utf-8")  # no newline translation: the bytes must round-trip
        result = inject_text(source, opts)
    except ImportError as exc:
        print(f"kvsidecar inject: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # InjectError and SpliceError are ValueErrors
        print(f"kvsidecar inject: error: {exc}", file=sys.stderr)
        return 1
    for message in result.messages:
        print(f"kvsidecar inject: {message}", file=sys.stderr)
    if args.output:
        Path(args.output).write_bytes(result.text.encode("utf-8"))
    else:
        sys.stdout.buffer.write(result.text.encode("utf-8"))
        sys.stdout.flush()
    return 0
