"""The shared token that guards a sidecar's control endpoints, written once for both ends.

A sidecar started with ``--control-token-file`` (or ``KVSIDECAR_CONTROL_TOKEN``) answers its
event stream, block export/import, load, worker list and request routes only to a caller that
sends the token in ``x-kvsidecar-token``; the gateway (``--sidecar-token-file``) and peer
sidecars send it. A dedicated header, not ``Authorization``: that one is the client's (with
the gateway's ``--forward-authorization``) or the engine's, and must not be mistaken for it.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

__all__ = ["CONTROL_TOKEN_ENV", "CONTROL_TOKEN_HEADER", "read_secret_file", "token_matches"]

CONTROL_TOKEN_HEADER = "x-kvsidecar-token"
CONTROL_TOKEN_ENV = "KVSIDECAR_CONTROL_TOKEN"


def read_secret_file(path: str | Path, flag: str) -> str:
    """The first line of ``path``, stripped; ``ValueError`` naming ``flag`` when the file is
    unreadable or empty (the secret itself is never put in a message)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from exc
    secret = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not secret:
        raise ValueError(f"{flag} {path} is empty")
    return secret


def token_matches(given: str | None, expected: str) -> bool:
    """Whether ``given`` is ``expected``, compared in constant time (over their digests, so
    neither the length nor a common prefix shows in the timing)."""
    if given is None:
        return False
    a = hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest()
    b = hashlib.sha256(expected.encode("utf-8", "surrogateescape")).digest()
    return hmac.compare_digest(a, b)
