"""compose/: every stack is a valid compose file and every kvsidecar command in it parses."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from refengine.config import EngineConfig
from routing.flags import gateway_config
from sidecar.config import SidecarConfig

ROOT = Path(__file__).resolve().parents[2]
STACKS = sorted((ROOT / "compose").glob("*.yml"))
STACKS = [p for p in STACKS if p.name not in ("trtllm-extra.yml", "observability.yml")]
# The engine images our plugin layer (compose/images/plugin.Containerfile) builds on.
OFFICIAL = {"sglang": "lmsysorg/sglang:", "trtllm": "nvcr.io/nvidia/tensorrt-llm/release:"}
# Paths inside the images, mapped to this checkout for parsing.
PATHS = {"/app/": f"{ROOT}/", "/models/model": f"{ROOT}/refengine/models/tiny"}
PARSERS = {"engine": EngineConfig.from_args, "sidecar": SidecarConfig.from_args,
           "gateway": gateway_config}


def resolved(stack: Path) -> dict[str, Any]:
    """The stack as docker-compose resolves it (anchors, variables and defaults applied)."""
    compose = shutil.which("docker-compose")
    assert compose, "docker-compose is not installed (scripts/test installs Debian's v1)"
    out = subprocess.run([compose, "-f", str(stack), "config"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)  # type: ignore[no-any-return]


def local(arg: str) -> str:
    for inside, here in PATHS.items():
        if arg.startswith(inside):
            return here + arg[len(inside):]
    return arg


def test_there_are_stacks() -> None:
    """The CPU, SGLang and TensorRT-LLM stacks all exist."""
    assert {p.stem for p in STACKS} >= {"cpu", "sglang", "trtllm"}


@pytest.mark.parametrize("stack", STACKS, ids=lambda p: p.stem)
def test_stack_is_valid_and_our_commands_parse(stack: Path) -> None:
    """docker-compose accepts the file; each kvsidecar service's command is one our CLI takes."""
    services = resolved(stack)["services"]
    ours = 0
    for name, service in services.items():
        command = [local(str(a)) for a in service.get("command", [])]
        if not str(service.get("image", "")).startswith("kvsidecar") or command[0] not in PARSERS:
            continue
        parse = PARSERS[command[0]]
        parse(command[1:])  # exits 2 with a message on a bad flag
        ours += 1
        if command[0] == "sidecar":
            assert service.get("ipc", "").startswith("service:"), f"{name} must share IPC"
    assert ours >= 3


@pytest.mark.parametrize("stack", STACKS, ids=lambda p: p.stem)
def test_engines_with_a_store_have_room_for_it(stack: Path) -> None:
    """Engines whose sidecar owns a shared-memory store set shm_size (Docker's default: 64 MB)."""
    services = resolved(stack)["services"]
    for name, service in services.items():
        command = [str(a) for a in service.get("command", [])]
        if "--store-capacity-bytes" in command:
            engine = service["ipc"].split(":", 1)[1]
            assert services[engine].get("shm_size"), f"{engine} needs shm_size for {name}'s store"


@pytest.mark.parametrize("stack", STACKS, ids=lambda p: p.stem)
def test_images_are_built_from_our_containerfiles(stack: Path) -> None:
    """Every kvsidecar image in a stack says how to build it, from a Containerfile that
    exists; engines from an official image get our plugin layer on it, and nothing mounts our
    source into a container."""
    services = resolved(stack)["services"]
    for name, service in services.items():
        image = str(service.get("image", ""))
        if not image.startswith("kvsidecar"):
            continue
        build = service["build"]
        assert (Path(build["context"]) / build["dockerfile"]).is_file(), f"{name}: {build}"
        if Path(build["dockerfile"]).name == "plugin.Containerfile":
            engine = image.removeprefix("kvsidecar-").split(":")[0]
            assert build["args"]["ENGINE_IMAGE"].startswith(OFFICIAL[engine]), f"{name}: {build}"
        else:
            assert build.get("target") in ("gateway", "engine"), f"{name}: {build}"
        assert "PYTHONPATH" not in (service.get("environment") or {}), name
        for volume in service.get("volumes", []):
            assert not str(volume).startswith(f"{ROOT}:"), f"{name} mounts the source: {volume}"


@pytest.mark.parametrize("stack", STACKS, ids=lambda p: p.stem)
def test_stack_takes_the_observability_override(stack: Path) -> None:
    """compose/observability.yml adds Prometheus and Grafana to every stack."""
    compose = shutil.which("docker-compose")
    assert compose
    out = subprocess.run([compose, "-f", str(stack), "-f", str(ROOT / "compose" /
                          "observability.yml"), "config", "--services"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert {"prometheus", "grafana", "gateway"} <= set(out.stdout.split())
