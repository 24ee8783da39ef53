"""The canonical KV model shared by every kvsidecar process (DESIGN.md, "Canonical KV model")."""

from adapters.canonical.hashing import BlockHasher, TokenIdError
from adapters.canonical.namespace import Namespace

__all__ = ["BlockHasher", "Namespace", "TokenIdError"]
