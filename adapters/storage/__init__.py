"""What the in-engine storage hooks share: a resilient link to the sidecar's block store, and
its settings read from the engine's JSON extra config.

The hooks themselves live with their engine (``adapters.sglang.hicache``,
``adapters.trtllm.connector``, ``adapters.vllm.connector``); all run inside the engine
process, where a storage failure must be a logged, counted miss and never an exception into
the engine.
"""

from adapters.storage.hook_config import HOOK_KEYS, StoreHookConfig
from adapters.storage.link import HookCounters, StoreLink, StoreMismatchError

__all__ = ["HOOK_KEYS", "HookCounters", "StoreHookConfig", "StoreLink", "StoreMismatchError"]
