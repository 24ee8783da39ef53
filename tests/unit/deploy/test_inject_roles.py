"""The sidecar's P/D role, read off the engine's flags (SGLang's --disaggregation-mode,
TensorRT-LLM's --server_role), the pod annotation kvsidecar.io/role overriding; the same from
inject and from the webhook, which share the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from adapters.base import EngineKind
from kvsidecar.engine_role import engine_role
from kvsidecar.inject import inject_text
from kvsidecar.k8s_patch import InjectError, InjectOptions
from sidecar.config import SidecarConfig
from tests.support.inject_checks import check_injection, docs, webhook_patch
from tests.support.k8s import pod_specs

FIXTURES = Path(__file__).parent / "fixtures"
OPTS = InjectOptions(sidecar_image="registry.example/kvsidecar:0.1.0")
EXAMPLES = Path(__file__).resolve().parents[3] / "deploy" / "examples"


def _sidecar_role(spec: dict[str, Any]) -> str:
    """The role the injected sidecar announces, parsed by the sidecar's own parser."""
    (sidecar,) = [c for c in spec["containers"] if c["name"] == "kvsidecar"]
    args = SidecarConfig.parser().parse_args(sidecar["args"])
    return str(args.role)


@pytest.mark.parametrize(
    ("engine", "words", "role"),
    [("sglang", ["sglang.launch_server", "--disaggregation-mode", "prefill"], "prefill"),
     ("sglang", ["sglang.launch_server", "--disaggregation-mode=decode"], "decode"),
     ("sglang", ["sglang.launch_server", "--disaggregation-mode", "null"], "agg"),
     ("sglang", ["sglang.launch_server"], "agg"),
     ("trtllm", ["trtllm-serve", "m", "--server_role", "CONTEXT"], "prefill"),
     ("trtllm", ["trtllm-serve", "m", "--server_role", "generation"], "decode"),
     ("trtllm", ["trtllm-serve", "m"], "agg")],
)
def test_role_from_flags(engine: str, words: list[str], role: str) -> None:
    """Each engine's P/D flag, in each spelling it accepts, gives the sidecar's pool."""
    assert engine_role(EngineKind(engine), words, {}).role == role


def test_role_refusals_and_the_annotation() -> None:
    """A mode kvsidecar has no pool for, or an MPI worker running both halves, is refused
    unless the annotation settles it; an annotation that is not a role is refused; one
    that contradicts the flags wins, with a note."""
    with pytest.raises(ValueError, match=r"kvsidecar\.io/role"):
        engine_role(EngineKind.SGLANG, ["--disaggregation-mode", "encode"], {})
    with pytest.raises(ValueError, match="MPI"):
        engine_role(EngineKind.TRTLLM, ["trtllm-serve", "disaggregated_mpi_worker", "-c", "x"], {})
    assert engine_role(EngineKind.SGLANG, ["--disaggregation-mode", "encode"],
                       {"kvsidecar.io/role": "prefill"}).role == "prefill"
    with pytest.raises(ValueError, match="must be one of agg, prefill, decode"):
        engine_role(EngineKind.SGLANG, [], {"kvsidecar.io/role": "context"})
    choice = engine_role(EngineKind.SGLANG, ["--disaggregation-mode", "prefill"],
                         {"kvsidecar.io/role": "decode"})
    assert choice.role == "decode" and "--disaggregation-mode prefill" in str(choice.note)


def test_trtllm_disaggregated_deployments() -> None:
    """TensorRT-LLM's disaggregated example: the context server's sidecar says prefill, the
    generation server's decode; the orchestrator, no engine, is left as is with a note; the
    context server keeps its own options file (a note says what it must enable)."""
    before = (FIXTURES / "trtllm-disagg.yaml").read_text()
    result = inject_text(before, OPTS)
    after = check_injection(before, OPTS)
    config, ctx, gen, orchestrator = docs(after)
    assert _sidecar_role(pod_specs(ctx)[0]) == "prefill"
    assert _sidecar_role(pod_specs(gen)[0]) == "decode"
    assert orchestrator == docs(before)[3] and config == docs(before)[0]
    assert any("trtllm-serve disaggregated" in m and "orchestrator" in m
               for m in result.messages)
    assert any("trtllm-ctx" in m and "event_buffer_max_size" in m for m in result.messages)
    assert "initContainers" in pod_specs(gen)[0] and "initContainers" not in pod_specs(ctx)[0]


def test_an_aggregated_engine_says_agg() -> None:
    """The shipped examples, which run no P/D flags, announce agg explicitly."""
    for name in ("sglang-deployment.yaml", "trtllm-deployment.yaml"):
        workload = next(d for d in docs(check_injection((EXAMPLES / name).read_text(), OPTS))
                        if pod_specs(d))
        assert _sidecar_role(pod_specs(workload)[0]) == "agg"


def test_the_annotation_overrides_in_inject_and_in_the_webhook(tmp_path: Path) -> None:
    """kvsidecar.io/role on a pod template sets the role inject gives; the webhook, given
    the pod made from that template, answers with the same pod spec."""
    before = (FIXTURES / "trtllm-disagg.yaml").read_text().replace(
        "      labels: {app: trtllm-gen}\n",
        "      labels: {app: trtllm-gen}\n      annotations: {kvsidecar.io/role: prefill}\n",
    )
    result = inject_text(before, OPTS)
    gen = docs(check_injection(before, OPTS))[2]
    assert _sidecar_role(pod_specs(gen)[0]) == "prefill"
    assert any("overrides --server_role generation" in m for m in result.messages)
    template = docs(before)[2]["spec"]["template"]
    pod, response = webhook_patch(template, OPTS, tmp_path)
    assert pod["spec"] == pod_specs(gen)[0]
    assert any("overrides --server_role generation" in w for w in response["warnings"])


def test_a_bad_annotation_is_refused_and_denied(tmp_path: Path) -> None:
    """A role annotation that is no role stops inject and makes the webhook deny the pod."""
    before = (EXAMPLES / "sglang-deployment.yaml").read_text().replace(
        '        prometheus.io/scrape: "true"\n',
        '        prometheus.io/scrape: "true"\n        kvsidecar.io/role: both\n',
    )
    with pytest.raises(InjectError, match=r"kvsidecar.io/role must be one of .*'both'"):
        inject_text(before, OPTS)
    template = docs(before)[0]["spec"]["template"]
    _, response = webhook_patch(template, OPTS, tmp_path)
    assert response["allowed"] is False
    assert "kvsidecar.io/role" in response["status"]["message"]
