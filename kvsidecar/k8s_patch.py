"""The sidecar injection, as pure edits over a parsed Kubernetes object.

One plan serves both ``kvsidecar inject`` (which splices the edits into the manifest's text,
``kvsidecar.yaml_splice``) and ``kvsidecar webhook`` (which sends them as a JSON Patch,
``json_patch``). A plan only ever *adds*: the sidecar container, the engine flags the sidecar
needs when they are absent, a memory-backed ``/dev/shm`` shared by both containers and, for
TensorRT-LLM, the ``--extra_llm_api_options`` file that turns its KV events on. A pod that
already has a ``kvsidecar`` container gets no plan at all, so injecting twice changes nothing.

The sidecar's ``--role`` (agg, prefill or decode) comes from the engine's own P/D flags or the
pod's ``kvsidecar.io/role`` annotation (``kvsidecar.engine_role``). An engine started by a
shell script is read, never rewritten (``kvsidecar.engine_command``): when its command lacks
a flag, the plan is refused with the exact words to add.

Edits and their JSON Patch: ``kvsidecar.k8s_edits``; which kinds hold pod templates, and
where: ``kvsidecar.k8s_kinds``.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adapters.base import EngineKind
from kvsidecar.engine_command import engine_command, engine_port, script_edit
from kvsidecar.engine_flags import flag_value, has_flag
from kvsidecar.engine_role import engine_role
from kvsidecar.inject_options import InjectOptions
from kvsidecar.k8s_edits import AddKey, Append, Edit, Path, get_path
from kvsidecar.k8s_kinds import describe, pod_spec_paths, template_name, unhandled

__all__ = [
    "SIDECAR_NAME",
    "InjectError",
    "InjectOptions",
    "NoEngineError",
    "ObjectPlan",
    "describe",
    "plan_object",
    "pod_spec_paths",
]

SIDECAR_NAME = "kvsidecar"
SHM_VOLUME = "kvsidecar-dshm"
CONFIG_VOLUME = "kvsidecar-config"
CONFIG_DIR = "/etc/kvsidecar"
TRTLLM_OPTIONS_FILE = f"{CONFIG_DIR}/trtllm-extra.yml"
STORE_SOCKET = "/dev/shm/kvsidecar.sock"
SGLANG_KV_EVENTS = json.dumps(
    {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"},
    separators=(",", ":"),
)
VLLM_KV_EVENTS = json.dumps(
    {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558"},
    separators=(",", ":"),
)
# What the sidecar needs from TensorRT-LLM (compose/trtllm-extra.yml).
TRTLLM_OPTIONS = "kv_cache_config:\n  enable_block_reuse: true\n  event_buffer_max_size: 1024\n"
TRTLLM_BLOCK_SIZE = 32  # TensorRT-LLM's default tokens_per_block
_WRITE_OPTIONS = f'printf "%s" "$KVSIDECAR_TRTLLM_OPTIONS" > {TRTLLM_OPTIONS_FILE}'
_DEFAULT_PORT = {EngineKind.SGLANG: 30000, EngineKind.TRTLLM: 8000, EngineKind.VLLM: 8000}
# `vllm serve` (any path to the vllm script); a lone `vllm` word is the one a script's
# command line is searched for (engine_command)
_VLLM_SERVE = re.compile(r"(?:^|[\s/])vllm(?:\s+serve\b|$)")

class InjectError(ValueError):
    """An object that cannot be injected, with what was found and what to do."""


class NoEngineError(InjectError):
    """A pod spec with no container recognisably SGLang, TensorRT-LLM or vLLM."""


@dataclass(frozen=True)
class ObjectPlan:
    """The edits to one object, and what the user should know about them."""

    edits: tuple[Edit, ...]
    notes: tuple[str, ...] = ()
    patched: int = 0  # pod specs given a sidecar
    injected: int = 0  # pod specs that already had one
    skipped: tuple[str, ...] = ()  # pod specs without an engine (when told to skip them)


def plan_object(
    obj: Mapping[str, Any], opts: InjectOptions, skip_no_engine: bool = False
) -> ObjectPlan:
    """The edits that inject the sidecar into every pod spec of ``obj`` (none: nothing to do).

    Raises ``InjectError`` for a pod spec whose engine container cannot be found or patched
    (``NoEngineError`` when none was found), and for pod templates of a kind or shape it
    does not inject (``kvsidecar.k8s_kinds.unhandled``); with ``skip_no_engine`` both are
    only listed in ``skipped``.
    """
    edits: list[Edit] = []
    notes: list[str] = []
    skipped: list[str] = []
    patched = injected = 0
    for why in unhandled(obj):
        if not skip_no_engine:
            raise InjectError(why)
        skipped.append(why)
    for path in pod_spec_paths(obj):
        spec = get_path(obj, path)
        what = describe(get_path(obj, path[:2]) if path[0] == "items" else obj)
        if (template := template_name(path)) is not None:
            what += f" {template}"
        if is_injected(spec):
            injected += 1
            continue
        try:
            meta = get_path(obj, path[:-1]).get("metadata")
            planner = _PodPlanner(spec, path, opts, what, _annotations(meta, what))
            edits += planner.plan()
        except NoEngineError as exc:
            if not skip_no_engine:
                raise
            skipped.append(str(exc))
            continue
        notes += planner.notes
        patched += 1
    return ObjectPlan(tuple(edits), tuple(notes), patched, injected, tuple(skipped))


def _annotations(meta: Any, what: str) -> Mapping[str, Any]:
    """The pod's (or pod template's) annotations, checked to be an object."""
    found = meta.get("annotations") if isinstance(meta, Mapping) else None
    if found is None:
        return {}
    if not isinstance(found, Mapping):
        raise InjectError(f"{what}: metadata.annotations must be an object, got {found!r:.60}")
    return found


def is_injected(spec: Mapping[str, Any]) -> bool:
    return any(c.get("name") == SIDECAR_NAME for c in _containers(spec))


def _containers(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    found = spec.get("containers")
    if found is None:
        return []
    if not isinstance(found, list) or not all(isinstance(c, Mapping) for c in found):
        raise InjectError(f"containers must be a list of objects, got {found!r:.200}")
    return found


def _tokens(container: Mapping[str, Any]) -> list[str]:
    return [str(t) for key in ("command", "args") for t in (container.get(key) or [])]


def detect_engine(container: Mapping[str, Any]) -> EngineKind | None:
    """SGLang, TensorRT-LLM or vLLM, from the container's command, args and image."""
    tokens = _tokens(container)
    words = " ".join(tokens)
    image = str(container.get("image", ""))
    if (
        "vllm.entrypoints.openai.api_server" in words
        or _VLLM_SERVE.search(words)  # vllm serve ..., in exec form or inside a script
        or "vllm/vllm-openai" in image
    ):
        return EngineKind.VLLM
    if "sglang.launch_server" in words or "lmsysorg/sglang" in image:
        return EngineKind.SGLANG
    if "trtllm-serve" in words or "nvcr.io/nvidia/tensorrt-llm" in image:
        return EngineKind.TRTLLM
    return None


@dataclass
class _PodPlanner:
    """Builds one pod spec's edits against a working copy, so later edits see earlier ones."""

    spec: Mapping[str, Any]
    path: Path
    opts: InjectOptions
    what: str
    annotations: Mapping[str, Any] = field(default_factory=dict)
    edits: list[Edit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _created: dict[Path, list[Any]] = field(default_factory=dict)

    def plan(self) -> list[Edit]:
        index, engine = self._engine_container()
        container = _containers(self.spec)[index]
        cpath: Path = ("containers", index)
        try:
            command = engine_command(
                _tokens(container), lambda word: detect_engine({"command": [word]}) is engine,
                str(engine),
            )
            tokens = command.words
            self._not_the_orchestrator(engine, tokens)
            role = engine_role(engine, tokens, self.annotations)
            port = engine_port(tokens, _DEFAULT_PORT[engine], container.get("env"))
        except InjectError:
            raise
        except ValueError as exc:
            raise InjectError(f"{self.what}: container {container.get('name')!r}: {exc}") from exc
        if role.note is not None:
            self.notes.append(f"{self.what}: {role.note}")
        self._check_ports(port)
        flags = self._engine_flags(engine, tokens)
        if flags and command.script_line is not None:
            name = str(container.get("name"))
            raise InjectError(f"{self.what}: {script_edit(name, command.script_line, flags)}")
        shm = self._shm_volume(container, cpath)
        if engine is EngineKind.TRTLLM and flag_value(tokens, "--extra_llm_api_options") in (
            None, TRTLLM_OPTIONS_FILE
        ):
            self._trtllm_options(cpath)
        if flags:
            target = "args" if "args" in container else "command"
            if target not in container:
                raise InjectError(
                    f"{self.what}: container {container.get('name')!r} has neither command "
                    "nor args, so its engine flags cannot be added: give its launch command "
                    "(e.g. command: [python3, -m, sglang.launch_server, ...])"
                )
            for flag in flags:
                self._append((*cpath, target), flag)
        sidecar = self._sidecar(engine, container, tokens, shm, port, role.role)
        self._append(("containers",), sidecar)
        return self.edits

    # -- finding and checking the engine ------------------------------------------------------

    def _engine_container(self) -> tuple[int, EngineKind]:
        containers = _containers(self.spec)
        names = [str(c.get("name")) for c in containers]
        if self.opts.container is not None:
            if self.opts.container not in names:
                raise NoEngineError(
                    f"{self.what}: no container named {self.opts.container!r} "
                    f"(containers: {', '.join(names) or 'none'})"
                )
            index = names.index(self.opts.container)
            engine = self.opts.engine or detect_engine(containers[index])
            if engine is None:
                raise InjectError(
                    f"{self.what}: container {self.opts.container!r} is not SGLang, "
                    "TensorRT-LLM or vLLM as far as its command and image tell: say which "
                    "with --engine"
                )
            return index, engine
        found = [(i, e) for i, c in enumerate(containers) if (e := detect_engine(c)) is not None]
        if len(found) == 1:
            return found[0][0], self.opts.engine or found[0][1]
        listed = ", ".join(f"{c.get('name')} ({c.get('image', 'no image')})" for c in containers)
        if not found:
            raise NoEngineError(
                f"{self.what}: no SGLang, TensorRT-LLM or vLLM container found (containers: "
                f"{listed or 'none'}); name the engine's with --container (and --engine)"
            )
        raise InjectError(
            f"{self.what}: several engine containers ({', '.join(names[i] for i, _ in found)}); "
            "name the one to serve with --container"
        )

    def _not_the_orchestrator(self, engine: EngineKind, tokens: list[str]) -> None:
        """``trtllm-serve disaggregated`` pairs context and generation servers and holds no
        KV cache: it is no engine to put a sidecar beside."""
        serve = next((i for i, t in enumerate(tokens) if "trtllm-serve" in t), None)
        if engine is EngineKind.TRTLLM and serve is not None and tokens[serve + 1:serve + 2] == [
            "disaggregated"
        ]:
            raise NoEngineError(
                f"{self.what}: it runs trtllm-serve disaggregated, TensorRT-LLM's P/D "
                "orchestrator, which holds no KV cache and needs no sidecar (its context and "
                "generation servers get theirs)"
            )

    def _check_ports(self, engine_port: str) -> None:
        if engine_port == str(self.opts.sidecar_port):
            raise InjectError(
                f"{self.what}: the engine listens on {self.opts.sidecar_port}, the sidecar's "
                "port; pick another with --sidecar-port"
            )
        for c in _containers(self.spec):
            for port in c.get("ports") or []:
                taken = isinstance(port, Mapping) and port.get("containerPort")
                if taken == self.opts.sidecar_port:
                    raise InjectError(
                        f"{self.what}: container {c.get('name')!r} already uses port "
                        f"{self.opts.sidecar_port}; pick another with --sidecar-port"
                    )

    # -- the engine's flags ---------------------------------------------------------------------

    def _engine_flags(self, engine: EngineKind, tokens: list[str]) -> list[str]:
        flags: list[str] = []
        if engine is EngineKind.SGLANG:
            if not has_flag(tokens, "--kv-events-config"):
                flags += ["--kv-events-config", SGLANG_KV_EVENTS]
            if self.opts.store_capacity_bytes is not None:
                flags += self._hicache_flags(tokens)
        elif engine is EngineKind.VLLM:
            if not has_flag(tokens, "--kv-events-config"):
                flags += ["--kv-events-config", VLLM_KV_EVENTS]
            if not has_flag(tokens, "--enable-prompt-tokens-details"):
                flags += ["--enable-prompt-tokens-details"]
        elif not has_flag(tokens, "--extra_llm_api_options"):
            flags += ["--extra_llm_api_options", TRTLLM_OPTIONS_FILE]
        elif flag_value(tokens, "--extra_llm_api_options") != TRTLLM_OPTIONS_FILE:
            self.notes.append(
                f"{self.what}: --extra_llm_api_options is already set and left as is; its file "
                "must enable kv_cache_config.event_buffer_max_size (> 0) and enable_block_reuse"
            )
        return flags

    def _hicache_flags(self, tokens: list[str]) -> list[str]:
        backend = flag_value(tokens, "--hicache-storage-backend")
        if backend is not None and backend != "dynamic":
            raise InjectError(
                f"{self.what}: the engine already uses HiCache storage backend {backend!r}; "
                "drop --store-capacity-bytes or that flag"
            )
        flags = [] if has_flag(tokens, "--enable-hierarchical-cache") else [
            "--enable-hierarchical-cache"
        ]
        if backend is None:
            extra = {
                "backend_name": "kvsidecar",
                "module_path": "adapters.sglang.hicache",
                "class_name": "KvSidecarHiCacheStorage",
                "interface_v1": 1,
                "socket": STORE_SOCKET,
            }
            flags += [
                "--hicache-storage-backend", "dynamic",
                "--hicache-storage-backend-extra-config", json.dumps(extra, separators=(",", ":")),
            ]
        return flags

    # -- volumes and the sidecar ----------------------------------------------------------------

    def _shm_volume(self, container: Mapping[str, Any], cpath: Path) -> str:
        """The volume at the engine's /dev/shm (added, memory-backed, when there is none)."""
        for mount in container.get("volumeMounts") or []:
            if isinstance(mount, Mapping) and mount.get("mountPath") in ("/dev/shm", "/dev/shm/"):
                return str(mount.get("name"))
        self._add_volume({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
        self._append((*cpath, "volumeMounts"), {"name": SHM_VOLUME, "mountPath": "/dev/shm"})
        return SHM_VOLUME

    def _add_volume(self, volume: dict[str, Any]) -> None:
        names = {v.get("name") for v in self.spec.get("volumes") or [] if isinstance(v, Mapping)}
        if volume["name"] in names:
            raise InjectError(
                f"{self.what}: a volume named {volume['name']!r} exists but is not the one "
                "kvsidecar adds; rename it"
            )
        self._append(("volumes",), volume)

    def _sidecar(
        self, engine: EngineKind, container: Mapping[str, Any], tokens: list[str], shm: str,
        port: str, role: str,
    ) -> dict[str, Any]:
        mounts = [{"name": shm, "mountPath": "/dev/shm"}]
        args = [
            "--engine", str(engine),
            "--engine-url", f"http://127.0.0.1:{port}",
            "--host", "0.0.0.0",
            "--port", str(self.opts.sidecar_port),
            "--role", role,
        ]
        if engine is EngineKind.TRTLLM:
            args += ["--block-size", str(TRTLLM_BLOCK_SIZE)]
        if self.opts.store_capacity_bytes is not None and engine is EngineKind.SGLANG:
            args += [
                "--store-capacity-bytes", self.opts.store_capacity_bytes,
                "--store-socket", STORE_SOCKET,
            ]
            args += self._model_for_store(container, tokens, mounts)
        elif self.opts.store_capacity_bytes is not None and engine is EngineKind.VLLM:
            self.notes.append(
                f"{self.what}: no store added: kvsidecar has no vLLM KV connector yet"
            )
        elif self.opts.store_capacity_bytes is not None:
            self.notes.append(
                f"{self.what}: no store added: for TensorRT-LLM it is reached through its KV "
                "cache connector (kv_connector_config in --extra_llm_api_options), which "
                "inject does not configure"
            )
        args += list(self.opts.sidecar_args)
        return {
            "name": SIDECAR_NAME,
            "image": self.opts.sidecar_image,
            "command": ["kvsidecar", "sidecar"],
            "args": args,
            "ports": [
                {"name": "kvsidecar", "containerPort": self.opts.sidecar_port, "protocol": "TCP"}
            ],
            "readinessProbe": {
                "httpGet": {"path": "/health", "port": self.opts.sidecar_port},
                "periodSeconds": 5,
                "failureThreshold": 3,
            },
            "volumeMounts": mounts,
        }

    def _model_for_store(
        self, container: Mapping[str, Any], tokens: list[str], mounts: list[dict[str, Any]]
    ) -> list[str]:
        """The store's block size comes from the model's config.json: the sidecar mounts the
        engine's volume holding ``--model-path`` (read-only) and is told the path."""
        model = flag_value(tokens, "--model-path")
        held = [
            m for m in container.get("volumeMounts") or []
            if isinstance(m, Mapping) and model is not None
            and (model + "/").startswith(str(m.get("mountPath", "")).rstrip("/") + "/")
        ]
        if model is None or not held:
            self.notes.append(
                f"{self.what}: the sidecar's store needs the model's config.json, and the "
                f"engine's --model-path {model!r} is on no volume it mounts: give the sidecar "
                "--sidecar-arg=--store-block-bytes=N (one host page in bytes)"
            )
            return []
        mount = dict(max(held, key=lambda m: len(str(m["mountPath"]))))
        mount["readOnly"] = True
        mounts.append({k: v for k, v in mount.items() if k != "mountPropagation"})
        return ["--model-path", model]

    def _trtllm_options(self, cpath: Path) -> None:
        """The --extra_llm_api_options file, written by an init container into an emptyDir."""
        self._add_volume({"name": CONFIG_VOLUME, "emptyDir": {}})
        mount = {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True}
        self._append((*cpath, "volumeMounts"), mount)
        self._append(
            ("initContainers",),
            {
                "name": f"{SIDECAR_NAME}-config",
                "image": self.opts.sidecar_image,
                "command": ["sh", "-c", _WRITE_OPTIONS],
                "env": [{"name": "KVSIDECAR_TRTLLM_OPTIONS", "value": TRTLLM_OPTIONS}],
                "volumeMounts": [{"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR}],
            },
        )

    def _append(self, rel: Path, value: Any) -> None:
        """Append to the list at ``rel`` (pod-spec relative), creating the key when absent."""
        value = copy.deepcopy(value)
        if rel in self._created:
            self._created[rel].append(value)
            return
        parent = get_path(self.spec, rel[:-1])
        key = rel[-1]
        assert isinstance(key, str)
        existing = parent.get(key)
        if isinstance(existing, list):
            self.edits.append(Append((*self.path, *rel), value))
            return
        if existing is not None or key in parent:
            raise InjectError(
                f"{self.what}: {'.'.join(map(str, rel))} is {existing!r:.60}, not a list; "
                "make it one (or leave it out)"
            )
        created = [value]
        self._created[rel] = created
        self.edits.append(AddKey((*self.path, *rel[:-1]), key, created))
