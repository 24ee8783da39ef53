"""compose/cpu.yml for real: our images built with podman, the stack up, a chat through it.

The images are built by scripts/build_images.py from a Debian base made by debootstrap (no
registry is reachable for base images); a re-run on the same machine reuses what is up to
date. The stack runs under docker-compose on podman's API (see ``podman.py`` for why not
podman-compose).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.integration.containers.podman import (
    Compose,
    build_images,
    podman,
    podman_service,
    require,
)
from tests.support.polling import eventually

ROOT = Path(__file__).resolve().parents[3]
CPU = ROOT / "compose" / "cpu.yml"
SERVICES = {"engine-0", "engine-1", "sidecar-0", "sidecar-1", "gateway"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def images() -> None:
    """The base, slim and engine images (built, or found up to date)."""
    require("debootstrap")
    build_images("base", "gateway", "engine")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def stack(images: None) -> Iterator[tuple[Compose, str]]:
    port = free_port()
    with podman_service() as docker_host:
        compose = Compose(docker_host, f"kvs-e2e-{os.getpid()}-{port}", [CPU],
                          {"KVSIDECAR_GATEWAY_PORT": str(port)})
        up = compose.run("up", "-d", "--no-build")
        try:
            assert up.returncode == 0, f"compose up failed:\n{up.stderr}"
            yield compose, f"http://127.0.0.1:{port}"
        finally:
            compose.down()


def test_slim_image_has_no_torch(images: None) -> None:
    """The gateway/sidecar image is slim: no torch in it, and its CLI runs."""
    out = podman("run", "--rm", "--entrypoint", "python3", "kvsidecar:latest", "-c",
                 "import torch", check=False)
    assert out.returncode != 0 and "No module named 'torch'" in out.stderr, out.stderr
    assert podman("run", "--rm", "kvsidecar:latest", "gateway", "--help").returncode == 0


def test_engine_image_has_cpu_torch(images: None) -> None:
    """The engine image carries the CPU build of torch."""
    out = podman("run", "--rm", "--entrypoint", "python3", "kvsidecar-engine:latest", "-c",
                 "import torch; print(torch.__version__, torch.cuda.is_available())")
    assert out.stdout.split() == ["2.13.0+cpu", "False"], out.stdout


async def test_cpu_stack_serves_a_chat_and_stops_cleanly(stack: tuple[Compose, str]) -> None:
    """Up: five containers; a chat through the gateway answers 200 from a named worker; the
    sidecars' stores live in their engines' shared memory; stop: every container exits 0;
    down: nothing of the project is left."""
    compose, url = stack
    assert {n.split("_")[1] for n in compose.containers()} == SERVICES

    async with aiohttp.ClientSession() as session:

        async def routable() -> bool:
            try:
                async with session.get(f"{url}/v1/workers") as resp:
                    workers = (await resp.json())["workers"]
            except aiohttp.ClientError as exc:
                raise AssertionError(f"gateway not answering: {exc!r}") from exc
            ready = [w["worker_id"] for w in workers if w["routable"] and w["healthy"]]
            assert len(ready) == 2, f"routable workers: {ready}\n{compose.logs()}"
            return True

        await eventually(routable, "both replicas routable through the gateway", 120, 0.2)
        body = {"model": "tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello from the compose test"}]}
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            worker = resp.headers.get("x-kvsidecar-worker")
            answer = await resp.json()
        assert worker in {"replica-0", "replica-1"}
        assert answer["choices"][0]["message"]["content"]
        assert answer["usage"]["prompt_tokens"] > 0

    # ipc: service:engine-N — the sidecar's store segment is visible inside its engine
    engine = next(n for n in compose.containers() if "_engine-0_" in n)
    shm = podman("exec", engine, "ls", "/dev/shm").stdout.split()
    assert "kvsidecar-replica-0.sock" in shm, shm

    stopped = compose.run("stop")
    assert stopped.returncode == 0, stopped.stderr
    states = compose.containers()
    assert states and all(s == ("exited", 0) for s in states.values()), (
        f"{states}\n{compose.logs()}")
    compose.down()
    assert compose.containers() == {}
    networks = podman("network", "ls", "--format", "{{.Name}}").stdout.split()
    assert f"{compose.project}_default" not in networks
