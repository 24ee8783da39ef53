"""The gateway's HTTP surface, fuzzed from the OpenAPI document it serves (schemathesis): valid
and invalid bodies, headers and paths against a live gateway that tokenizes (``--model-path``)
in front of an engine. No answer is a server error of the gateway's own making (a 5xx), every
answer's status is one the document lists, and a concurrent stream completes meanwhile."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from routing.serve.openapi import document
from tests.support import gateway_http as h

pytestmark = pytest.mark.slow


async def test_fuzzed_requests_get_clear_answers_and_lose_nothing_in_flight(
        spawn, tiny_model_dir: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    engine = spawn.engine()
    gateway = spawn.gateway([engine], "--router-mode", "kv", "--model-path",
                            str(tiny_model_dir), "--served-model-name", "fake-model",
                            process=True)
    status, _, body = await h.post(gateway.url, "/v1/chat/completions", h.chat())
    assert status == 200, body
    served = orjson.loads((await h.get(gateway.url, "/openapi.json"))[1])
    assert served == orjson.loads(orjson.dumps(document(["fake-model"])))
    stream = asyncio.ensure_future(h.post(
        gateway.url, "/v1/chat/completions",
        h.chat(stream=True, max_tokens=48, fake_tokens=48, fake_delay_s=0.05)))
    run = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "schemathesis.cli", "run", f"{gateway.url}/openapi.json",
        "--checks", "not_a_server_error,status_code_conformance",
        "--max-examples", "100", "--workers", "1", "--seed", "1",
        "--phases", "examples,coverage,fuzzing", "--request-timeout", "20",
        "--report-dir", str(tmp_path / "st"),
    ], capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its state stays there
    assert run.returncode == 0, run.stdout[-6000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
    status, _, body = await stream
    assert status == 200 and h.sse_events(body)[-1] == b"[DONE]"
    assert gateway.popen.poll() is None, gateway.log_text()[-3000:]
