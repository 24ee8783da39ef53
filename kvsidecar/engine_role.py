"""The P/D role a sidecar announces (``kvsidecar sidecar --role``), read off its engine.

The gateway pairs prefill and decode workers by the role their sidecars announce, so a
sidecar beside a prefill engine that says ``agg`` is sent whole requests it cannot finish.
The engine's own flags already say which half it is: SGLang's ``--disaggregation-mode
prefill|decode`` and TensorRT-LLM's ``trtllm-serve --server_role CONTEXT|GENERATION``. Some
deployments do not pass them (a TensorRT-LLM worker is often told nothing, its half being
set by the orchestrator's config), so the pod annotation ``kvsidecar.io/role`` overrides
whatever the flags say. ``kvsidecar inject`` and ``kvsidecar webhook`` both come here,
through ``kvsidecar.k8s_patch``, so a pod gets the same role from either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from adapters.base import EngineKind
from kvcore.stream import Role
from kvsidecar.engine_flags import flag_value

__all__ = ["ROLES", "ROLE_ANNOTATION", "RoleChoice", "engine_role"]

ROLE_ANNOTATION = "kvsidecar.io/role"
ROLES: tuple[str, ...] = get_args(Role)  # the sidecar's --role values
# SGLang's --disaggregation-mode: "null" is its own spelling of "not disaggregated".
_SGLANG_MODES = {"null": "agg", "prefill": "prefill", "decode": "decode"}
# TensorRT-LLM's ServerRole names (--server_role is matched case-blind, as trtllm-serve does).
_TRTLLM_ROLES = {"CONTEXT": "prefill", "GENERATION": "decode"}


@dataclass(frozen=True)
class RoleChoice:
    role: str
    note: str | None = None  # when the annotation overrides what the flags say


def engine_role(
    engine: EngineKind, words: Sequence[str], annotations: Mapping[str, Any]
) -> RoleChoice:
    """The role for an ``engine`` run with ``words``, ``annotations`` overriding.

    Raises ``ValueError`` (with what to do) for an annotation that is not a role, or flags
    naming a role the sidecar has no pool for, unless the annotation settles it.
    """
    wanted = annotations.get(ROLE_ANNOTATION)
    if wanted is not None and wanted not in ROLES:
        raise ValueError(
            f"annotation {ROLE_ANNOTATION} must be one of {', '.join(ROLES)}, got {wanted!r}"
        )
    try:
        derived, source = _from_flags(engine, words)
    except ValueError:
        if wanted is None:
            raise
        return RoleChoice(wanted)
    if wanted is None:
        return RoleChoice(derived)
    note = None
    if source is not None and wanted != derived:
        note = (
            f"annotation {ROLE_ANNOTATION}={wanted} overrides {source}, which says {derived}"
        )
    return RoleChoice(wanted, note)


def _from_flags(engine: EngineKind, words: Sequence[str]) -> tuple[str, str | None]:
    """The role the flags give, and the flag that gave it (``None``: no flag, ``agg``)."""
    if engine is EngineKind.SGLANG:
        mode = flag_value(words, "--disaggregation-mode")
        if mode is None:
            return "agg", None
        if mode not in _SGLANG_MODES:
            raise ValueError(
                f"the engine runs --disaggregation-mode {mode}, which kvsidecar has no pool "
                f"for: give the pod the annotation {ROLE_ANNOTATION} (agg, prefill or decode)"
            )
        return _SGLANG_MODES[mode], f"--disaggregation-mode {mode}"
    if engine is EngineKind.TRTLLM:
        if "disaggregated_mpi_worker" in words:
            raise ValueError(
                "the engine is trtllm-serve disaggregated_mpi_worker, whose context and "
                "generation servers share one MPI world, so no one role fits its pod: run "
                "each as trtllm-serve --server_role CONTEXT|GENERATION, or give the pod the "
                f"annotation {ROLE_ANNOTATION}"
            )
        role = flag_value(words, "--server_role")
        if role is None:
            return "agg", None
        if role.upper() not in _TRTLLM_ROLES:
            raise ValueError(
                f"the engine runs --server_role {role}, which kvsidecar has no pool for: give "
                f"the pod the annotation {ROLE_ANNOTATION} (agg, prefill or decode)"
            )
        return _TRTLLM_ROLES[role.upper()], f"--server_role {role}"
    return "agg", None  # an engine whose P/D flags we do not read: the annotation decides
