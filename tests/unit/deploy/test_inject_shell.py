"""Engines started by a shell script: read, never rewritten. With the KV-event flags in the
script the sidecar is added; without them the refusal gives the exact words to append, and
once they are there the same manifest goes through; inject and the webhook agree."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.inject import inject_text
from kvsidecar.k8s_patch import SGLANG_KV_EVENTS, InjectError, InjectOptions
from tests.support.inject_checks import check_injection, docs, webhook_patch
from tests.support.k8s import pod_specs

FIXTURES = Path(__file__).parent / "fixtures"
OPTS = InjectOptions(sidecar_image="registry.example/kvsidecar:0.1.0")
EVENTS_LINE = (
    "    --kv-events-config '{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\","
    "\"replay_endpoint\":\"tcp://*:5558\"}' \\\n"
)
PAGE_LINE = "                --page-size 16\n"


def _shell() -> str:
    return (FIXTURES / "sglang-shell.yaml").read_text()


def _without_flags() -> str:
    text = _shell().replace("            " + EVENTS_LINE, "")
    assert text.count("--kv-events-config") == 1  # the comment's mention
    return text


def _pod(container: str) -> str:
    """A Pod manifest whose one container is ``container`` (YAML lines, indented 4)."""
    return "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n" + container


def _spec(text: str) -> dict[str, Any]:
    return pod_specs(docs(text)[0])[0]


def test_a_script_with_the_flags_gets_the_sidecar_and_stays_as_written() -> None:
    """The multi-line script (set -e, a download, exports, an env prefix, exec, line
    continuations) is left byte for byte; the sidecar reads the engine's port from the
    container's env ($PORT) and its role from --disaggregation-mode in the script."""
    before = _shell()
    after = check_injection(before, OPTS)
    engine, sidecar = _spec(after)["containers"]
    assert engine["args"] == _spec(before)["containers"][0]["args"]
    assert engine["command"] == ["bash", "-c"]
    args = sidecar["args"]
    assert args[args.index("--engine-url") + 1] == "http://127.0.0.1:30000"
    assert args[args.index("--role") + 1] == "decode"


def test_without_the_flags_the_refusal_is_the_exact_edit() -> None:
    """The refusal names the script line and the last words of the engine's command, and
    gives the flags as shell words; appending exactly those words makes the same manifest
    inject."""
    with pytest.raises(InjectError) as refused:
        inject_text(_without_flags(), OPTS)
    message = str(refused.value)
    assert "starting on line 7 of the script" in message and "after `--page-size 16`" in message
    words = message.split("`--page-size 16`: ", 1)[1].split(" (then", 1)[0]
    assert shlex.split(words) == ["--kv-events-config", SGLANG_KV_EVENTS]
    fixed = _without_flags().replace(PAGE_LINE, PAGE_LINE[:-1] + " " + words + "\n")
    check_injection(fixed, OPTS)


def test_one_line_sh_c_and_the_store_flags() -> None:
    """`sh -c "..."` as one token is read the same way; with a store, the refusal lists the
    HiCache flags too, each once."""
    pod = _pod(
        "  - name: e\n    image: lmsysorg/sglang:v0.5.23\n"
        "    command: [sh, -c, \"exec python3 -m sglang.launch_server --port 31000\"]\n"
    )
    with pytest.raises(InjectError, match=r"line 1 of the script.*after `exec python3"):
        inject_text(pod, OPTS)
    with pytest.raises(InjectError) as refused:
        inject_text(pod, InjectOptions(store_capacity_bytes="4GiB"))
    for flag in ("--kv-events-config", "--enable-hierarchical-cache",
                 "--hicache-storage-backend dynamic", "--hicache-storage-backend-extra-config"):
        assert str(refused.value).count(flag + " ") == 1, flag


def test_trtllm_script_with_the_options_flag_gets_the_options_file() -> None:
    """A trtllm-serve script that already names kvsidecar's options file gets the init
    container that writes it; the script itself is untouched."""
    pod = _pod(
        "  - name: trt\n    image: nvcr.io/nvidia/tensorrt-llm/release:1.1.0\n"
        "    command: [/bin/bash, -lc]\n    args:\n    - |\n"
        "      trtllm-serve /models/m --port 8001 --server_role CONTEXT \\\n"
        "        --extra_llm_api_options /etc/kvsidecar/trtllm-extra.yml\n"
    )
    spec = _spec(check_injection(pod, OPTS))
    assert [c["name"] for c in spec["initContainers"]] == ["kvsidecar-config"]
    sidecar = spec["containers"][1]["args"]
    assert sidecar[sidecar.index("--role") + 1] == "prefill"
    assert "http://127.0.0.1:8001" in sidecar


@pytest.mark.parametrize(
    ("script", "match"),
    [("python3 -m sglang.launch_server --port 1; python3 -m sglang.launch_server --port 2",
      r"several commands \(lines 1, 1\)"),
     ("/opt/start-server.sh", r"no command of the script runs sglang"),
     ("exec python3 -m sglang.launch_server --port $NOPE --kv-events-config x",
      r"--port is \$NOPE, which kvsidecar cannot resolve")],
)
def test_scripts_that_cannot_be_read_are_refused(script: str, match: str) -> None:
    """Two engine commands, none, or a port that is an unresolvable variable: refused."""
    pod = _pod(
        f"  - name: e\n    image: lmsysorg/sglang:v0.5.23\n    command: [bash, -c, {script!r}]\n"
    )
    with pytest.raises(InjectError, match=match):
        inject_text(pod, OPTS)


def test_the_webhook_denies_once_then_admits(tmp_path: Path) -> None:
    """The webhook denies the pod whose script lacks the flags with the same exact edit,
    and admits the pod of the fixed script with the pod spec inject gives."""
    template = docs(_without_flags())[0]["spec"]["template"]
    _, response = webhook_patch(template, OPTS, tmp_path)
    assert response["allowed"] is False
    assert "after `--page-size 16`" in response["status"]["message"]
    template = docs(_shell())[0]["spec"]["template"]
    pod, response = webhook_patch(template, OPTS, tmp_path)
    assert response["allowed"] is True
    assert pod["spec"] == _spec(check_injection(_shell(), OPTS))


def test_vllm_serve_in_a_script_is_read_too() -> None:
    """`vllm serve` started by a script (no vLLM image to go by) is found in it: without
    its event flags the refusal gives them; with them the sidecar is added, --engine vllm."""
    def pod(extra: str) -> str:
        return _pod(
            "  - name: v\n    image: registry.example/my-vllm:1\n"
            "    command: [bash, -c]\n    args:\n    - |\n"
            f"      exec vllm serve /models/m --port 8100{extra}\n"
        )

    with pytest.raises(InjectError) as refused:
        inject_text(pod(""), OPTS)
    words = str(refused.value).split("--port 8100`: ", 1)[1].split(" (then", 1)[0]
    assert "--kv-events-config" in shlex.split(words)
    spec = _spec(check_injection(pod(" " + words), OPTS))
    sidecar = spec["containers"][1]["args"]
    assert sidecar[sidecar.index("--engine") + 1] == "vllm"
    assert "http://127.0.0.1:8100" in sidecar
