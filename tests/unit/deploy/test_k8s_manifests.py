"""deploy/k8s: every overlay renders with `kubectl kustomize`, every object validates against
the Kubernetes OpenAPI schema offline (strict: an unknown field is an error), and the objects
agree with each other and with our commands' flags.

kubernetes-validate knows the core API only. The Prometheus Operator's ServiceMonitor and
PodMonitor and cert-manager's Issuer and Certificate are CRDs: they are not schema-checked
but checked here structurally, against the objects they point at (ports, labels, Secrets).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.k8s import validate_object

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-demo", "sglang", "trtllm")
NAMESPACE = "kvsidecar"
CRD_KINDS = {  # kind -> apiVersion: checked structurally below, not by the schema
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PodMonitor": "monitoring.coreos.com/v1",
    "Issuer": "cert-manager.io/v1",
    "Certificate": "cert-manager.io/v1",
}
CLUSTER_SCOPED = {"Namespace", "MutatingWebhookConfiguration"}
INJECT_LABEL = ("kvsidecar.io/inject", "enabled")


def _kubectl() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl is not installed: deploy/k8s is rendered with `kubectl kustomize` "
            "(kustomize v5, in kubectl >= 1.27; Debian bookworm's kubernetes-client 1.20 is "
            "too old). Install a current kubectl and run again."
        )
    return kubectl


@cache
def render(directory: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run([_kubectl(), "kustomize", str(K8S / directory)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


class Rendered:
    """One overlay's objects, looked up by kind and name."""

    def __init__(self, overlay: str) -> None:
        self.name = overlay
        self.objects = render(f"overlays/{overlay}")

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: {kind}/{name}: {len(found)} found"
        return found[0]

    def config_map(self, prefix: str) -> dict[str, Any]:
        found = [o for o in self.all("ConfigMap")
                 if re.fullmatch(rf"{prefix}-[a-z0-9]{{10}}", o["metadata"]["name"])]
        assert len(found) == 1, f"{self.name}: ConfigMap {prefix}-<hash>: {len(found)}"
        return found[0]


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> Rendered:
    return Rendered(request.param)


def _pod_template(deployment: dict[str, Any]) -> dict[str, Any]:
    return dict(deployment["spec"]["template"])


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    containers = _pod_template(deployment)["spec"]["containers"]
    found = [c for c in containers if c["name"] == name]
    assert len(found) == 1, f"container {name}: {[c['name'] for c in containers]}"
    return dict(found[0])


def _selects(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def _label_selector(text: str) -> dict[str, str]:
    pairs = [term.split("=", 1) for term in text.split(",")]
    assert all(len(p) == 2 for p in pairs), f"only k=v selectors expected here: {text}"
    return {k.strip(): v.strip() for k, v in pairs}


def _expanded_args(deployment: dict[str, Any], container: str,
                   rendered: Rendered) -> list[str]:
    """The container's command line after Kubernetes' $(VAR) expansion of its env."""
    env = _env(deployment, container, rendered)
    c = _container(deployment, container)
    args = [*c.get("command", []), *c.get("args", [])]
    expanded = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a)
                for a in args]
    return expanded


def _env(deployment: dict[str, Any], container: str, rendered: Rendered) -> dict[str, str]:
    """The container's environment, its ConfigMap references resolved."""
    c = _container(deployment, container)
    env: dict[str, str] = {}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "configMapKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["configMapKeyRef"]
            data = rendered.one("ConfigMap", ref["name"])["data"]
            assert ref["key"] in data, f"{container}: {ref} names a missing key"
            env[var["name"]] = data[ref["key"]]
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = "pod-0"
    return env


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse's error: a flag the command does not have
        raise AssertionError(f"{parser.prog} refuses {argv}") from exc


# --- rendering and the schema --------------------------------------------------------------


def test_the_overlays_are_the_ones_tested() -> None:
    assert sorted(p.name for p in (K8S / "overlays").iterdir()) == sorted(OVERLAYS)


@pytest.mark.parametrize("directory", ["base", *(f"overlays/{o}" for o in OVERLAYS)])
def test_every_object_validates(directory: str) -> None:
    objects = render(directory)
    assert objects
    for obj in objects:
        if obj["kind"] in CRD_KINDS:  # a CRD: the schema has none; checked structurally below
            assert obj["apiVersion"] == CRD_KINDS[obj["kind"]], obj["metadata"]
            continue
        try:
            validate_object(obj)
        except Exception as exc:
            raise AssertionError(
                f"{directory}: {obj['kind']}/{obj['metadata']['name']}: {exc}") from exc


def test_everything_lives_in_one_namespace(overlay: Rendered) -> None:
    for obj in overlay.objects:
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], obj["metadata"]
        else:
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]
    assert overlay.one("Namespace", NAMESPACE)


def test_a_broken_manifest_is_caught(tmp_path: Path) -> None:
    """The schema check bites: a field Kubernetes does not know is an error."""
    gateway = dict(Rendered("cpu-demo").one("Deployment", "kvsidecar-gateway"))
    bad = yaml.safe_load(yaml.safe_dump(gateway))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(Exception, match="readinesProbe"):
        validate_object(bad)


# --- the gateway ---------------------------------------------------------------------------


def test_gateway_is_replicated_probed_and_confined(overlay: Rendered) -> None:
    gateway = overlay.one("Deployment", "kvsidecar-gateway")
    assert gateway["spec"]["replicas"] >= 2
    pod = _pod_template(gateway)
    c = _container(gateway, "gateway")
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"]["path"] != "/health"  # engines down: no restarts
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
    service = overlay.one("Service", "kvsidecar-gateway")
    labels = pod["metadata"]["labels"]
    assert _selects(service["spec"]["selector"], labels)
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    args = _expanded_args(gateway, "gateway", overlay)
    assert f"--port={port}" in args


def test_gateway_flags_are_the_gateways(overlay: Rendered) -> None:
    """The command line parses with the gateway's flags, and its environment (from the
    ConfigMap) holds only variables the gateway's options read."""
    from kvcore.option_specs import option_specs
    from routing.config import RouterConfig
    from routing.flags import gateway_parser

    gateway = overlay.one("Deployment", "kvsidecar-gateway")
    argv = _expanded_args(gateway, "gateway", overlay)
    assert argv[:2] == ["kvsidecar", "gateway"]
    env = _env(gateway, "gateway", overlay)
    assert set(env) <= {s.meta.env for s in option_specs(RouterConfig)}, env
    args = _parse(gateway_parser(env), argv[2:])
    assert args.discover_k8s_port == "kvsidecar"
    mounts = {m["mountPath"] for m in _container(gateway, "gateway")["volumeMounts"]}
    assert any(args.model_path.startswith(m + "/") for m in mounts), (args.model_path, mounts)
    assert overlay.config_map("kvsidecar-gateway")


def test_gateway_discovers_the_overlays_engines(overlay: Rendered) -> None:
    """The discovery selector picks the engine pods, and only them."""
    from routing.flags import gateway_parser

    gateway = overlay.one("Deployment", "kvsidecar-gateway")
    args = _parse(gateway_parser(_env(gateway, "gateway", overlay)),
                  _expanded_args(gateway, "gateway", overlay)[2:])
    selector = _label_selector(args.discover_k8s_selector)
    chosen = [d["metadata"]["name"] for d in overlay.all("Deployment")
              if _selects(selector, _pod_template(d)["metadata"]["labels"])]
    engines = [d["metadata"]["name"] for d in overlay.all("Deployment")
               if d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]
    assert chosen == engines and engines, (chosen, engines)
    for name in engines:  # what the webhook injects, or (cpu-demo) what is written out
        labels = _pod_template(overlay.one("Deployment", name))["metadata"]["labels"]
        assert labels.get(INJECT_LABEL[0]) == INJECT_LABEL[1]


def test_the_disruption_budget_keeps_a_gateway(overlay: Rendered) -> None:
    pdb = overlay.one("PodDisruptionBudget", "kvsidecar-gateway")
    gateway = overlay.one("Deployment", "kvsidecar-gateway")
    assert _selects(pdb["spec"]["selector"]["matchLabels"],
                    _pod_template(gateway)["metadata"]["labels"])
    assert 1 <= pdb["spec"]["minAvailable"] < gateway["spec"]["replicas"]


def test_rbac_is_exactly_what_discovery_needs(overlay: Rendered) -> None:
    gateway = overlay.one("Deployment", "kvsidecar-gateway")
    account = _pod_template(gateway)["spec"]["serviceAccountName"]
    assert overlay.one("ServiceAccount", account)
    roles = overlay.all("Role")
    assert len(roles) == 1 and not overlay.all("ClusterRole")
    assert roles[0]["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                                  "verbs": ["get", "list", "watch"]}]
    binding = overlay.one("RoleBinding", "kvsidecar-gateway-discovery")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": roles[0]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account,
                                    "namespace": NAMESPACE}]


# --- the webhook ---------------------------------------------------------------------------


def test_webhook_configuration_points_at_the_webhook(overlay: Rendered) -> None:
    from kvcore.option_specs import option_specs
    from kvsidecar.webhook import WebhookConfig, build_parser

    webhook = overlay.one("Deployment", "kvsidecar-webhook")
    assert webhook["spec"]["replicas"] >= 2
    argv = _expanded_args(webhook, "webhook", overlay)
    assert argv[:2] == ["kvsidecar", "webhook"]
    env = _env(webhook, "webhook", overlay)
    assert set(env) <= {s.meta.env for s in option_specs(WebhookConfig)}, env
    args = _parse(build_parser(env), argv[2:])
    assert (args.port, args.tls_cert, args.tls_key) == (8443, "/tls/tls.crt", "/tls/tls.key")
    assert args.label == "=".join(INJECT_LABEL)
    image = _container(webhook, "webhook")["image"]
    assert args.sidecar_image == image  # the injected sidecar runs the webhook's own image
    tls = [v for v in _pod_template(webhook)["spec"]["volumes"] if v["name"] == "tls"]
    secret = tls[0]["secret"]["secretName"]

    service = overlay.one("Service", "kvsidecar-webhook")
    assert _selects(service["spec"]["selector"], _pod_template(webhook)["metadata"]["labels"])
    config = overlay.one("MutatingWebhookConfiguration", "kvsidecar-injector")
    (hook,) = config["webhooks"]
    target = hook["clientConfig"]["service"]
    assert (target["name"], target["namespace"], target["path"]) == \
        ("kvsidecar-webhook", NAMESPACE, "/mutate")
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == target["port"]]
    assert port["targetPort"] == "https"
    assert hook["objectSelector"] == {"matchLabels": dict([INJECT_LABEL])}
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["rules"][0]["resources"] == ["pods"]
    assert hook["rules"][0]["operations"] == ["CREATE"]

    # cert-manager: the certificate names the Service, lands in the Secret the webhook
    # mounts, and its CA is injected into the configuration
    cert = overlay.one("Certificate", "kvsidecar-webhook")
    assert cert["spec"]["secretName"] == secret
    assert f"kvsidecar-webhook.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    issuer = cert["spec"]["issuerRef"]
    assert overlay.one(issuer["kind"], issuer["name"])["spec"] == {"selfSigned": {}}
    annotation = config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert annotation == f"{NAMESPACE}/kvsidecar-webhook"


def test_the_images_are_set_once(overlay: Rendered) -> None:
    ours = {c["image"] for d in overlay.all("Deployment")
            if d["metadata"]["labels"].get("app.kubernetes.io/component") != "engine"
            for c in _pod_template(d)["spec"]["containers"]}
    assert ours == {"ghcr.io/kvsidecar/kvsidecar-gateway:latest"}


# --- monitoring ----------------------------------------------------------------------------


def test_monitors_scrape_real_ports(overlay: Rendered) -> None:
    monitor = overlay.one("ServiceMonitor", "kvsidecar-gateway")
    services = [s for s in overlay.all("Service")
                if _selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in services] == ["kvsidecar-gateway"]
    ports = {p["name"] for p in services[0]["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}

    pods = overlay.one("PodMonitor", "kvsidecar-sidecars")
    assert pods["spec"]["selector"]["matchLabels"] == dict([INJECT_LABEL])
    assert [e["port"] for e in pods["spec"]["podMetricsEndpoints"]] == ["kvsidecar"]


# --- the CPU demo's engines, written out -------------------------------------------------


def _cpu_demo_engine() -> tuple[Rendered, dict[str, Any]]:
    rendered = Rendered("cpu-demo")
    return rendered, rendered.one("Deployment", "refengine")


def test_cpu_demo_sidecar_is_what_the_webhook_would_add() -> None:
    from sidecar.config import SidecarConfig

    rendered, engine = _cpu_demo_engine()
    sidecar = _container(engine, "kvsidecar")
    assert {"name": "kvsidecar", "containerPort": 9000, "protocol": "TCP"} in sidecar["ports"]
    argv = _expanded_args(engine, "kvsidecar", rendered)
    assert argv[:2] == ["kvsidecar", "sidecar"]
    args = _parse(SidecarConfig.parser(), argv[2:])
    assert (args.host, args.port, args.engine_url) == ("0.0.0.0", 9000,
                                                       "http://127.0.0.1:30000")


def test_cpu_demo_engine_flags_are_the_engines() -> None:
    from refengine.config import build_parser

    rendered, engine = _cpu_demo_engine()
    argv = _expanded_args(engine, "engine", rendered)
    assert argv[:2] == ["kvsidecar", "engine"]
    args = _parse(build_parser(), argv[2:])
    assert args.compute == "sim"


def _all_files() -> Iterator[Path]:
    yield from sorted(K8S.rglob("*.yaml"))


def test_every_file_is_used() -> None:
    """No manifest lies around unreferenced: each is a kustomization or listed in one."""
    listed: set[Path] = set()
    for path in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(path.read_text())
        for entry in [*k.get("resources", []), *k.get("components", []),
                      *(p["path"] for p in k.get("patches", []) if "path" in p)]:
            listed.add((path.parent / entry).resolve())
    for path in _all_files():
        assert path.name == "kustomization.yaml" or path.resolve() in listed, path


# --- the webhook's patch on the overlays' engines ------------------------------------------


def _apply(obj: dict[str, Any], edits: Any) -> dict[str, Any]:
    from kvsidecar.k8s_patch import Append

    out: dict[str, Any] = yaml.safe_load(yaml.safe_dump(obj))
    for edit in edits:
        node: Any = out
        for key in edit.path:
            node = node[key]
        if isinstance(edit, Append):
            node.append(edit.value)
        else:
            node[edit.key] = edit.value
    return out


@pytest.mark.parametrize("overlay_name", OVERLAYS)
def test_injected_engines_validate_and_are_discoverable(overlay_name: str) -> None:
    """What the webhook makes of each engine pod validates, and carries the port discovery
    looks for; the CPU demo's pods, written out already, pass unchanged."""
    from kvsidecar.k8s_patch import InjectOptions, plan_object
    from routing.workers.k8s_discovery import pod_sidecar_url

    rendered = Rendered(overlay_name)
    engines = [d for d in rendered.all("Deployment")
               if d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]
    assert engines
    for engine in engines:
        plan = plan_object(engine, InjectOptions(sidecar_image="kvsidecar:test"))
        assert (len(plan.edits) == 0) == (overlay_name == "cpu-demo"), plan
        injected = _apply(engine, plan.edits)
        validate_object(injected)
        pod = {"metadata": {"name": "p"}, "spec": _pod_template(injected)["spec"],
               "status": {"phase": "Running", "podIP": "10.0.0.9",
                          "conditions": [{"type": "Ready", "status": "True"}]}}
        assert pod_sidecar_url(pod, "kvsidecar") == "http://10.0.0.9:9000"
