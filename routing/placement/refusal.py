"""No placement, said one way: ``Refusal``.

Every stage that looks for a worker and finds none answers with a ``Refusal``: the place
stage (``routing.pipeline.place``), the PD coordinator (``routing.pd``: no pair, no room in
the decode pool, no bootstrap address), and the endpoint picker (``routing.epp.picker``,
which also refuses a request it cannot parse). It carries what the client is told: the HTTP
status, the message, the ``kvcore.errors`` code (and the parameter at fault, for a request
refused before placement), and the ``retry-after`` seconds when retrying may help. ``busy``
marks a refusal that waiting may cure (every worker busy: the admission queue; the decode
pool full: the PD coordinator's wait); the caller may wait instead of answering it.

The pure core's own "no worker" stays ``None``: ``KvRouter.place`` and a policy's ``choose``
answer for the workers they are given and know no status, message or retry; the stage that
called them turns None into a ``Refusal`` in the words of its situation (no healthy worker,
every worker failed, no aggregated worker to re-run a failed handoff).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.errors import OpenAIError

__all__ = ["Refusal"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """No worker for the request: the error the client gets, and whether waiting may help."""

    status: int
    message: str
    code: str | None  # ``kvcore.errors``' code for the client (None: the status says it all)
    busy: bool = False  # every worker is busy or full now: the request may wait for one
    retry_after_s: int | None = None  # the ``retry-after`` the gateway answers with
    param: str | None = None  # the request's parameter at fault

    @classmethod
    def of(cls, error: OpenAIError) -> Refusal:
        """A request refused before it could be placed (unreadable, an unknown model)."""
        return cls(error.status, error.message, error.code, param=error.param)

    def error(self) -> OpenAIError:
        """The refusal in the OpenAI error shape (its ``body()`` is the reply's)."""
        return OpenAIError(self.status, self.message, param=self.param, code=self.code)
