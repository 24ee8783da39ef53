"""What ``kvsidecar inject`` and ``kvsidecar webhook`` share: the sidecar to add and how to
find the engine, each field an option (``kvcore.options``): a flag of ``inject``, and, for the
sidecar's, of ``webhook`` (``option_of``), whose engine comes per pod from its annotations."""

from __future__ import annotations

from dataclasses import dataclass

from adapters.base import EngineKind
from kvcore.options import check_bounds, option

__all__ = ["InjectOptions"]

_ENGINE = "engine"
_SIDECAR = "sidecar"


@dataclass(frozen=True)
class InjectOptions:
    """The sidecar and how to find the engine; validated when built."""

    container: str | None = option(
        None, group=_ENGINE, metavar="NAME",
        help="the engine's container", default_text="the one whose command or image is "
        "SGLang's, TensorRT-LLM's or vLLM's")
    engine: EngineKind | None = option(
        None, group=_ENGINE, help="the engine kind, when its container does not tell",
        default_text="detected")
    sidecar_image: str = option(
        "kvsidecar:latest", group=_SIDECAR, metavar="IMAGE",
        help="the kvsidecar image the sidecar runs")
    sidecar_port: int = option(9000, group=_SIDECAR, ge=1, le=65535, metavar="PORT",
                               help="the sidecar's port in the pod")
    store_capacity_bytes: str | None = option(  # a host-tier store: SGLang's HiCache backend
        None, group=_SIDECAR, metavar="SIZE", default_text="no store",
        help="give the sidecar a shared-memory block store of this size (e.g. 16GiB) and "
        "load SGLang's HiCache backend against it (the engine image must carry kvsidecar's "
        "adapters; see docs/deploy-kubernetes.md)")
    sidecar_args: tuple[str, ...] = option(
        (), group=_SIDECAR, flag="--sidecar-arg", metavar="ARG",
        help="one more argument for `kvsidecar sidecar` (repeat; e.g. --sidecar-arg=--model-id "
        "--sidecar-arg=llama)")

    def __post_init__(self) -> None:
        check_bounds(self)
        if not self.sidecar_image:
            raise ValueError("the sidecar image must not be empty")
        if self.store_capacity_bytes is not None:
            from shm.owner.config import parse_bytes  # noqa: PLC0415  (numpy: only when asked for)

            if parse_bytes(self.store_capacity_bytes) <= 0:
                raise ValueError(
                    f"the store capacity must be positive, got {self.store_capacity_bytes!r}"
                )
