"""The canonical KV model shared by every kvsidecar process (docs/architecture.md)."""

from kvcore.hashing import BlockHasher, TokenIdError
from kvcore.namespace import Namespace, namespace_seed

__all__ = ["BlockHasher", "Namespace", "TokenIdError", "namespace_seed"]
