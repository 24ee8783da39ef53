"""vLLM KV connector backed by the sidecar's block store (host memory, and the store's disk
and remote tiers below it), as LMCache's connector is for LMCache.

Load it into vLLM (0.32) with::

    --kv-transfer-config '{"kv_connector": "KvSidecarConnector",
        "kv_connector_module_path": "adapters.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/kvsidecar/replica-0.sock"}}'

with this repository importable by vLLM's Python (``PYTHONPATH``) and the ``engine-plugin``
extra's packages installed there. The extra config's keys are ``StoreHookConfig``'s
(``socket`` required; ``model_id`` defaults to vLLM's served model name). The sidecar's
store runs with ``--store-capacity-bytes`` and the vLLM adapter's geometry (the model's
KV block, ``raw``), so the store fits without further flags.

A prompt's full blocks are saved when the step that computes them ends; a later request
(on this replica or any other that reaches the same store, or its remote tier) loads the
blocks its prompt shares before its forward pass, and vLLM counts them as cached
(``usage.prompt_tokens_details.cached_tokens``) and computes the rest. The logic is in
``adapters.vllm.connector_core``; this module translates vLLM's objects for it.

Failures: a store that is down, went away or misbehaves turns matches into misses (0
tokens) and saves into no-ops, logged and counted; a block matched but gone by the time it
loads is reported to vLLM, which recomputes it: that needs ``kv_load_failure_policy``
``recompute`` (vLLM's default, ``fail``, would fail the request), so the connector refuses
to start without it. Only start-up configuration errors raise: bad extra config, that
policy, tensor or pipeline parallelism (a rank's slice of a block is not a whole block;
data parallel ranks each hold whole blocks and share the store), and a store whose blocks
do not fit vLLM's.

Without ``vllm`` installed the class derives from a stand-in of the base's shape, so this
module imports anywhere (its logic is tested through ``connector_core``).
"""

from __future__ import annotations

from typing import Any

import structlog

from adapters.storage.boundary import guarded
from adapters.vllm.connector_core import (
    ConnectorSettings,
    ScheduledRequest,
    SchedulerCore,
    StepPlan,
    WorkerCore,
)
from kvcore.namespace import namespace_seed

__all__ = ["VLLM_AVAILABLE", "KvSidecarConnector", "KvSidecarConnectorMetadata"]

log = structlog.get_logger(component="adapters.vllm.connector")

_HOOK = "vllm_connector"  # in the logs of failed calls

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found,unused-ignore]
        KVConnectorBase_V1 as _Base,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found,unused-ignore]
        KVConnectorMetadata as _MetadataBase,
    )
    from vllm.v1.metrics.cache_hit_source import (  # type: ignore[import-not-found,unused-ignore]
        CacheHitSource as _HitSource,
    )

    VLLM_AVAILABLE = True
except ImportError:  # any process without vLLM: stand-ins of the shapes used here
    VLLM_AVAILABLE = False

    class _MetadataBase:  # type: ignore[no-redef]
        """``KVConnectorMetadata``'s shape."""

    class _Base:  # type: ignore[no-redef]
        """``KVConnectorBase_V1``'s shape (metadata binding), without vLLM."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._kv_cache_manager: Any = None
            self._connector_metadata: Any = None
            self._role = role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            return self._connector_metadata

        def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
            self._kv_cache_manager = kv_cache_manager

    _HitSource = None


class KvSidecarConnectorMetadata(_MetadataBase):  # type: ignore[misc,valid-type,unused-ignore]
    """One step's ``StepPlan``, as vLLM passes metadata from scheduler to workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _served_name(vllm_config: Any) -> str:
    name = getattr(vllm_config.model_config, "served_model_name", None)
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    return str(name or vllm_config.model_config.model)


def _is_scheduler(role: Any) -> bool:
    """vLLM's ``KVConnectorRole.SCHEDULER`` (or its name, where vLLM is absent)."""
    return bool(getattr(role, "name", role) == "SCHEDULER")


class KvSidecarConnector(_Base):  # type: ignore[misc,valid-type,unused-ignore]
    """vLLM ``KVConnectorBase_V1`` over the sidecar's block store (see the module doc): one
    instance in the scheduler (matches, plans) and one in each worker (copies)."""

    if _HitSource is not None:
        _cache_hit_source = _HitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache; a save a preemption cuts short is a later miss."""
        return False

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        policy = getattr(transfer, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise ValueError(
                "the kvsidecar KV connector needs \"kv_load_failure_policy\": \"recompute\" in "
                "--kv-transfer-config: a block the store drops between match and load is then "
                f"recomputed, where {policy!r} fails the request")
        parallel = getattr(vllm_config, "parallel_config", None)
        ranks = (getattr(parallel, "tensor_parallel_size", 1) or 1) * (
            getattr(parallel, "pipeline_parallel_size", 1) or 1)
        if ranks > 1:
            # each rank holds a slice of every block: whole blocks under one canonical key
            # would mix the slices
            raise ValueError(
                "the kvsidecar KV connector stores whole KV blocks of one worker: run vLLM "
                f"without tensor or pipeline parallelism (it has {ranks} ranks per replica; "
                "data parallelism is fine)")
        self.settings = ConnectorSettings.from_extra_config(
            getattr(transfer, "kv_connector_extra_config", None) or {},
            _served_name(vllm_config), int(vllm_config.cache_config.block_size))
        self.scheduler: SchedulerCore | None = None
        self.worker: WorkerCore | None = None
        if _is_scheduler(role):
            self.scheduler = SchedulerCore(self.settings, self.settings.link("vllm_scheduler"))
            self.scheduler.link.connect()  # early and non-fatal: a store down only logs here
        else:
            self.worker = WorkerCore(self.settings.link("vllm_worker"))
        log.info("connector_created", role=str(role), socket=str(self.settings.store.socket),
                 model_id=self.settings.model_id, block_size=self.settings.block_size)

    # ------------------------------------------------------------ the request's namespace
    def namespace_seed(self, request: Any) -> int:
        """The request's namespace: the model, its LoRA adapter (by name) and cache salt."""
        lora = getattr(request, "lora_request", None)
        return namespace_seed(self.settings.model_id,
                              getattr(lora, "lora_name", None) if lora is not None else None,
                              getattr(request, "cache_salt", None))

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        core = self.scheduler
        if core is None:
            return 0, False
        return guarded(_HOOK, "get_num_new_matched_tokens", (0, False), lambda: (
            core.matched_tokens(request.request_id, request.prompt_token_ids or [],
                                num_computed_tokens, self.namespace_seed(request)), False))

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        core = self.scheduler
        if core is None:
            return
        guarded(_HOOK, "update_state_after_alloc", None, lambda: core.after_alloc(
            request.request_id, request.prompt_token_ids or [], self.namespace_seed(request),
            blocks.get_block_ids()[0], num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KvSidecarConnectorMetadata:
        core = self.scheduler
        if core is None:
            return KvSidecarConnectorMetadata(StepPlan())
        return KvSidecarConnectorMetadata(guarded(
            _HOOK, "build_connector_meta", StepPlan(),
            lambda: core.plan_step(self._scheduled(scheduler_output))))

    def _scheduled(self, out: Any) -> list[ScheduledRequest]:
        """The step's requests: computed tokens once it ran, and their device blocks."""
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        manager = self._kv_cache_manager
        return [ScheduledRequest(req_id, computed[req_id] + count,
                                 manager.get_block_ids(req_id)[0])
                for req_id, count in out.num_scheduled_tokens.items() if req_id in computed]

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Nothing held back: the request's blocks were saved in the steps that computed them."""
        if self.scheduler is not None:
            self.scheduler.finished(request.request_id)
        return False, None

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        self.worker.register(list(kv_caches.values()), num_blocks)

    def _plan(self) -> StepPlan | None:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, KvSidecarConnectorMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        worker = self.worker
        if worker is not None:
            guarded(_HOOK, "start_load_kv", None, lambda: worker.load(self._plan()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: ``start_load_kv`` loads synchronously."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing per layer: ``wait_for_save`` saves every layer of a block at once."""

    def wait_for_save(self) -> None:
        worker = self.worker
        if worker is not None:
            guarded(_HOOK, "wait_for_save", None, lambda: worker.save(self._plan()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self.worker is None else self.worker.take_failed_blocks()

    def shutdown(self) -> None:
        for core in (self.scheduler, self.worker):
            if core is not None:
                core.link.close()
