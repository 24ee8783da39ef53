"""A ``LocalStack`` seen from a test: gateways started one by one, and a module's stack that
each test adds its own gateways to, stopped after it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvsidecar.launch import ManagedProcess
from kvsidecar.local_stack import GatewaySpec, LocalStack

__all__ = ["gateway", "gateway_process", "own_gateways"]


def gateway_process(stack: LocalStack, name: str, *flags: str, workers: Sequence[str] = (),
                    model_path: Path | None = None) -> ManagedProcess:
    """Start a gateway ``name`` (seed 1, health checks every 0.5 s) in front of ``workers``'
    sidecars (none named: all) with ``flags`` (and ``model_path``, when not the stack's),
    once it serves; the caller waits until its workers are routable."""
    proc = stack.add_gateway(GatewaySpec(
        name=name, health_check_interval_s=0.5, seed=1, wait_routable=False,
        only=tuple(workers), args=flags,
        model_path=None if model_path is None else str(model_path)))[0].proc
    assert isinstance(proc, ManagedProcess)  # a gateway of ours
    return proc


def gateway(stack: LocalStack, name: str, *flags: str, workers: Sequence[str] = ()) -> str:
    """``gateway_process``'s URL."""
    return gateway_process(stack, name, *flags, workers=workers).url


@contextmanager
def own_gateways(stack: LocalStack) -> Iterator[LocalStack]:
    """``stack``, the gateways started in the block stopped on leaving it."""
    before = {id(part.proc) for part in stack.gateways}
    try:
        yield stack
    finally:
        for part in list(stack.gateways):
            if id(part.proc) not in before and isinstance(part.proc, ManagedProcess):
                stack.stop_child(part.proc)
