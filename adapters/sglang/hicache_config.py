"""The HiCache backend's settings, from SGLang's ``--hicache-storage-backend-extra-config``.

SGLang hands the whole JSON object to the backend as ``storage_config.extra_config``; the keys
it uses itself (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``,
``tp_lcm_size``) are accepted and ignored, ours are ``adapters.storage.StoreHookConfig``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.storage.hook_config import StoreHookConfig

__all__ = ["HiCacheBackendConfig"]

_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                          "tp_lcm_size"})


class HiCacheBackendConfig(StoreHookConfig):
    """``StoreHookConfig`` read from SGLang's extra config."""

    __slots__ = ()

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> HiCacheBackendConfig:
        return cls.parse(extra, hook="kvsidecar HiCache backend", engine_keys=_SGLANG_KEYS)
