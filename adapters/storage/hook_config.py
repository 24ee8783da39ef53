"""Where an in-engine storage hook finds the block store, from the engine's JSON extra config.

SGLang hands its HiCache backend ``--hicache-storage-backend-extra-config`` and vLLM hands
its KV connector ``kv_connector_extra_config``; both are one JSON object holding the engine's
own keys and ours. The engine's keys are accepted and ignored, ours checked, and anything
else refused with the list of known keys (a typo must not silently disable the store).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

__all__ = ["HOOK_KEYS", "StoreHookConfig"]

HOOK_KEYS = ("socket", "owner_id", "model_id", "timeout_s", "retry_interval_s")


@dataclass(frozen=True, slots=True)
class StoreHookConfig:
    """Where the block store is and how to talk to it.

    * ``socket``: the store owner's Unix socket (the sidecar's ``--store-socket``); required.
    * ``owner_id``: refuse a store owned by anyone else (optional).
    * ``model_id``: the namespace of the blocks; defaults to the engine's model name. Set it to
      the served model id when other processes (gateway, other engines) must find the same
      blocks.
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
    def parse(cls, extra: Mapping[str, Any] | None, *, hook: str,
              engine_keys: Collection[str] = ()) -> Self:
        """Our keys of ``extra``; ``hook`` names the hook in errors, ``engine_keys`` are the
        engine's own keys, passed over."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(engine_keys) - set(HOOK_KEYS))
        if unknown:
            theirs = f" (plus the engine's {', '.join(sorted(engine_keys))})" if engine_keys else ""
            raise ValueError(f"{hook}: unknown extra_config keys {unknown}; known: "
                             f"{', '.join(HOOK_KEYS)}{theirs}")
        socket = extra.get("socket")
        if not isinstance(socket, str) or not socket:
            raise ValueError(
                f'{hook}: extra_config needs "socket": the block store owner\'s Unix socket '
                'path, e.g. {"socket": "/run/kvsidecar/replica-0.sock"}')
        for name in ("owner_id", "model_id"):
            value = extra.get(name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{hook}: {name} must be a non-empty string")
        numbers: dict[str, float] = {}
        for name in ("timeout_s", "retry_interval_s"):
            if name in extra:
                value = extra[name]
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"{hook}: {name} must be a number, got {value!r}")
                numbers[name] = float(value)
        return cls(Path(socket), extra.get("owner_id"), extra.get("model_id"), **numbers)
