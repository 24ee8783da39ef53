"""Kubernetes discovery's pure parts: which pods are sidecars, the API settings, the flags.
The list/watch loop runs against a stand-in API server in tests/integration/discovery."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from routing.config import RouterConfig
from routing.flags import gateway_config
from routing.workers.k8s_discovery import K8sApiAccess, pod_sidecar_url
from tests.support.k8s_standin import make_pod

LABELS = {"kvsidecar.io/inject": "enabled"}


def _pod(**changes: Any) -> dict[str, Any]:
    pod = make_pod("llm-0", "10.1.2.3", 9000, labels=LABELS)
    pod["status"].update(changes)
    return pod


def test_a_ready_running_pod_is_its_sidecars_url() -> None:
    assert pod_sidecar_url(_pod(), "kvsidecar") == "http://10.1.2.3:9000"
    assert pod_sidecar_url(_pod(), "9100") == "http://10.1.2.3:9100"
    v6 = _pod(podIP="fd00::7")
    assert pod_sidecar_url(v6, "kvsidecar") == "http://[fd00::7]:9000"


def test_a_native_sidecar_port_is_found_among_init_containers() -> None:
    pod = _pod()
    sidecar = pod["spec"]["containers"].pop()
    pod["spec"]["initContainers"] = [{**sidecar, "restartPolicy": "Always"}]
    assert pod_sidecar_url(pod, "kvsidecar") == "http://10.1.2.3:9000"


@pytest.mark.parametrize(
    ("what", "pod"),
    [
        ("not ready", make_pod("p", "10.1.2.3", 9000, labels=LABELS, ready=False)),
        ("pending", _pod(phase="Pending")),
        ("no IP yet", _pod(podIP=None)),
        ("no port of that name", make_pod("p", "10.1.2.3", 9000, labels=LABELS,
                                          port_name="http-alt")),
    ],
)
def test_a_pod_that_cannot_serve_is_no_sidecar(what: str, pod: dict[str, Any]) -> None:
    assert pod_sidecar_url(pod, "kvsidecar") is None, what


def test_a_terminating_pod_is_no_sidecar() -> None:
    pod = _pod()
    pod["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    assert pod_sidecar_url(pod, "kvsidecar") is None


def _cfg(model: Path, *extra: str) -> RouterConfig:
    return gateway_config(["--model-path", str(model), "--discover-k8s-selector",
                                   "kvsidecar.io/inject=enabled", *extra])


def test_in_cluster_settings_come_from_the_pod(tiny_model_dir: Path, tmp_path: Path) -> None:
    for name, text in (("token", "tok\n"), ("ca.crt", "pem"), ("namespace", "serving\n")):
        (tmp_path / name).write_text(text)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    access = K8sApiAccess.resolve(_cfg(tiny_model_dir), env, tmp_path)
    assert access == K8sApiAccess("https://10.96.0.1:443", "serving", tmp_path / "token",
                                  tmp_path / "ca.crt", False)
    assert access.headers() == {"Authorization": "Bearer tok"}


def test_flags_override_the_pod(tiny_model_dir: Path, tmp_path: Path) -> None:
    token = tmp_path / "t"
    token.write_text("x")
    cfg = _cfg(tiny_model_dir, "--k8s-api-url", "http://127.0.0.1:8001/",
               "--discover-k8s-namespace", "llm", "--k8s-token-file", str(token),
               "--discover-k8s-port", "9001")
    access = K8sApiAccess.resolve(cfg, {}, tmp_path / "absent")
    assert access == K8sApiAccess("http://127.0.0.1:8001", "llm", token, None, False)
    assert cfg.discover_k8s_port == "9001"


def test_outside_a_pod_without_an_api_url_is_a_clear_error(tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--k8s-api-url"):
        K8sApiAccess.resolve(_cfg(tiny_model_dir), {}, tmp_path)
    cfg = _cfg(tiny_model_dir, "--k8s-api-url", "http://127.0.0.1:8001")
    with pytest.raises(ValueError, match="--discover-k8s-namespace"):
        K8sApiAccess.resolve(cfg, {}, tmp_path)
    cfg = _cfg(tiny_model_dir, "--k8s-api-url", "http://127.0.0.1:8001",
               "--k8s-token-file", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--k8s-token-file"):
        K8sApiAccess.resolve(cfg, {}, tmp_path)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--discover-k8s-port", "Kv_Sidecar"], "--discover-k8s-port must be"),
        (["--discover-k8s-port", "70000"], "--discover-k8s-port must be in"),
        (["--sidecar", "http://127.0.0.1:9000"], "replaces --sidecar"),
        (["--k8s-api-url", "ftp://api"], "--k8s-api-url must be"),
    ],
)
def test_bad_flags_are_refused(tiny_model_dir: Path, extra: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _cfg(tiny_model_dir, *extra)
    assert message in capsys.readouterr().err


def test_discovery_needs_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gateway_config(["--discover-k8s-selector", "a=b"])
    assert "--model-path" in capsys.readouterr().err
