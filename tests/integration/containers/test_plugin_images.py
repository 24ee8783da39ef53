"""The engine plugin layer (compose/images/plugin.Containerfile), built and imported against
each engine's Python dependency set.

The official images (lmsysorg/sglang, nvcr.io/nvidia/tensorrt-llm/release) cannot be pulled
here, so the layer is built on stand-ins (engine-standins.Containerfile): an engine Python with
CPU torch, and for SGLang the real sglang 0.5.23 package installed as scripts/test installs it.
The plugin adds kvsidecar with exactly the `engine-plugin` extra of pyproject.toml, and our
HiCache backend / KV connector must import in the engine's Python from it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.integration.containers.podman import build_images, podman, require

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
STANDIN = "localhost/kvsidecar-standin-{}:test"
PLUGIN = "localhost/kvsidecar-{}:standin-test"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def build_script() -> ModuleType:
    path = ROOT / "scripts" / "build_images.py"
    spec = importlib.util.spec_from_file_location("build_images", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_images"] = module
    spec.loader.exec_module(module)
    return module


def sglang_nodeps() -> str:
    """What scripts/test installs --no-deps for SGLang on CPU (its KVS_NODEPS)."""
    found = re.search(r'KVS_NODEPS="([^"]+)"', (ROOT / "scripts" / "test").read_text())
    assert found, "scripts/test no longer sets KVS_NODEPS"
    return found.group(1)


def name_of(requirement: str) -> str:
    return re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def sglang_shared_deps() -> str:
    """SGLang's own declared dependencies that our core dependencies also are (aiohttp, pyzmq,
    msgspec, ...): scripts/test's venv gets them from our core, the stand-in from SGLang's
    pins, as the official image does."""
    try:
        declared = importlib.metadata.requires("sglang") or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise AssertionError("sglang is not installed (scripts/test installs it)") from exc
    ours = {name_of(r) for r in extra("dependencies")}
    return " ".join(r.split(";")[0].replace(" ", "") for r in declared
                    if "extra ==" not in r and name_of(r) in ours)


def pip_freeze(image: str) -> dict[str, str]:
    out = podman("run", "--rm", "--entrypoint", "python3", image, "-m", "pip", "list",
                 "--format", "freeze", "--disable-pip-version-check").stdout
    pairs = (line.split("==", 1) for line in out.splitlines() if "==" in line)
    return {name.lower().replace("_", "-"): version for name, version in pairs}


@pytest.fixture(scope="module")
def standins() -> None:
    """Both stand-in engine images, on the debootstrap base (built or up to date)."""
    require("debootstrap")
    build_images("base")
    host = build_script().HostPip.detect()
    for engine in ("trtllm", "sglang"):
        cmd = ["build", "-f", str(HERE / "engine-standins.Containerfile"), "--target", engine,
               "-t", STANDIN.format(engine), "--ignorefile",
               str(ROOT / "compose" / "images" / "containerignore"), *host.build_flags(),
               "--build-arg", f"PIP_ARGS={' '.join(host.pip_args)}",
               "--build-arg", f"SGLANG_NODEPS={sglang_nodeps()}",
               "--build-arg", f"SGLANG_DEPS={sglang_shared_deps()}", str(ROOT)]
        podman(*cmd)


def extra(name: str) -> set[str]:
    spec = importlib.util.spec_from_file_location(
        "requirements", ROOT / "compose" / "images" / "requirements.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name_of(r) for r in module.requirements(ROOT / "pyproject.toml", name)}


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_plugin_layer_adds_exactly_the_extra_and_keeps_the_engines_torch(
    standins: None, engine: str
) -> None:
    """Built with build_images.py on the engine image: what it adds is kvsidecar and packages
    of the engine-plugin extra, nothing of the gateway's, and the engine's torch is unchanged."""
    build_images(f"plugin-{engine}", "--engine-image", f"{engine}={STANDIN.format(engine)}",
                 "--plugin-tag", f"{engine}={PLUGIN.format(engine)}")
    before, after = pip_freeze(STANDIN.format(engine)), pip_freeze(PLUGIN.format(engine))
    added = {name for name, version in after.items() if before.get(name) != version}
    assert "kvsidecar" in added
    assert added - {"kvsidecar"} <= extra("engine-plugin"), added
    assert after["torch"] == before["torch"]
    assert "aiohttp" not in added and "tokenizers" not in added


def test_sglang_loads_our_hicache_backend(standins: None) -> None:
    """In the SGLang plugin image, SGLang's own dynamic-backend loader finds our class and it
    is a subclass of SGLang's HiCacheStorage."""
    build_images("plugin-sglang", "--engine-image", f"sglang={STANDIN.format('sglang')}",
                 "--plugin-tag", f"sglang={PLUGIN.format('sglang')}")
    code = (
        "import importlib\n"
        "from sglang.srt.mem_cache.hicache_storage import HiCacheStorage\n"
        "mod = importlib.import_module('adapters.sglang.hicache')\n"
        "cls = getattr(mod, 'KvSidecarHiCacheStorage')\n"
        "assert issubclass(cls, HiCacheStorage), cls.__mro__\n"
        "import posix_ipc, structlog, shm\n"
        "print('ok', cls.__name__)\n"
    )
    out = podman("run", "--rm", "--entrypoint", "python3", PLUGIN.format("sglang"), "-c", code,
                 check=False)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


def test_trtllm_connector_imports_in_the_engine_python(standins: None) -> None:
    """In the TensorRT-LLM plugin image our connector module imports and names its classes
    (tensorrt_llm, CUDA-only, is absent from the stand-in: its stand-in bases are used)."""
    build_images("plugin-trtllm", "--engine-image", f"trtllm={STANDIN.format('trtllm')}",
                 "--plugin-tag", f"trtllm={PLUGIN.format('trtllm')}")
    code = (
        "from adapters.trtllm import connector\n"
        "print(connector.KvSidecarConnectorScheduler.__name__,\n"
        "      connector.KvSidecarConnectorWorker.__name__, connector.TRTLLM_AVAILABLE)\n"
    )
    out = podman("run", "--rm", "--entrypoint", "python3", PLUGIN.format("trtllm"), "-c", code,
                 check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["KvSidecarConnectorScheduler", "KvSidecarConnectorWorker",
                                  "False"]
