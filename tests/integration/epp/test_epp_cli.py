"""``kvsidecar epp`` as a command: its flags, its extra, and the shipped InferencePool example."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from routing.epp.config import EppConfig
from tests.integration.epp.conftest import MODEL, ROOT
from tests.support.k8s import validate_object

pytestmark = pytest.mark.slow  # real processes, seconds a test

EXAMPLE = ROOT / "deploy" / "examples" / "inferencepool.yaml"
ENGINES = ROOT / "deploy" / "examples" / "sglang-deployment.yaml"


def _run(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_help_shows_the_pickers_flags_only() -> None:
    """``kvsidecar epp --help`` lists the worker, placement and gRPC flags, not the gateway's
    proxy-only ones."""
    out = _run("kvsidecar", "epp", "--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--sidecar", "--model-path", "--router-mode", "--grpc-port", "--body-mode"):
        assert flag in out.stdout, flag
    for flag in ("--pd-mode", "--upstream-timeout-s", "--forward-authorization"):
        assert flag not in out.stdout, flag


def test_a_gateway_only_flag_is_refused() -> None:
    """A flag only the gateway acts on is an error, not silently ignored."""
    out = _run("routing.epp", "--worker", "http://127.0.0.1:1", "--pd-mode", "off")
    assert out.returncode == 2
    assert "--pd-mode does not apply to the endpoint picker" in out.stderr


def test_without_the_extra_it_says_which_to_install() -> None:
    """Without grpcio the command stops with a message naming the epp extra."""
    code = ("import sys; sys.modules['grpc'] = None; "
            "from routing.epp.__main__ import main; "
            "sys.exit(main(['--worker', 'http://127.0.0.1:1']))")
    out = _run(code=code)
    assert out.returncode == 2
    assert "kvsidecar[epp]" in out.stderr, out.stderr


def test_the_gateway_loads_no_grpc() -> None:
    """The gateway's entry point loads neither grpc nor Envoy's messages."""
    out = _run(code="import sys, routing.__main__; print(sorted(sys.modules))")
    assert out.returncode == 0, out.stderr
    assert "'grpc'" not in out.stdout and "'envoy'" not in out.stdout


def _objects(path: Path) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text()) if d}


def test_the_inferencepool_example_is_consistent() -> None:
    """The example's core objects validate, its pool selects the SGLang example's pods on
    their engine port, it points at the picker's Service and gRPC port, the route at the
    pool, and the picker's arguments are flags ``kvsidecar epp`` accepts."""
    objs = _objects(EXAMPLE)
    for kind in ("ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"):
        validate_object(objs[kind])
    pool, service, route = objs["InferencePool"], objs["Service"], objs["HTTPRoute"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    engines = _objects(ENGINES)["Deployment"]
    pod = engines["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    engine_ports = {p["containerPort"] for c in pod["spec"]["containers"]
                    for p in c.get("ports", [])}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [30000]
    assert 30000 in engine_ports
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["name"] == service["metadata"]["name"]
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    container = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "epp"
    args = [str(a) for a in container["args"][1:]]
    model = args.index("--model-path") + 1
    args[model] = str(MODEL)  # the pod's model volume, here the tiny model's directory
    cfg = EppConfig.from_args(args)
    assert cfg.grpc_port == picker["port"]["number"]
    assert cfg.router.discover_k8s_selector is not None
