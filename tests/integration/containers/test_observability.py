"""compose/observability: the shipped Prometheus config and Grafana dashboard match what our
processes really export, so the dashboard cannot silently rot.

A real gateway, two sidecars (each owning a host-tier store) and the reference engines serve a
few chats; every metric the dashboard's PromQL names must then be on their /metrics, with the
labels the queries use. The scrape targets and the Grafana provisioning are checked against
the stacks as docker-compose resolves them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.local_stack import EngineSpec, LocalStack, StackSpec
from tests.support.gateway import routable

ROOT = Path(__file__).resolve().parents[3]
OBS = ROOT / "compose" / "observability"
DASHBOARD = OBS / "grafana" / "dashboards" / "kvsidecar.json"
STACKS = ["cpu", "sglang", "trtllm"]
METRIC = re.compile(r"\b(kvsidecar_[a-z0-9_]+)\b")
# PromQL label uses: {label="..."} selectors and by (...) groupings
SELECTOR = re.compile(r"(kvsidecar_[a-z0-9_]+)\{([^}]*)\}")
GROUPING = re.compile(r"\bby \(([^)]*)\)")
# labels Prometheus adds itself at scrape time
TARGET_LABELS = {"instance", "job"}


def exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def resolved(*files: str) -> dict[str, Any]:
    compose = shutil.which("docker-compose")
    assert compose, "docker-compose is not installed (scripts/test installs Debian's v1)"
    cmd = [compose]
    for f in files:
        cmd += ["-f", str(ROOT / "compose" / f)]
    out = subprocess.run([*cmd, "config"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)  # type: ignore[no-any-return]


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A resolved service's bind mounts: path inside → path here."""
    out = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        out[target] = Path(source)
    return out


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """Engines, sidecars with a host-tier store and a KV gateway: (gateway, sidecar URLs)."""
    spec = StackSpec(engines=(EngineSpec(replicas=2, store="sidecar", sidecar_args=(
        "--store-capacity-bytes", "16MiB")),), speedup=5)
    with LocalStack(spec, tmp_path) as stack:
        yield stack.url, [part.url for part in stack.sidecars]


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, set[str]]:
    """sample name → the label names it carries, from ``url``/metrics."""
    async with session.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, set()).update(s.labels)
    return samples


@pytest.mark.slow
async def test_every_dashboard_metric_is_exported(
    fleet: tuple[str, list[str]], session: aiohttp.ClientSession
) -> None:
    """Each metric the dashboard queries is on a /metrics of ours, with the labels used."""
    gateway, sidecars = fleet
    await routable(session, gateway, 2)
    system = " ".join(f"cache{i} prefix{i % 7}" for i in range(120))
    for i in range(4):  # a shared prefix: the later ones are predicted and reported cached
        body: dict[str, Any] = {
            "model": "tiny", "max_tokens": 8, "stream": i % 2 == 1,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"question {i}"}]}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        async with session.post(f"{gateway}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
    exported: dict[str, set[str]] = {}
    for url in [gateway, *sidecars]:
        for name, labels in (await scrape(session, url)).items():
            exported.setdefault(name, set()).update(labels)

    queries = exprs()
    assert len(queries) >= 10
    used = {m for q in queries for m in METRIC.findall(q)}
    missing = sorted(used - exported.keys())
    assert not missing, f"the dashboard queries metrics nothing exports: {missing}"
    for q in queries:
        names = METRIC.findall(q)
        for name, selector in SELECTOR.findall(q):
            for label in re.findall(r"(\w+)\s*=", selector):
                assert label in exported[name], f"{name} has no label {label!r} ({q})"
        for group in GROUPING.findall(q):
            for label in (g.strip() for g in group.split(",")):
                assert label in TARGET_LABELS or any(label in exported[n] for n in names), (
                    f"by ({label}) but none of {names} carries it ({q})")
    # the four things the dashboard is for
    for wanted in ("kvsidecar_gateway_actual_cached_tokens_total",
                   "kvsidecar_gateway_predicted_cached_tokens_total",
                   "kvsidecar_gateway_worker_in_flight",
                   "kvsidecar_gateway_ttft_seconds_bucket",
                   "kvsidecar_gateway_itl_seconds_bucket"):
        assert wanted in used, f"the dashboard lost its {wanted} panel"


@pytest.mark.slow  # real processes, seconds a test
@pytest.mark.parametrize("stack", STACKS)
def test_prometheus_scrapes_the_stacks_gateway_and_sidecars(stack: str) -> None:
    """Each scrape target is a service of the stack listening on that port, and every
    gateway and sidecar of the stack is scraped."""
    services = resolved(f"{stack}.yml", "observability.yml")["services"]
    config = yaml.safe_load((OBS / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host in services, f"{target}: no service {host} in {stack}"
        command = [str(a) for a in services[host]["command"]]
        assert command[command.index("--port") + 1] == port, f"{target}: {command}"
    ours = {name for name, s in services.items()
            if [str(a) for a in s.get("command", [])][:1] in (["gateway"], ["sidecar"])}
    assert ours == {t.rsplit(":", 1)[0] for t in targets}
    assert mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"] == (
        OBS / "prometheus.yml")


def test_grafana_provisioning_loads_the_dashboard() -> None:
    """The datasource uid is the dashboard's, the provider path is where compose mounts the
    dashboards, and the datasource URL is the prometheus service."""
    services = resolved("cpu.yml", "observability.yml")["services"]
    grafana = mounts(services["grafana"])
    provisioning = OBS / "grafana" / "provisioning"
    assert grafana["/etc/grafana/provisioning"] == provisioning
    provider = yaml.safe_load((provisioning / "dashboards" / "kvsidecar.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert grafana[path] == DASHBOARD.parent
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    datasource = source["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    assert "9090" in [str(p["target"]) for p in services["prometheus"]["ports"]]
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {datasource["uid"]}
    assert services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == (
        f"{path}/{DASHBOARD.name}")
