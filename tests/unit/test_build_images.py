"""scripts/build_images.py keys each image on what goes into it: its stages' instructions and
the files their COPY lines name (the images themselves are built in
tests/integration/containers)."""

from __future__ import annotations

from tests.support.scripts import load_script

build_images = load_script("build_images")
PACKAGES = ["adapters", "kvcore", "kvsidecar", "refengine", "replay", "routing", "shm", "sidecar"]


def test_each_image_is_keyed_on_the_files_its_stages_copy() -> None:
    """The slim, engine and plugin images copy the packages, pyproject.toml and the
    requirements script, and nothing else: no README, docs, tests or scripts."""
    kvsidecar = build_images.IMAGES / "kvsidecar.Containerfile"
    plugin = build_images.IMAGES / "plugin.Containerfile"
    for containerfile, target in ((kvsidecar, "gateway"), (kvsidecar, "engine"), (plugin, "")):
        _, copied = build_images.stage_inputs(containerfile, target)
        assert copied == sorted(["compose/images/requirements.py", "pyproject.toml", *PACKAGES])


def test_an_image_is_keyed_on_its_own_stages_only() -> None:
    """The engine image's stages are the slim image's dependency stage plus its own; the slim
    image's key does not cover the engine's stages (torch is installed there)."""
    kvsidecar = build_images.IMAGES / "kvsidecar.Containerfile"
    gateway, _ = build_images.stage_inputs(kvsidecar, "gateway")
    engine, _ = build_images.stage_inputs(kvsidecar, "engine")
    assert gateway[0] == engine[0] == "FROM ${BASE} AS deps"
    assert "FROM deps AS engine-deps" in engine and "FROM deps AS engine-deps" not in gateway
    assert "FROM deps AS gateway" in gateway and "FROM deps AS gateway" not in engine
    assert not any("#" in line for line in gateway + engine)  # comments are not inputs
