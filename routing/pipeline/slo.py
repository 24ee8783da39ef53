"""What a request counts as served well: its time-to-first-token and inter-token targets.

Goodput is the requests that meet both. Each request's targets are the gateway's
(``--slo-ttft-ms``, ``--slo-itl-ms``) unless the client names its own in
``x-kvsidecar-slo-ttft-ms`` / ``x-kvsidecar-slo-itl-ms``. The gateway times both itself:
TTFT from the request's arrival to the first body byte relayed, ITL as the stream's mean gap
between events after the first (a reply that is not streamed has no ITL to miss). Every
successful request is judged once, at its finish (``RequestRecord.finish``), and counted on
``/metrics`` by outcome (``Outcome``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["SLO_ITL_HEADER", "SLO_TTFT_HEADER", "Outcome", "Slo", "judge", "parse_slo"]

SLO_TTFT_HEADER = b"x-kvsidecar-slo-ttft-ms"
SLO_ITL_HEADER = b"x-kvsidecar-slo-itl-ms"
_MAX_MS = 3_600_000.0  # an hour: anything longer is a mistake, not a target


class Outcome(enum.StrEnum):
    """How a served request fared against its targets."""

    MET = "met"
    MISSED_TTFT = "missed_ttft"
    MISSED_ITL = "missed_itl"
    MISSED_BOTH = "missed_both"


@dataclass(frozen=True, slots=True)
class Slo:
    """A request's targets, in seconds."""

    ttft_s: float = 2.0
    itl_s: float = 0.1

    def __post_init__(self) -> None:
        for name, value in (("--slo-ttft-ms", self.ttft_s), ("--slo-itl-ms", self.itl_s)):
            if not math.isfinite(value) or not 0 < value * 1000 <= _MAX_MS:
                raise ValueError(f"{name} must be in (0, {_MAX_MS:g}], got {value * 1000:g}")


def _target_ms(raw: bytes, header: bytes) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not 0 < value <= _MAX_MS:
        raise ValueError(f"{header.decode()} must be a number of milliseconds in "
                         f"(0, {_MAX_MS:g}], got {raw[:32]!r}")
    return value


def parse_slo(headers: dict[bytes, bytes], default: Slo) -> Slo:
    """The request's targets: ``default``, with what its headers name instead; ``ValueError``
    naming the header when one is not a positive number of milliseconds."""
    ttft = headers.get(SLO_TTFT_HEADER)
    itl = headers.get(SLO_ITL_HEADER)
    if ttft is None and itl is None:
        return default
    return Slo(default.ttft_s if ttft is None else _target_ms(ttft, SLO_TTFT_HEADER) / 1000,
               default.itl_s if itl is None else _target_ms(itl, SLO_ITL_HEADER) / 1000)


def judge(slo: Slo, ttft_s: float, itl_s: float | None) -> Outcome:
    """``ttft_s`` and the stream's mean ``itl_s`` (None: not a stream) against ``slo``."""
    late = ttft_s > slo.ttft_s
    choppy = itl_s is not None and itl_s > slo.itl_s
    if late:
        return Outcome.MISSED_BOTH if choppy else Outcome.MISSED_TTFT
    return Outcome.MISSED_ITL if choppy else Outcome.MET
