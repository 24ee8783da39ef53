"""The one error for an optional extra that is not installed.

Every lazily imported extra (``nats``, ``epp``, ``trtllm``, ``remote-tier``, ``k8s``) fails the
same way: a ``MissingExtraError`` that names who needed it, the extra and its packages, and
the ``pip install`` line. It is an ``ImportError``, so code that already catches those still
does; the entry points catch it to print the message and exit 2.
"""

from __future__ import annotations

__all__ = ["MissingExtraError"]


class MissingExtraError(ImportError):
    """An optional extra that ``needed_by`` needs is not installed."""

    def __init__(self, needed_by: str, extra: str, packages: str,
                 cause: ImportError | None = None) -> None:
        why = "" if cause is None else f" ({cause})"
        super().__init__(f"{needed_by} needs the {extra!r} extra ({packages}): "
                         f"pip install 'kvsidecar[{extra}]'{why}")
        self.extra = extra
