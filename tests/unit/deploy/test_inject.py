"""`kvsidecar inject`: the shipped example manifests and the YAML styles people write,
patched by insertion only, every object valid against the Kubernetes schema, twice = once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from adapters.base import EngineKind
from kvsidecar.inject import inject_text
from kvsidecar.k8s_patch import SGLANG_KV_EVENTS, InjectError, InjectOptions
from tests.support.inject_checks import check_injection, docs, inserted_lines
from tests.support.k8s import pod_specs

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "deploy" / "examples"
OPTS = InjectOptions(sidecar_image="registry.example/kvsidecar:0.1.0")


def _check(
    before: str, opts: InjectOptions = OPTS, block: bool = True, flow: tuple[str, ...] = ()
) -> str:
    return check_injection(before, opts, block, flow)


def _engine(doc: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod_specs(doc)[0]["containers"] if c["name"] != "kvsidecar")


def _sidecar(doc: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod_specs(doc)[0]["containers"] if c["name"] == "kvsidecar")


class TestExamples:
    def test_sglang_deployment(self) -> None:
        """The SGLang example gains the sidecar, /dev/shm and --kv-events-config; its
        Service and every comment pass through."""
        before = (EXAMPLES / "sglang-deployment.yaml").read_text()
        after = _check(before)
        deployment, service = docs(after)
        assert service == docs(before)[1]
        assert after.split("\n---\n")[1] == before.split("\n---\n")[1]
        engine, sidecar = _engine(deployment), _sidecar(deployment)
        assert engine["args"][-2:] == ["--kv-events-config", SGLANG_KV_EVENTS]
        assert {"name": "kvsidecar-dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
        assert sidecar["image"] == "registry.example/kvsidecar:0.1.0"
        assert sidecar["args"][:4] == ["--engine", "sglang", "--engine-url",
                                       "http://127.0.0.1:30000"]
        assert sidecar["readinessProbe"]["httpGet"] == {"path": "/health", "port": 9000}
        volumes = pod_specs(deployment)[0]["volumes"]
        assert {"name": "kvsidecar-dshm", "emptyDir": {"medium": "Memory"}} in volumes
        for line in before.splitlines():
            if line.lstrip().startswith("#"):
                assert line in after.splitlines()

    def test_trtllm_statefulset(self) -> None:
        """The TensorRT-LLM example gains the sidecar (block size 32) and an options file
        with KV events on, written by an init container; its ConfigMap passes through."""
        before = (EXAMPLES / "trtllm-deployment.yaml").read_text()
        after = _check(before)
        config_map, statefulset = docs(after)
        assert after.startswith(before.split("\n---\n")[0] + "\n---\n")
        assert config_map == docs(before)[0]
        engine, sidecar = _engine(statefulset), _sidecar(statefulset)
        assert engine["command"][-2:] == ["--extra_llm_api_options",
                                          "/etc/kvsidecar/trtllm-extra.yml"]
        assert sidecar["args"][:4] == ["--engine", "trtllm", "--engine-url",
                                       "http://127.0.0.1:8000"]
        assert "--block-size" in sidecar["args"]
        (init,) = pod_specs(statefulset)[0]["initContainers"]
        options = yaml.safe_load(init["env"][0]["value"])
        assert options["kv_cache_config"]["event_buffer_max_size"] > 0
        assert options["kv_cache_config"]["enable_block_reuse"] is True
        assert init["volumeMounts"][0]["mountPath"] == "/etc/kvsidecar"

    def test_hicache_store(self) -> None:
        """With a store size SGLang gets the HiCache backend on the sidecar's store socket,
        under /dev/shm which both containers mount."""
        before = (EXAMPLES / "sglang-deployment.yaml").read_text()
        opts = InjectOptions(store_capacity_bytes="16GiB", sidecar_args=("--model-id", "llama"))
        deployment = docs(_check(before, opts))[0]
        args, sidecar = _engine(deployment)["args"], _sidecar(deployment)["args"]
        assert "--enable-hierarchical-cache" in args
        assert args[args.index("--hicache-storage-backend") + 1] == "dynamic"
        extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
        assert extra["module_path"] == "adapters.sglang.hicache"
        socket = sidecar[sidecar.index("--store-socket") + 1]
        assert extra["socket"] == socket and socket.startswith("/dev/shm/")
        assert sidecar[sidecar.index("--store-capacity-bytes") + 1] == "16GiB"
        assert sidecar[sidecar.index("--model-path") + 1] == "/models/Llama-3.1-8B-Instruct"
        assert sidecar[-2:] == ["--model-id", "llama"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in _sidecar(
            deployment
        )["volumeMounts"]

    def test_store_needs_a_model_on_a_volume(self) -> None:
        """A store for an engine whose model is on no volume comes with a note saying how
        to size it; TensorRT-LLM gets no store, and a note saying why."""
        opts = InjectOptions(store_capacity_bytes="4GiB")
        result = inject_text(POD_INDENTLESS, opts)
        assert any("--store-block-bytes" in m for m in result.messages)
        trt = inject_text((EXAMPLES / "trtllm-deployment.yaml").read_text(), opts)
        assert "--store-capacity-bytes" not in trt.text
        assert any("kv_connector_config" in m for m in trt.messages)


POD_INDENTLESS = """\
apiVersion: v1
kind: Pod
metadata:
  name: sgl
spec:
  containers:
  - name: engine
    image: lmsysorg/sglang:v0.5.23
    command:
    - python3
    - -m
    - sglang.launch_server
    - --port=31000
    # trailing comment inside the list
  restartPolicy: Always
"""

POD_FLOW = """\
apiVersion: v1
kind: Pod
metadata: {name: sgl}
spec:
  containers: [{name: engine, image: lmsysorg/sglang:v0.5.23,
                args: ["python3", "-m", "sglang.launch_server"]}]
  volumes: []
"""

LIST = """\
apiVersion: v1
kind: List
items:
  - apiVersion: apps/v1
    kind: Deployment
    metadata: {name: gateway}
    spec:
      selector: {matchLabels: {app: gw}}
      template:
        metadata: {labels: {app: gw}}
        spec:
          containers:
            - name: gateway
              image: kvsidecar:latest
              args: [gateway]
  - apiVersion: apps/v1
    kind: Deployment
    metadata: {name: trt}
    spec:
      selector: {matchLabels: {app: trt}}
      template:
        metadata: {labels: {app: trt}}
        spec:
          containers:
            - name: trt
              image: nvcr.io/nvidia/tensorrt-llm/release:1.1.0
              command: [trtllm-serve, /models/m]
              volumeMounts:
                - {name: shm, mountPath: /dev/shm}
              env:
                - name: NOTE
                  value: |
                    a literal block as the container's last value
          volumes:
            - name: shm
              emptyDir: {medium: Memory, sizeLimit: 8Gi}
"""


class TestStyles:
    def test_indentless_lists_and_trailing_comment(self) -> None:
        """Lists written at their key's column take new items there; the flag given as
        --port=N sets the engine URL; the comment stays in place."""
        after = _check(POD_INDENTLESS)
        assert "    # trailing comment inside the list\n  restartPolicy: Always\n" in after
        assert "http://127.0.0.1:31000" in _sidecar(docs(after)[0])["args"]

    def test_flow_style(self) -> None:
        """Flow collections get their new entries before the closing bracket, the rest of
        each line as it was."""
        flow = ('                args: ["python3", "-m", "sglang.launch_server"]}]',
                "  volumes: []")
        after = _check(POD_FLOW, flow=flow)
        assert len(after.splitlines()) == len(POD_FLOW.splitlines())

    def test_json_manifest(self) -> None:
        """A JSON manifest stays JSON."""
        before = json.dumps(yaml.safe_load(POD_FLOW), indent=2) + "\n"
        after = _check(before, block=False)
        assert json.loads(after) == docs(after)[0]

    def test_list_with_other_workloads_and_existing_shm(self) -> None:
        """In a List only the engine's Deployment is patched; its own /dev/shm volume is
        reused rather than a second one added; a literal block ending the container stays."""
        after = _check(LIST, flow=("              command: [trtllm-serve, /models/m]",))
        gateway, trt = docs(after)[0]["items"]
        assert gateway == docs(LIST)[0]["items"][0]
        spec = pod_specs(trt)[0]
        assert [v["name"] for v in spec["volumes"]] == ["shm", "kvsidecar-config"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in _sidecar(trt)["volumeMounts"]
        assert _engine(trt)["env"][0]["value"] == "a literal block as the container's last value\n"

    def test_container_named_in_a_list(self) -> None:
        """--container picks the engine in the workloads that have it; the others pass."""
        opts = InjectOptions(container="trt")
        after = _check(LIST, opts, flow=("              command: [trtllm-serve, /models/m]",))
        assert docs(after)[0]["items"][0] == docs(LIST)[0]["items"][0]
        assert any("gateway" in m for m in inject_text(LIST, opts).messages)

    def test_crlf_and_no_final_newline(self) -> None:
        """A CRLF file gets CRLF lines; a file without a final newline is still parsed right."""
        before = POD_INDENTLESS.replace("\n", "\r\n").rstrip("\r\n")
        after = _check(before, block=False)
        inserted_lines(before + "\r\n", after)  # the last line gains its line break
        assert "\n" not in after.replace("\r\n", "")

    def test_flags_already_there_are_not_repeated(self) -> None:
        """An engine that already publishes KV events keeps its own --kv-events-config."""
        before = POD_INDENTLESS.replace(
            "    - --port=31000\n", "    - --port=31000\n    - --kv-events-config={}\n"
        )
        after = _check(before)
        command = _engine(docs(after)[0])["command"]
        assert [t for t in command if t.startswith("--kv-events-config")] == [
            "--kv-events-config={}"
        ]

    def test_trtllm_with_own_options_file(self) -> None:
        """A TensorRT-LLM engine with its own --extra_llm_api_options keeps it, and is told
        what the file must enable."""
        before = LIST.replace("command: [trtllm-serve, /models/m]",
                              "command: [trtllm-serve, /models/m, --extra_llm_api_options, /c.yml]")
        result = inject_text(before, OPTS)
        assert "initContainers" not in result.text
        assert any("event_buffer_max_size" in m for m in result.messages)
        _check(before)


class TestRefusals:
    def test_no_engine_names_the_containers(self) -> None:
        """A file with no engine container is refused, naming what it has."""
        gateway_only = LIST.split("  - apiVersion: apps/v1\n    kind: Deployment\n    "
                                  "metadata: {name: trt}", maxsplit=1)[0]
        with pytest.raises(InjectError, match=r"gateway \(kvsidecar:latest\).*--container"):
            inject_text(gateway_only, OPTS)

    def test_container_override(self) -> None:
        """--container with --engine injects into a container nothing would detect."""
        renamed = POD_INDENTLESS.replace("lmsysorg/sglang:v0.5.23", "corp/llm:7").replace(
            "sglang.launch_server", "corp.serve"
        )
        with pytest.raises(InjectError, match=r"engine \(corp/llm:7\)"):
            inject_text(renamed, OPTS)
        with pytest.raises(InjectError, match="--engine"):
            inject_text(renamed, InjectOptions(container="engine"))
        with pytest.raises(InjectError, match=r"no container named 'nope'.*engine"):
            inject_text(renamed, InjectOptions(container="nope"))
        _check(renamed, InjectOptions(container="engine", engine=EngineKind.SGLANG))

    def test_shell_form_is_refused_with_the_flags(self) -> None:
        """An engine started by `sh -c` is refused with the exact flags to add."""
        shell = POD_INDENTLESS.replace(
            "    - python3\n    - -m\n    - sglang.launch_server\n    - --port=31000\n",
            '    - sh\n    - -c\n    - "python3 -m sglang.launch_server --port 31000"\n',
        )
        with pytest.raises(InjectError, match="shell") as err:
            inject_text(shell, OPTS)
        assert f"--kv-events-config '{SGLANG_KV_EVENTS}'" in str(err.value)

    def test_port_taken(self) -> None:
        """A pod already using the sidecar's port is refused, pointing at --sidecar-port."""
        with pytest.raises(InjectError, match=r"engine listens on 31000.*--sidecar-port"):
            inject_text(POD_INDENTLESS, InjectOptions(sidecar_port=31000))
        taken = POD_INDENTLESS.replace(
            "  restartPolicy", "    ports: [{containerPort: 9000}]\n  restartPolicy"
        )
        with pytest.raises(InjectError, match="already uses port 9000"):
            inject_text(taken, OPTS)
        _check(taken, InjectOptions(sidecar_port=9100))

    def test_no_command(self) -> None:
        """An engine container relying on its image's entrypoint cannot take flags: refused."""
        bare = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n" \
               "  - {name: e, image: lmsysorg/sglang:v0.5.23}\n"
        with pytest.raises(InjectError, match="neither command nor args"):
            inject_text(bare, OPTS)

    def test_not_yaml(self) -> None:
        """A file that does not parse is refused with the parser's position."""
        with pytest.raises(ValueError, match=r"(?s)not valid YAML.*line 2, column 7"):
            inject_text("kind: Pod\nspec: [unclosed\n", OPTS)


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar", "inject", *args],
        input=stdin, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )


class TestCli:
    def test_file_stdin_and_output(self, tmp_path: Path) -> None:
        """-f FILE and -f - print the same patch; -o writes it, in place if asked."""
        example = EXAMPLES / "sglang-deployment.yaml"
        by_file = _run("-f", str(example), "--sidecar-image", "x/kvsidecar:1")
        assert by_file.returncode == 0, by_file.stderr
        by_stdin = _run("-f", "-", "--sidecar-image", "x/kvsidecar:1",
                        stdin=example.read_text())
        assert by_stdin.stdout == by_file.stdout
        copy = tmp_path / "d.yaml"
        copy.write_bytes(example.read_bytes())
        assert _run("-f", str(copy), "-o", str(copy), "--sidecar-image", "x/kvsidecar:1"
                    ).returncode == 0
        assert copy.read_text() == by_file.stdout
        assert "image: x/kvsidecar:1" in by_file.stdout

    def test_errors(self, tmp_path: Path) -> None:
        """A refused file exits 1 with the reason on stderr and nothing on stdout."""
        path = tmp_path / "gw.yaml"
        path.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: gw}\nspec:\n"
                        "  containers: [{name: gw, image: kvsidecar:latest}]\n")
        done = _run("-f", str(path))
        assert done.returncode == 1 and done.stdout == ""
        assert "kvsidecar inject: error: nothing to inject" in done.stderr
        assert "gw (kvsidecar:latest)" in done.stderr
        missing = _run("-f", str(tmp_path / "absent.yaml"))
        assert missing.returncode == 1 and "absent.yaml" in missing.stderr

    def test_help(self) -> None:
        """--help names the flags the docs promise."""
        done = _run("--help")
        assert done.returncode == 0
        for flag in ("--filename", "--container", "--engine", "--sidecar-image",
                     "--sidecar-port", "--store-capacity-bytes", "--sidecar-arg"):
            assert flag in done.stdout


class TestAnchors:
    def test_shared_anchor_is_refused(self) -> None:
        """A list reached through an alias elsewhere is refused rather than changed twice."""
        aliased = POD_INDENTLESS.replace("    command:\n", "    command: &cmd\n").replace(
            "  restartPolicy: Always\n",
            "  restartPolicy: Always\n  initContainers:\n  - {name: warm, image: x, "
            "command: *cmd}\n",
        )
        with pytest.raises(ValueError, match="anchor"):
            inject_text(aliased, OPTS)

    def test_merge_key_is_refused(self) -> None:
        """A container whose args come in through a merge key is refused, not patched."""
        merged = (
            "base: &base\n  image: lmsysorg/sglang:v0.5.23\n  args: [sglang.launch_server]\n"
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n"
            "  - <<: *base\n    name: e\n"
        )
        with pytest.raises(ValueError, match=r"spec\.containers\.0\.args is an anchor"):
            inject_text(merged, OPTS)


def test_null_list_is_refused() -> None:
    """`volumes:` left empty (null) is refused rather than given a second `volumes` key."""
    empty = POD_INDENTLESS.replace("  restartPolicy: Always\n",
                                   "  restartPolicy: Always\n  volumes:\n")
    with pytest.raises(InjectError, match=r"volumes is None, not a list"):
        inject_text(empty, OPTS)
