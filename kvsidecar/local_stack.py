"""The one launcher of the local stack: ``kvsidecar up``, the tests and the benchmarks all
start engines, sidecars, gateways, NATS and Redis through it.

A ``StackSpec`` says what runs; ``LocalStack(spec, workdir)`` starts it in dependency order
(NATS and Redis, engines, sidecars, gateways) and stops it in reverse, gateways first::

    with LocalStack(StackSpec(engines=(EngineSpec(replicas=2),)), tmp) as stack:
        stack.url  # the first gateway's, once every worker is routable through it

    async with LocalStack(spec, tmp) as stack:  # the same, off the event loop
        ...

Every child runs as ``python -m <module> ... --ready-file`` through ``ManagedProcess``: in
its own process group, polled against a deadline, a child that exits or stays silent fails
the start with its log's tail; stopping sends SIGTERM, then SIGKILL, and then kills whatever
is left of its group. Logs and ready files go in the work directory, one per child.
``add_gateway`` starts more gateways beside a running stack; ``restart`` brings a child back
on the ports it had (fault tests and the soak).

The specs live in ``kvsidecar.stack_spec``, the children's command lines (and a P/D role's
handoff wiring) in ``kvsidecar.stack_argv``; both are re-exported here.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

from kvsidecar.launch import LaunchError, ManagedProcess, Stoppable, stop_newest_first
from kvsidecar.local_nats import NatsServer
from kvsidecar.local_redis import RedisServer
from kvsidecar.local_vllm import VllmServer
from kvsidecar.stack_argv import (
    gateway_argv,
    k8s_flags,
    part_name,
    publisher_flags,
    refengine_argv,
    sidecar_argv,
    store_flags,
)
from kvsidecar.stack_spec import (
    DEFAULT_MODEL,
    EVENTS_CONFIG,
    EngineSpec,
    ExternalPublisher,
    GatewaySpec,
    K8sDiscovery,
    StackSpec,
)

__all__ = [
    "DEFAULT_MODEL",
    "EVENTS_CONFIG",
    "EngineSpec",
    "ExternalPublisher",
    "GatewaySpec",
    "K8sDiscovery",
    "LocalStack",
    "Part",
    "StackSpec",
    "gateway_argv",
    "sidecar_argv",
]

# Deadlines for a child's ready file: torch engines load a model, the rest only bind.
_READY_S = {"sim": 120.0, "torch": 300.0, "standin": 120.0, "sidecar": 120.0, "gateway": 60.0}
_ROUTABLE_S = 60.0


@dataclass
class Part:
    """One served endpoint: an engine replica, a sidecar or a gateway. Simulated replicas
    of one engine process share its ``proc``."""

    name: str
    url: str
    proc: ManagedProcess | VllmServer
    role: str = "agg"
    worker_id: str = ""
    store_socket: Path | None = None  # its sidecar's block store (EngineSpec.store, handoff)
    ready: dict[str, Any] = field(default_factory=dict)  # its ready line (endpoints bound)


@dataclass(frozen=True)
class _Launch:
    """How a child was started: what ``LocalStack.restart`` starts again."""

    origin: str  # the first incarnation's name
    argv: list[str]
    env: Mapping[str, str] | None
    wait_s: float


def routable_workers(url: str, count: int, timeout_s: float = _ROUTABLE_S) -> list[Any]:
    """Poll the gateway's /v1/workers until ``count`` workers are routable and healthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{url}/v1/workers", timeout=10) as resp:
            workers = json.loads(resp.read())["workers"]
        if sum(bool(w["routable"]) and bool(w["healthy"]) for w in workers) >= count:
            return list(workers)
        if time.monotonic() > deadline:
            raise LaunchError(f"only some workers became routable through {url}: {workers}")
        time.sleep(0.1)  # between polls of a deadline-bounded wait


class LocalStack:
    """The processes of one ``StackSpec``; see the module's docstring."""

    def __init__(self, spec: StackSpec, workdir: Path) -> None:
        self.spec = spec
        self.workdir = workdir
        self.nats: NatsServer | None = None
        self.redis: RedisServer | None = None
        self.engines: list[Part] = []
        self.sidecars: list[Part] = []
        self.gateways: list[Part] = []
        self.workers: list[Any] = []  # what the first gateway listed once all were routable
        self._procs: list[ManagedProcess] = []  # in start order; stopped in reverse
        self._vllm: list[VllmServer] = []  # real vLLM engines: stopped after our processes
        self._launched: dict[str, _Launch] = {}  # by process name: how to start it again
        self._sockets = 0  # block-store sockets handed out

    @property
    def url(self) -> str:
        """The first gateway's URL."""
        return self.gateways[0].url

    @property
    def procs(self) -> list[ManagedProcess]:
        """Every child of ours, in start order."""
        return list(self._procs)

    @property
    def sidecar_urls(self) -> dict[str, str]:
        """Each sidecar's URL by its worker id."""
        return {p.worker_id: p.url for p in self.sidecars}

    @property
    def store_sockets(self) -> dict[str, Path]:
        """Each sidecar's block store socket by its worker id (``EngineSpec.store``)."""
        return {p.worker_id: p.store_socket for p in self.sidecars if p.store_socket}

    @property
    def engine_urls(self) -> dict[str, str]:
        """Each engine replica's URL by the worker id of its sidecar (or, for a replica
        without one, the name ``EngineSpec.worker_ids`` gives it)."""
        return {p.worker_id: p.url for p in self.engines if p.worker_id}

    def process(self, name: str) -> ManagedProcess:
        """The child of ours serving worker ``name``'s engine, or the one named ``name``
        (a gateway)."""
        for part in self.engines:
            if part.worker_id == name and isinstance(part.proc, ManagedProcess):
                return part.proc
        for proc in self._procs:
            if proc.name == name:
                return proc
        raise KeyError(f"no engine of worker {name!r} and no child named {name!r} of ours")

    # -- starting

    def start(self) -> Self:
        """Start everything in dependency order; on any failure stop what started, raise."""
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            self._start_servers()
            self._start_engines()
            self._start_sidecars()
            for gateway in self.spec.gateways:
                self.add_gateway(gateway)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_servers(self) -> None:
        if self.spec.nats:
            self.nats = NatsServer(self.workdir).start()
        if self.spec.redis:
            self.redis = RedisServer(self.workdir, maxmemory=self.spec.redis_maxmemory).start()

    def _launch(self, name: str, argv: list[str], wait_s: float,
                env: Mapping[str, str] | None = None) -> ManagedProcess:
        """Start one child; a name already taken (its log and ready file) gets ``-<n>``."""
        unique, n = name, 0
        while unique in self._launched:
            n += 1
            unique = f"{name}-{n}"
        env = {**self.spec.env, **(env or {})} or None
        proc = ManagedProcess.start(unique, argv, workdir=self.workdir, env=env)
        self._procs.append(proc)
        self._launched[unique] = _Launch(unique, argv, env, wait_s)
        return proc

    def _ours(self) -> list[str]:
        """Flags every child of ours gets before its own extras."""
        return ["--log-level", self.spec.log_level] if self.spec.log_level else []

    def _start_engines(self) -> None:
        """Every engine process at once, then wait for each; parts in spec order."""
        started: list[tuple[EngineSpec, ManagedProcess | list[VllmServer], int, float,
                            Path | None]] = []
        index: dict[str, int] = {}
        for engine in self.spec.engines:
            if not engine.replicas:
                continue
            env = dict(engine.env) or None
            if engine.kind == "vllm":
                started.append((engine, self._start_vllm(engine), engine.replicas, 0.0, None))
                continue
            if engine.kind == "refengine" and engine.compute == "sim":
                socket = self._store_socket(engine)
                argv = refengine_argv(self.spec, engine, self.workdir, socket, self._ours())
                proc = self._launch(part_name("engines", engine.role), argv, _READY_S["sim"],
                                    env)
                started.append((engine, proc, engine.replicas, _READY_S["sim"], socket))
                continue
            for _ in range(engine.replicas):
                i = index[engine.role] = index.get(engine.role, -1) + 1
                socket = None
                if engine.kind == "refengine":
                    socket = self._store_socket(engine)
                    argv = refengine_argv(self.spec, engine, self.workdir, socket, self._ours())
                    wait = _READY_S[engine.compute]
                else:
                    argv, wait = [engine.kind, *engine.args], _READY_S["standin"]
                proc = self._launch(part_name("engine", engine.role, i), argv, wait, env)
                started.append((engine, proc, 1, wait, socket))
        for engine, launched, count, wait, socket in started:
            if isinstance(launched, list):  # vLLM servers, ready already
                self.engines += [Part(v.name, v.url, v, engine.role) for v in launched]
                continue
            for line in launched.wait_ready(wait, count=count)[:count]:
                self.engines.append(Part(launched.name, str(line["url"]), launched, engine.role,
                                         store_socket=socket, ready=line))

    def _store_socket(self, engine: EngineSpec) -> Path | None:
        """A new block-store socket for an engine hooked to its sidecar's store; else None."""
        if not engine.hooked:
            return None
        return self._new_socket()

    def _new_socket(self) -> Path:
        self._sockets += 1
        return self.workdir / f"store-{self._sockets}.sock"

    def _start_vllm(self, engine: EngineSpec) -> list[VllmServer]:
        """``engine.replicas`` real vLLM servers, started side by side (each takes a minute
        or more) and ready; a start that fails is a ``LaunchError`` with vLLM's words."""
        assert engine.vllm is not None
        first = len(self._vllm)
        try:
            servers = [VllmServer(self.workdir, engine.vllm, f"vllm-{first + i}")
                       for i in range(engine.replicas)]
            self._vllm += servers
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(VllmServer.start, servers))
        except RuntimeError as exc:
            raise LaunchError(str(exc)) from exc
        return servers

    def _start_sidecars(self) -> None:
        """A sidecar beside each replica that wants one: worker ``replica-<i>`` when
        aggregated, ``<role>-<i>`` otherwise, counted per role (or the spec's ``worker_ids``)."""
        spec = self.spec
        servers = ["--remote-tier-url", self.redis.url] if self.redis is not None else []
        if spec.nats_events and self.nats is not None:
            servers += ["--events-via", "nats", "--nats", self.nats.url]
        wanted = [(e, j) for e in spec.engines for j in range(e.replicas)]
        index: dict[str, int] = {}
        started: list[tuple[Part, ManagedProcess]] = []
        for (engine, j), part in zip(wanted, self.engines, strict=True):
            if not engine.sidecars:  # named all the same when worker_ids names it
                part.worker_id = engine.worker_ids[j] if engine.worker_ids else ""
                continue
            i = index[part.role] = index.get(part.role, -1) + 1
            worker_id = (engine.worker_ids[j] if engine.worker_ids
                         else f"replica-{i}" if part.role == "agg" else f"{part.role}-{i}")
            kind = ["--engine", "vllm"] if engine.kind == "vllm" else []
            if isinstance(part.proc, VllmServer):  # the store its KV connector attaches to
                store = part.proc.store_args()
            elif part.store_socket is not None:  # its engine's HiCache hook's store
                store = store_flags(engine, part.store_socket)
            elif engine.store == "sidecar":
                part.store_socket = self._new_socket()
                store = store_flags(engine, part.store_socket)
            else:
                store = []
            outside = publisher_flags(engine.publisher) if engine.publisher else []
            extra = [*kind, *store, *outside, *self._ours(), *servers, *spec.sidecar_args,
                     *engine.sidecar_args]
            proc = self._launch(part_name("sidecar", part.role, i), [
                "sidecar",
                *sidecar_argv(part.url, worker_id, part.role, spec.handoff_ms_per_1k_tokens, extra),
            ], _READY_S["sidecar"], dict(engine.env) or None)
            part.worker_id = worker_id
            started.append((part, proc))
        for part, proc in started:
            ready = proc.wait_ready(_READY_S["sidecar"])[0]
            self.sidecars.append(Part(proc.name, str(ready["url"]), proc, part.role,
                                      part.worker_id, part.store_socket, ready))

    def add_gateway(self, gateway: GatewaySpec) -> list[Part]:
        """Start ``gateway.count`` gateways (now, or beside a running stack); stopped first."""
        match gateway.workers:
            case "sidecars":
                chosen = [p for p in self.sidecars
                          if not gateway.only or p.worker_id in gateway.only]
                if len(chosen) != len(gateway.only or chosen):
                    raise ValueError(f"{gateway.name}: no sidecar for some of {gateway.only}")
                sidecars, workers = [p.url for p in chosen], []
                count = len(chosen)
            case "engines":
                sidecars = []
                workers = [f for p in self.engines for f in ("--worker", p.url)]
                count = len(self.engines)
            case "k8s":  # the pods come and go: nothing to wait for
                assert gateway.k8s is not None  # GatewaySpec checks
                sidecars, workers, count = [], k8s_flags(gateway.k8s), 0
            case "none":
                sidecars, workers, count = [], [], 0
        nats = ["--nats", self.nats.url] if self.nats is not None and gateway.nats else []
        started = []
        for g in range(gateway.count):
            seed = [] if gateway.seed is None else ["--seed", str(gateway.seed + g)]
            name = gateway.name if g == 0 else f"{gateway.name}-{g}"
            argv = gateway_argv(gateway, gateway.model_path or self.spec.model_path, sidecars,
                                port=gateway.port if g == 0 else 0,
                                more=[*workers, *seed, *nats, *self._ours()])
            started.append(self._launch(name, ["routing", *argv], _READY_S["gateway"],
                                        dict(gateway.env) or None))
        parts = []
        for proc in started:
            ready = proc.wait_ready(_READY_S["gateway"])[0]
            parts.append(Part(proc.name, str(ready["url"]), proc, ready=ready))
        self.gateways += parts
        if gateway.wait_routable and count:
            for part in parts:
                workers_listed = routable_workers(part.url, count)
                if not self.workers:
                    self.workers = workers_listed
        return parts

    # -- restarting

    def restart(self, proc: ManagedProcess, *args: str) -> ManagedProcess:
        """Start a child again where it was, stopping it first if it still runs: the same
        arguments plus the HTTP port it had bound and, for an engine, the KV event endpoints
        it had bound, so its sidecar and the gateways find it unchanged (a restarted engine's
        cache is empty and its event sequence starts over), then ``args`` (a later flag wins:
        restarted as its operator would, with a flag changed; kept for its next restart).
        The new process takes ``proc``'s place among the parts and in the stopping order,
        named ``<name>-r<n>``."""
        launch = self._launched.get(proc.name)
        if launch is None or len(proc.ready) != 1:
            raise ValueError(f"{proc.name}: only a child of this stack serving one endpoint "
                             "restarts (a simulated engine process serving several does not)")
        ready = proc.ready[0]
        proc.stop()
        more = ["--port", str(urlsplit(str(ready["url"])).port)]
        if ready.get("kv_events_endpoint"):
            events = {**json.loads(self.spec.events_config), "bind": True,
                      "endpoint": ready["kv_events_endpoint"],
                      "replay_endpoint": ready["kv_replay_endpoint"]}
            more += ["--kv-events-config", json.dumps(events)]
        n = 1
        while f"{launch.origin}-r{n}" in self._launched:
            n += 1
        name = f"{launch.origin}-r{n}"
        new = ManagedProcess.start(name, [*launch.argv, *more, *args], workdir=self.workdir,
                                   env=launch.env)
        self._launched[name] = _Launch(launch.origin, [*launch.argv, *args], launch.env,
                                       launch.wait_s)
        self._procs[self._procs.index(proc)] = new
        moved = [p for p in (*self.engines, *self.sidecars, *self.gateways) if p.proc is proc]
        for part in moved:
            part.proc = new
        ready = new.wait_ready(launch.wait_s)[0]
        for part in moved:
            part.ready = ready
        return new

    # -- stopping

    def stop_child(self, proc: ManagedProcess) -> int:
        """Stop one child of ours now and forget it and its parts (a gateway one test added
        to a stack that the next test shares); its exit code."""
        if proc not in self._procs:
            raise ValueError(f"{proc.name} is not a running child of this stack")
        self._procs.remove(proc)
        for parts in (self.engines, self.sidecars, self.gateways):
            parts[:] = [p for p in parts if p.proc is not proc]
        return proc.stop()

    def stop(self) -> None:
        """Stop every child, newest first (gateways, sidecars, engines), then Redis and NATS;
        each is stopped even when an earlier one failed to, the failures raised together."""
        servers = [s for s in (self.nats, self.redis) if s is not None]
        procs: list[Stoppable] = [*servers, *self._vllm, *self._procs]
        self.redis = self.nats = None
        self._procs.clear()
        self._vllm.clear()
        stop_newest_first(procs, "local stack failed to stop cleanly")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        starting = asyncio.ensure_future(asyncio.to_thread(self.start))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            # the thread goes on starting: let it finish, then stop what it started
            await asyncio.gather(starting, return_exceptions=True)
            await asyncio.to_thread(self.stop)
            raise

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await asyncio.to_thread(self.stop)
