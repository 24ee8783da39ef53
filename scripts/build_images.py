"""Build kvsidecar's container images with podman, from a Debian base made by debootstrap.

    python scripts/build_images.py                      # base, gateway (slim), engine
    python scripts/build_images.py gateway --base python:3.11-slim
    python scripts/build_images.py plugin-sglang --engine-image sglang=lmsysorg/sglang:v0.5.23
    python scripts/build_images.py --host-pip           # this machine's pip settings, see below

Roles (images):

- ``base``: ``localhost/kvsidecar-base:bookworm``, a Debian bookworm root filesystem made by
  ``debootstrap --variant=minbase`` with python3 and its venv module, ``podman import``-ed.
  For machines that cannot pull ``python:3.11-slim``; skipped when ``--base`` names another.
- ``gateway``: ``kvsidecar:latest``, the slim gateway / sidecar image (no torch).
- ``engine``: ``kvsidecar-engine:latest``, the reference engine (the slim image's content + CPU
  torch; both are targets of ``compose/images/kvsidecar.Containerfile``).
- ``plugin-sglang`` / ``plugin-trtllm``: ``kvsidecar-sglang:v0.5.23`` /
  ``kvsidecar-trtllm:1.1.0``, our HiCache backend and KV connector installed into the official
  engine images (``--engine-image`` overrides which).

Every image carries a label with a hash of its inputs: the instructions of the Containerfile
stages it is built from, the files those stages COPY (read off the COPY lines, so a change to
the docs, the tests or the scripts rebuilds nothing, and the engine's own stage does not
rebuild the slim image), build arguments and its parent image. An image whose label matches is
not rebuilt, and the base root filesystem is kept as a tarball in the cache directory, so
re-running is quick. ``--force`` rebuilds.

``--host-pip`` builds with the host network and this machine's pip settings (the CA bundle,
find-links directories and ``file://`` indexes ``pip config list`` shows, bind-mounted at the
same paths): for machines that reach PyPI only through an intercepting proxy or keep wheels
(the CPU torch) on disk. Without it the Containerfiles use PyPI as anyone would.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "compose" / "images"
LABEL = "org.kvsidecar.inputs"
BASE_IMAGE = "localhost/kvsidecar-base:bookworm"
# What the base root filesystem is made of; changing it changes its hash (and rebuilds it).
DEBOOTSTRAP = {
    "suite": "bookworm",
    "variant": "minbase",
    # libatomic1: the block store's compare-and-swap (shm/_atomic.py)
    "include": ["python3", "python3-venv", "ca-certificates", "libatomic1"],
}
ENGINE_IMAGES = {"sglang": "lmsysorg/sglang:v0.5.23",
                 "trtllm": "nvcr.io/nvidia/tensorrt-llm/release:1.1.0"}
PLUGIN_TAGS = {"sglang": "kvsidecar-sglang:v0.5.23", "trtllm": "kvsidecar-trtllm:1.1.0"}
ROLES = ["base", "gateway", "engine", "plugin-sglang", "plugin-trtllm"]


def say(message: str) -> None:
    print(f"[build_images] {message}", file=sys.stderr, flush=True)


def run(cmd: Sequence[str], log: Path | None = None) -> None:
    """Run ``cmd``; its output goes to ``log`` (shown in part when it fails) or through."""
    if log is None:
        subprocess.run(cmd, check=True)
        return
    with log.open("wb") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        raise SystemExit(
            f"{cmd[0]} failed (exit {done.returncode}); the end of {log}:\n" + "\n".join(tail)
        )


def podman(*args: str) -> str:
    out = subprocess.run(["podman", *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def image_label(image: str) -> str:
    """The input hash an existing image carries ('' if there is no such image)."""
    return podman("image", "inspect", "--format", f'{{{{index .Config.Labels "{LABEL}"}}}}',
                  image)


def image_id(image: str) -> str:
    return podman("image", "inspect", "--format", "{{.Id}}", image)


def stage_inputs(containerfile: Path, target: str = "") -> tuple[list[str], list[str]]:
    """The instructions of the stages ``target`` (default: the last stage) is built from, and
    the build-context paths their COPY lines name: what goes into that image."""
    stages: dict[str, tuple[str, list[str]]] = {}  # name → (what it is FROM, instructions)
    current = ""
    joined = containerfile.read_text().replace("\\\n", " ")
    for line in (ln.strip() for ln in joined.splitlines()):
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            parent, _, name = rest.partition(" AS ")
            current = name.strip() or f"stage-{len(stages)}"
            stages[current] = (parent.strip(), [])
        if current:  # ARGs before the first FROM only name build arguments, hashed apart
            stages[current][1].append(" ".join(line.split()))
    instructions: list[str] = []
    copied: list[str] = []
    stage: str | None = target or current
    while stage in stages:
        parent, lines = stages[stage]
        instructions[:0] = lines
        for line in lines:
            words = line.split()
            if words[0].upper() == "COPY" and not any(w.startswith("--from") for w in words):
                copied += [w for w in words[1:-1] if not w.startswith("--")]
        stage = parent
    return instructions, sorted(set(copied))


def hash_inputs(paths: Iterable[Path], extra: object) -> str:
    """sha256 over the files under ``paths`` (names and contents, caches skipped) + ``extra``."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
    for top in paths:
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            h.update(str(f.relative_to(ROOT)).encode() + b"\0")
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:24]


@dataclass
class HostPip:
    """This machine's pip settings, as podman build flags and a PIP_ARGS build argument."""

    mounts: list[str] = field(default_factory=list)
    pip_args: list[str] = field(default_factory=list)

    @classmethod
    def detect(cls) -> HostPip:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True).stdout
        settings: dict[str, list[str]] = {}
        for line in out.splitlines():
            key, _, value = line.partition("=")
            option = key.rsplit(".", 1)[-1]
            settings.setdefault(option, []).extend(value.strip("'\"").split())
        cert = os.environ.get("PIP_CERT") or next(iter(settings.get("cert", [])), "")
        host = cls()
        if cert and Path(cert).is_file():
            host.mount(cert)
            host.pip_args += ["--cert", cert]
        for links in dict.fromkeys(settings.get("find-links", [])):
            if Path(links).is_dir():
                host.mount(links)
                host.pip_args += ["--find-links", links]
        for index in dict.fromkeys(settings.get("extra-index-url", [])):
            path = index.removeprefix("file://")
            if index.startswith("file://") and Path(path).is_dir():
                # mount the index's parent: its pages link to files beside it (../files)
                host.mount(str(Path(path).parent))
                host.pip_args += ["--extra-index-url", index]
            elif not index.startswith("file://"):
                host.pip_args += ["--extra-index-url", index]
        return host

    def mount(self, path: str) -> None:
        flag = f"{path}:{path}:ro"
        if flag not in self.mounts:
            self.mounts.append(flag)

    def build_flags(self) -> list[str]:
        return ["--network", "host", *(f for m in self.mounts for f in ("-v", m))]


@dataclass
class Builder:
    base: str
    host: HostPip | None
    cache: Path
    force: bool
    engine_images: dict[str, str]
    plugin_tags: dict[str, str] = field(default_factory=lambda: dict(PLUGIN_TAGS))
    timings: dict[str, float] = field(default_factory=dict)

    def build_base(self) -> None:
        key = hash_inputs([], DEBOOTSTRAP)
        if not self.force and image_label(BASE_IMAGE) == key:
            say(f"base: {BASE_IMAGE} is up to date ({key})")
            return
        if shutil.which("debootstrap") is None:
            raise SystemExit("debootstrap is not installed (apt-get install debootstrap)")
        started = time.monotonic()
        tarball = self.cache / f"base-{key}.tar"
        if self.force or not tarball.exists():
            mirror = os.environ.get("KVSIDECAR_DEBIAN_MIRROR", "http://deb.debian.org/debian")
            say(f"base: debootstrap {DEBOOTSTRAP['suite']} ({DEBOOTSTRAP['variant']}) from "
                f"{mirror} (about a minute)")
            self.cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="kvsidecar-rootfs-") as tmp:
                rootfs = Path(tmp) / "rootfs"
                run(["debootstrap", f"--variant={DEBOOTSTRAP['variant']}",
                     "--include=" + ",".join(DEBOOTSTRAP["include"]),
                     str(DEBOOTSTRAP["suite"]), str(rootfs), mirror],
                    log=self.cache / "debootstrap.log")
                for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
                    for f in (rootfs / junk).glob("*"):
                        if f.is_file():
                            f.unlink()
                partial = tarball.with_suffix(".partial")
                run(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(partial), "."])
                partial.rename(tarball)
        say(f"base: podman import {tarball.name} as {BASE_IMAGE}")
        run(["podman", "import", "--change", 'CMD ["/bin/bash"]',
             "--change", f"LABEL {LABEL}={key}", str(tarball), BASE_IMAGE],
            log=self.cache / "import.log")
        self.timings["base"] = time.monotonic() - started

    def build(self, role: str, containerfile: str, tag: str, args: dict[str, str],
              parent: str, target: str = "") -> None:
        parent_id = image_id(parent)
        pip_args = " ".join(self.host.pip_args) if self.host else ""
        if pip_args:
            args = {"PIP_ARGS": pip_args, **args}
        instructions, copied = stage_inputs(IMAGES / containerfile, target)
        key = hash_inputs([ROOT / c for c in copied],
                          {"args": args, "parent": parent_id, "instructions": instructions})
        if not self.force and parent_id and image_label(tag) == key:
            say(f"{role}: {tag} is up to date ({key})")
            return
        say(f"{role}: podman build -f compose/images/{containerfile} -t {tag}")
        started = time.monotonic()
        cmd = ["podman", "build", "-f", str(IMAGES / containerfile), "-t", tag,
               "--ignorefile", str(IMAGES / "containerignore"), "--label", f"{LABEL}={key}",
               *(["--target", target] if target else []),
               *(self.host.build_flags() if self.host else [])]
        for name, value in args.items():
            cmd += ["--build-arg", f"{name}={value}"]
        self.cache.mkdir(parents=True, exist_ok=True)
        # the image it replaces stays, untagged: removing it would drop the intermediate
        # layers the next build reuses (`podman image prune` clears them)
        run([*cmd, str(ROOT)], log=self.cache / f"{role}.log")
        self.timings[role] = time.monotonic() - started
        say(f"{role}: built {tag} in {self.timings[role]:.0f}s")

    def role(self, role: str) -> None:
        if role == "base":
            if self.base == BASE_IMAGE:
                self.build_base()
        elif role == "gateway":
            self.build("gateway", "kvsidecar.Containerfile", "kvsidecar:latest",
                       {"BASE": self.base}, self.base, target="gateway")
        elif role == "engine":
            # with the host's settings the CPU wheel comes from its find-links directory
            torch = {"TORCH_PIP_ARGS": ""} if self.host else {}
            self.build("engine", "kvsidecar.Containerfile", "kvsidecar-engine:latest",
                       {"BASE": self.base, **torch}, self.base, target="engine")
        else:
            engine = role.removeprefix("plugin-")
            image = self.engine_images[engine]
            self.build(role, "plugin.Containerfile", self.plugin_tags[engine],
                       {"ENGINE_IMAGE": image}, image)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build_images.py",
        description="Build kvsidecar's container images with podman (see the module doc).",
    )
    parser.add_argument("roles", nargs="*", choices=[[], *ROLES], metavar="ROLE",
                        help=f"what to build, in order: {', '.join(ROLES)} "
                             "(default: base gateway engine)")
    parser.add_argument("--base", default=BASE_IMAGE,
                        help="the image the slim image builds FROM (default: the debootstrap "
                             f"image {BASE_IMAGE}; python:3.11-slim works where it can be pulled)")
    parser.add_argument("--host-pip", action="store_true",
                        help="build with the host network and this machine's pip settings")
    parser.add_argument("--engine-image", action="append", default=[], metavar="ENGINE=IMAGE",
                        help="the engine image a plugin layer builds on (sglang=..., trtllm=...)")
    parser.add_argument("--plugin-tag", action="append", default=[], metavar="ENGINE=TAG",
                        help="tag a plugin layer other than "
                             f"{' / '.join(PLUGIN_TAGS.values())} (sglang=..., trtllm=...)")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                        / "kvsidecar" / "images",
                        help="where the base rootfs tarball and build logs are kept")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    if shutil.which("podman") is None:
        parser.error("podman is not installed (apt-get install podman)")
    engine_images, plugin_tags = dict(ENGINE_IMAGES), dict(PLUGIN_TAGS)
    for flag, specs, table in (("--engine-image", args.engine_image, engine_images),
                               ("--plugin-tag", args.plugin_tag, plugin_tags)):
        for spec in specs:
            engine, sep, value = spec.partition("=")
            if not sep or not value or engine not in table:
                parser.error(f"{flag} {spec!r}: expected sglang=... or trtllm=...")
            table[engine] = value
    roles = args.roles or ["base", "gateway", "engine"]
    builder = Builder(args.base, HostPip.detect() if args.host_pip else None, args.cache_dir,
                      args.force, engine_images, plugin_tags)
    started = time.monotonic()
    for role in ROLES:  # in dependency order, whatever order they were named in
        if role in roles:
            builder.role(role)
    built = ", ".join(f"{r} {s:.0f}s" for r, s in builder.timings.items()) or "nothing to do"
    say(f"done in {time.monotonic() - started:.0f}s ({built})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
