"""What the in-engine storage hooks share: a resilient link to the sidecar's block store.

The hooks themselves live with their engine (``adapters.sglang.hicache``,
``adapters.trtllm.connector``); both run inside the engine process, where a storage failure
must be a logged, counted miss and never an exception into the engine.
"""

from adapters.storage.link import HookCounters, StoreLink, StoreMismatchError

__all__ = ["HookCounters", "StoreLink", "StoreMismatchError"]
