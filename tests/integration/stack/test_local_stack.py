"""``kvsidecar.local_stack``: a tiny simulated stack started in dependency order, ready
through every gateway, stopped gateways first with no process of any child's group left, a
child that fails to start named with its log's tail, and children restarted in place."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import aiohttp
import pytest

from kvsidecar.launch import LaunchError, ManagedProcess
from kvsidecar.local_redis import redis_command
from kvsidecar.local_stack import (
    EngineSpec,
    ExternalPublisher,
    GatewaySpec,
    K8sDiscovery,
    LocalStack,
    StackSpec,
)
from kvsidecar.stack_argv import indexer_argv
from tests.support.polling import eventually, wait_until

TINY = StackSpec(
    engines=(EngineSpec(), EngineSpec()),  # two simulated engine processes, one name each
    gateways=(GatewaySpec(count=2, seed=1, health_check_interval_s=0.5),),
    speedup=5.0,
    nats=True,
    log_level="warning",
)


def _groups_gone(procs: list[ManagedProcess]) -> bool:
    alive = [p.name for p in procs if p.group_alive()]
    assert not alive, f"process groups still alive: {alive}"
    return True


class _ReapWatch:
    """Samples which children have been reaped while the stack stops, and checks at every
    sample that they went newest first: once a child is reaped, so is every later one."""

    def __init__(self, procs: list[ManagedProcess]) -> None:
        self.procs = procs
        self.violations: list[list[str]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            reaped = [p.proc.returncode is not None for p in self.procs]
            # start order: reaped must be False...False True...True
            if any(r and not later for i, r in enumerate(reaped) for later in reaped[i:]):
                names = [p.name for p, r in zip(self.procs, reaped, strict=True) if r]
                self.violations.append(names)
            self._done.wait(0.001)

    def __enter__(self) -> _ReapWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


@pytest.mark.slow  # real processes, seconds each
async def test_a_tiny_stack_serves_then_stops_gateways_first_leaving_no_process(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """Engines, sidecars, two NATS-synced gateways: every worker routable through each
    gateway once started; stopping goes gateways, sidecars, engines, and no group is left."""
    stack = LocalStack(TINY, tmp_path)
    async with stack:
        assert stack.nats is not None
        assert [p.worker_id for p in stack.sidecars] == ["replica-0", "replica-1"]
        assert [p.name for p in stack.procs] == [
            "engines", "engines-1", "sidecar-0", "sidecar-1", "gateway", "gateway-1"]
        assert len({e.url for e in stack.engines}) == 2
        for gateway in stack.gateways:
            async with session.get(f"{gateway.url}/v1/workers") as resp:
                workers = (await resp.json())["workers"]
            assert sorted(w["worker_id"] for w in workers if w["routable"]) == [
                "replica-0", "replica-1"]
        body = {"model": "tiny", "prompt": "cache token prefix", "max_tokens": 2}
        async with session.post(f"{stack.url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
        procs, nats = stack.procs, stack.nats.proc
        with _ReapWatch(procs) as watch:
            await asyncio.to_thread(stack.stop)  # what leaving the block does; idempotent
    assert not watch.violations, f"reaped out of order: {watch.violations[:3]}"
    assert stack.procs == [] and stack.nats is None
    assert nats is not None and nats.returncode is not None
    wait_until(lambda: _groups_gone(procs), "every child's process group to be gone", 10)


@pytest.mark.slow  # a real process, a second or two
def test_a_lone_child_runs_under_a_command_prefix_and_stops_with_it(tmp_path: Path) -> None:
    """``prefix`` (a tool such as valgrind running the interpreter) gets the whole command
    line, the interpreter first; the child serves through it, and stopping leaves no process
    of its group."""
    seen = tmp_path / "prefix-saw"
    wrapper = ["sh", "-c", f'echo "$@" > {seen}; exec "$@"', "wrapper"]
    proc = ManagedProcess.start("indexer", indexer_argv(), workdir=tmp_path, prefix=wrapper)
    try:
        proc.wait_ready(30)
        assert seen.read_text().split()[1:4] == ["-m", "kvsidecar", "indexer"]
    finally:
        proc.stop()
    wait_until(lambda: _groups_gone([proc]), "the child's process group to be gone", 10)


def test_a_child_that_fails_to_start_is_named_with_its_log_tail(tmp_path: Path) -> None:
    """An engine refusing its flags fails the start with its exit and its own words; what
    had started is stopped, its group gone."""
    spec = StackSpec(engines=(EngineSpec(args=("--no-such-flag",)),))
    stack = LocalStack(spec, tmp_path)
    with pytest.raises(LaunchError) as failed:
        stack.start()
    message = str(failed.value)
    assert "engines exited with 2 before it was ready" in message
    assert "--no-such-flag" in message  # the engine's own parser, from its log
    assert stack.procs == []


@pytest.mark.slow  # real processes, seconds each
def test_a_sidecar_that_fails_stops_the_engines_already_up(tmp_path: Path) -> None:
    """A later stage failing stops the earlier ones: the ready engines leave no process."""
    spec = StackSpec(engines=(EngineSpec(sidecar_args=("--no-such-flag",)),), gateways=())
    stack = LocalStack(spec, tmp_path)
    with pytest.raises(LaunchError, match="sidecar-0 exited with 2") as failed:
        stack.start()
    assert "--no-such-flag" in str(failed.value)
    assert stack.procs == [] and len(stack.engines) == 1
    engines = stack.engines[0].proc
    assert engines.proc.returncode is not None
    wait_until(lambda: _groups_gone([engines]), "the engines' process group to be gone", 10)


@pytest.mark.slow  # real processes, seconds each
def test_every_sidecar_gets_the_stacks_redis_as_its_remote_tier(tmp_path: Path) -> None:
    """With ``redis``, a redis-server serves beside the stack, each sidecar is told its URL
    as the remote tier, and it is stopped with the stack."""
    spec = StackSpec(redis=True, gateways=(), sidecar_args=(
        "--store-capacity-bytes", "1MiB", "--store-block-bytes", "4KiB"))
    with LocalStack(spec, tmp_path) as stack:
        assert stack.redis is not None and stack.redis.proc is not None
        redis, url = stack.redis.proc, stack.redis.url
        assert redis_command(stack.redis.port, "PING").startswith(b"+PONG")
        argv = stack.sidecars[0].proc.proc.args
        assert isinstance(argv, list) and argv[argv.index("--remote-tier-url") + 1] == url
    assert redis.returncode is not None


@pytest.mark.slow  # real processes, seconds each
async def test_a_restarted_engine_and_sidecar_come_back_where_they_were(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """``restart``: a SIGKILLed engine and a running sidecar come back on their ports (the
    engine on its event endpoints too), in their places, and the gateway serves through them."""
    spec = StackSpec(gateways=(GatewaySpec(health_check_interval_s=0.5),), speedup=5.0)
    async with LocalStack(spec, tmp_path) as stack:
        engine, sidecar = stack.engines[0], stack.sidecars[0]
        engine_url, sidecar_url = engine.url, sidecar.url
        engine.proc.kill()
        new_engine = await asyncio.to_thread(stack.restart, engine.proc)
        new_sidecar = await asyncio.to_thread(stack.restart, sidecar.proc)
        assert (new_engine.name, new_sidecar.name) == ("engines-r1", "sidecar-0-r1")
        assert (new_engine.url, new_sidecar.url) == (engine_url, sidecar_url)
        assert stack.engines[0].proc is new_engine and stack.sidecars[0].proc is new_sidecar
        assert [p.name for p in stack.procs] == ["engines-r1", "sidecar-0-r1", "gateway"]
        body = {"model": "tiny", "prompt": "cache token prefix", "max_tokens": 2}

        async def served() -> bool:
            async with session.post(f"{stack.url}/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            return True

        await eventually(served, "a completion through the restarted worker", 30, 0.2)


def test_spec_combinations_that_cannot_run_are_refused(tmp_path: Path) -> None:
    """A sidecar handoff (or an engine hooked to its sidecar's store) shares no store socket
    across replicas of one simulated process, only the reference engine has the hook,
    sidecars publish to no NATS the stack does not run, a publisher outside the stack feeds
    one sidecar, a gateway finds pods only where told, and a gateway in front of a worker
    with no sidecar says which: each refused before anything starts."""
    with pytest.raises(ValueError, match="one replica per simulated engine spec"):
        EngineSpec(role="prefill", replicas=2, handoff="sidecar")
    with pytest.raises(ValueError, match="one replica per simulated engine spec"):
        EngineSpec(replicas=2, store="hook")
    EngineSpec(replicas=2, store="sidecar")  # a store per sidecar, no hook: fine
    with pytest.raises(ValueError, match="has none"):
        EngineSpec(kind="tests.support.sglang_standin", store="hook")
    with pytest.raises(ValueError, match="nats_events needs nats"):
        StackSpec(nats_events=True)
    with pytest.raises(ValueError, match="feeds one sidecar"):
        EngineSpec(replicas=2, publisher=ExternalPublisher(load="tcp://127.0.0.1:5560"))
    with pytest.raises(ValueError, match="feeds one sidecar"):
        EngineSpec(sidecars=False, publisher=ExternalPublisher(load="tcp://127.0.0.1:5560"))
    with pytest.raises(ValueError, match="give both"):
        ExternalPublisher(replay="tcp://127.0.0.1:5558")
    with pytest.raises(ValueError, match="go together"):
        GatewaySpec(workers="k8s")
    with pytest.raises(ValueError, match="go together"):
        GatewaySpec(k8s=K8sDiscovery("app=llm", "serving"))
    stack = LocalStack(StackSpec(gateways=()), tmp_path)
    with pytest.raises(ValueError, match="no sidecar for some of"):
        stack.add_gateway(GatewaySpec(only=("decode-9",)))
    assert stack.procs == []


@pytest.mark.slow  # real processes, seconds each
def test_p_d_handoffs_lookups_and_a_gateway_in_front_of_some(tmp_path: Path) -> None:
    """``handoff="file"`` points a P/D engine's hook at a page store directory of the work
    dir, by name; ``"none"`` leaves the engine aggregated behind its role's sidecar. Lookups
    by worker id find each; a gateway in front of some workers lists those alone, and one
    stopped alone is forgotten by the stack. (``"sidecar"``, each engine's hook on its own
    sidecar's store, is served end to end by tests/integration/disagg/test_pd_transfer.py.)"""
    spec = StackSpec(engines=(
        EngineSpec(role="decode", handoff="file", page_store="pages-x", worker_ids=("d",)),
        EngineSpec(role="decode", handoff="none", worker_ids=("n",)),
    ), gateways=(), log_level="warning")
    with LocalStack(spec, tmp_path) as stack:
        filed = stack.process("d").proc.args
        assert isinstance(filed, list)
        store = json.loads(filed[filed.index("--hicache-storage-backend-extra-config") + 1])
        assert store == {"file_path": str(tmp_path / "pages-x")}
        assert filed[filed.index("--disaggregation-mode") + 1] == "decode"
        plain = stack.process("n").proc.args
        assert isinstance(plain, list) and "--disaggregation-mode" not in plain
        assert set(stack.sidecar_urls) == set(stack.engine_urls) == {"d", "n"}
        gateway = stack.add_gateway(GatewaySpec(only=("d",), health_check_interval_s=0.5))
        assert [w["worker_id"] for w in stack.workers] == ["d"]
        proc = gateway[0].proc
        assert isinstance(proc, ManagedProcess)
        stack.stop_child(proc)
        assert stack.gateways == [] and proc.proc.returncode is not None
        assert proc not in stack.procs
