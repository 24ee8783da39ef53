"""The HiCache backend's settings, from SGLang's ``--hicache-storage-backend-extra-config``.

SGLang hands the whole JSON object to the backend as ``storage_config.extra_config``; the keys
it uses itself (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``,
``tp_lcm_size``) are accepted and ignored here, ours are checked, and anything else is
refused with the list of known keys (a typo must not silently disable the store).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HiCacheBackendConfig"]

_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                          "tp_lcm_size"})
_OUR_KEYS = ("socket", "owner_id", "model_id", "timeout_s", "retry_interval_s")


@dataclass(frozen=True, slots=True)
class HiCacheBackendConfig:
    """Where the block store is and how to talk to it.

    * ``socket``: the store owner's Unix socket (the sidecar's ``--store-socket``); required.
    * ``owner_id``: refuse a store owned by anyone else (optional).
    * ``model_id``: the namespace of the blocks; defaults to SGLang's model name. Set it to the
      served model id when other processes (gateway, other engines) must find the same blocks.
    * ``timeout_s``: deadline of one store round trip.
    * ``retry_interval_s``: how long an unreachable store is left alone before the next try.
    """

    socket: Path
    owner_id: str | None = None
    model_id: str | None = None
    timeout_s: float = 5.0
    retry_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.retry_interval_s < 0:
            raise ValueError(f"retry_interval_s must be >= 0, got {self.retry_interval_s}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> HiCacheBackendConfig:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _SGLANG_KEYS - set(_OUR_KEYS))
        if unknown:
            raise ValueError(
                f"kvsidecar HiCache backend: unknown extra_config keys {unknown}; "
                f"known: {', '.join(_OUR_KEYS)} (plus SGLang's {', '.join(sorted(_SGLANG_KEYS))})"
            )
        socket = extra.get("socket")
        if not isinstance(socket, str) or not socket:
            raise ValueError(
                'kvsidecar HiCache backend: extra_config needs "socket": the block store '
                'owner\'s Unix socket path, e.g. {"socket": "/run/kvsidecar/replica-0.sock"}'
            )
        for name in ("owner_id", "model_id"):
            value = extra.get(name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"kvsidecar HiCache backend: {name} must be a non-empty string")
        numbers: dict[str, float] = {}
        for name in ("timeout_s", "retry_interval_s"):
            if name in extra:
                value = extra[name]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(
                        f"kvsidecar HiCache backend: {name} must be a number, got {value!r}")
                numbers[name] = float(value)
        return cls(Path(socket), extra.get("owner_id"), extra.get("model_id"), **numbers)
