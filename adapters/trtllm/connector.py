"""TensorRT-LLM KV cache connector backed by the sidecar's shared-memory block store.

Plug it into TRT-LLM's PyTorch backend (LLM API or ``trtllm-serve`` YAML)::

    kv_connector_config:
      connector_module: adapters.trtllm.connector
      connector_scheduler_class: KvSidecarConnectorScheduler
      connector_worker_class: KvSidecarConnectorWorker

with ``KVSIDECAR_STORE_SOCKET=/run/kvsidecar/replica-0.sock`` in the engine's environment
(the other settings: ``adapters.trtllm.connector_core.ConnectorSettings``). The store must
be started with ``--layout raw`` and ``--block-bytes`` = one KV block of one rank.

Both classes declare ``supports_attention_dp``: under attention DP TRT-LLM runs a scheduler
and a worker per rank with no connector collectives, each planning and copying its own
requests' blocks (owner-local), all against the one store (a shared pool, canonical keys).

The classes below are thin: they translate TRT-LLM's objects (``LlmRequest``, the KV pool
tensor, the metadata it broadcasts) into the pure ``SchedulerCore`` / ``WorkerCore``. Their
bases are TRT-LLM's ``KvCacheConnectorScheduler`` / ``KvCacheConnectorWorker``, resolved when
this module is imported (the newer ``pyexecutor/connectors/`` path first); without
``tensorrt_llm`` installed, same-shaped local stand-ins take their place so the logic runs
anywhere, and ``kv_connector_config()`` names the ``trtllm`` extra.

Assumed from TRT-LLM's published sources, not run here (TRT-LLM cannot be installed on
CPU machines): ``LlmRequest.request_id`` and ``get_tokens(0)``; the optional
``lora_task_id`` / ``cache_salt`` request attributes (read with ``getattr``); the KV pool
tensor indexed by block id; ``tensorrt_llm._utils.mpi_rank`` / ``mpi_world_size``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from adapters.storage.boundary import guarded
from adapters.trtllm.connector_core import (
    ConnectorMetadata,
    ConnectorSettings,
    SchedulerCore,
    WorkerCore,
)
from kvcore.extras import MissingExtraError
from kvcore.namespace import namespace_seed

__all__ = [
    "TRTLLM_AVAILABLE",
    "KvSidecarConnectorScheduler",
    "KvSidecarConnectorWorker",
    "kv_connector_config",
]

_HOOK = "trtllm_connector"  # in the logs of failed calls

_BASE_MODULES = (
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
)


class _SchedulerStandIn:
    """``KvCacheConnectorScheduler``'s shape, for processes without TensorRT-LLM."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args


class _WorkerStandIn:
    """``KvCacheConnectorWorker``'s shape (metadata binding), without TensorRT-LLM."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata: Any = None

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None


def _resolve_bases() -> tuple[type, type, bool]:
    for name in _BASE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return module.KvCacheConnectorScheduler, module.KvCacheConnectorWorker, True
    return _SchedulerStandIn, _WorkerStandIn, False


_SchedulerBase, _WorkerBase, TRTLLM_AVAILABLE = _resolve_bases()


def kv_connector_config() -> Any:
    """TRT-LLM's ``KvCacheConnectorConfig`` naming these classes (needs ``tensorrt_llm``)."""
    try:
        from tensorrt_llm.llmapi.llm_args import (  # type: ignore[import-not-found]  # noqa: PLC0415
            KvCacheConnectorConfig,
        )
    except ImportError as exc:
        raise MissingExtraError(
            "the TensorRT-LLM KV cache connector", "trtllm", "tensorrt_llm", exc) from exc
    return KvCacheConnectorConfig(
        connector_module=__name__,
        connector_scheduler_class="KvSidecarConnectorScheduler",
        connector_worker_class="KvSidecarConnectorWorker",
    )


def _rank_and_world() -> tuple[int, int]:
    if not TRTLLM_AVAILABLE:
        return 0, 1
    from tensorrt_llm._utils import mpi_rank, mpi_world_size  # type: ignore[import-not-found]  # noqa: PLC0415

    return int(mpi_rank()), int(mpi_world_size())


class KvSidecarConnectorScheduler(_SchedulerBase):  # type: ignore[misc,valid-type]
    """The scheduler side (rank 0 under TP; each owner under attention DP): how many prompt
    tokens the store can supply, and what to load and save."""

    supports_attention_dp = True  # request state is per instance; the store is shared

    def __init__(self, llm_args: Any, environ: dict[str, str] | None = None) -> None:
        super().__init__(llm_args)
        self.settings = ConnectorSettings.from_llm_args(
            llm_args, os.environ if environ is None else environ)
        self.core = SchedulerCore(self.settings, self.settings.link("trtllm_scheduler"))

    def namespace_seed(self, request: Any) -> int:
        """The request's namespace: the model, its LoRA adapter and its cache salt."""
        lora = getattr(request, "lora_task_id", None)
        salt = getattr(request, "cache_salt", None)
        return namespace_seed(
            self.settings.model_id,
            None if lora is None else str(lora),
            None if salt is None else str(salt),
        )

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return guarded(_HOOK, "get_num_new_matched_tokens", (0, False), lambda: (
            self.core.matched_tokens(request.request_id, request.get_tokens(0),
                                     num_computed_tokens, self.namespace_seed(request)),
            False))

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        guarded(_HOOK, "update_state_after_alloc", None,
                 lambda: self.core.after_alloc(request.request_id, list(block_ids)))

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        return guarded(_HOOK, "build_connector_meta", ConnectorMetadata(), self.core.build_meta)

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        return bool(guarded(_HOOK, "request_finished", False, lambda: self.core.finished(
            request.request_id, request.get_tokens(0), list(cache_block_ids),
            self.namespace_seed(request))))

    def close(self) -> None:
        """Close the store connection (TRT-LLM has no such hook; process exit does it)."""
        self.core.link.close()


class KvSidecarConnectorWorker(_WorkerBase):  # type: ignore[misc,valid-type]
    """Every rank: block copies between the KV pool and the store, before the forward pass."""

    supports_attention_dp = True  # copies only its own metadata's blocks; loads complete here

    def __init__(self, llm_args: Any, environ: dict[str, str] | None = None,
                 rank: int | None = None, world_size: int | None = None) -> None:
        super().__init__(llm_args)
        self.settings = ConnectorSettings.from_llm_args(
            llm_args, os.environ if environ is None else environ)
        default_rank, default_world = _rank_and_world()
        sliced = self.settings.slicing(default_rank if rank is None else rank,
                                       default_world if world_size is None else world_size)
        self.core = WorkerCore(self.settings.link("trtllm_worker"), *sliced)

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        self.core.register(kv_cache_tensor)  # a store that does not fit fails start-up

    def start_load_kv(self, stream: Any) -> None:
        guarded(_HOOK, "start_load_kv", None,
                 lambda: self.core.run_step(self.get_connector_meta(), stream))

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Nothing to wait for: ``start_load_kv`` loads synchronously."""

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Nothing per layer: finished requests are saved whole in ``start_load_kv``."""

    def wait_for_save(self, stream: Any) -> None:
        """Nothing pending: saves complete inside ``start_load_kv``."""

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        nothing: tuple[list[int], list[int]] = ([], [])
        return guarded(_HOOK, "get_finished", nothing, lambda: self.core.finished(
            finished_gen_req_ids, started_loading_req_ids))

    def close(self) -> None:
        """Close the store connection (TRT-LLM has no such hook; process exit does it)."""
        self.core.link.close()
