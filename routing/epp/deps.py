"""The ``epp`` extra, loaded on first use: gRPC, its health service and Envoy's messages.

Neither grpcio nor xds-protos ships type stubs; the modules are handed out as ``Any`` and
the code that builds messages keeps to the fields of Envoy's ``ext_proc`` v3 protocol.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any

from kvcore.extras import MissingExtraError

__all__ = ["Protos", "load"]


@dataclass(frozen=True, slots=True)
class Protos:
    """The modules the endpoint picker speaks with."""

    grpc: Any
    aio: Any  # grpc.aio
    ext_proc: Any  # envoy.service.ext_proc.v3.external_processor_pb2
    ext_proc_grpc: Any  # ... _pb2_grpc: the service
    mode: Any  # envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2
    core: Any  # envoy.config.core.v3.base_pb2: HeaderValue(Option), Metadata
    http_status: Any  # envoy.type.v3.http_status_pb2
    struct: Any  # google.protobuf.struct_pb2
    health: Any  # grpc_health.v1.health (HealthServicer, aio)
    health_pb2: Any
    health_grpc: Any


@cache
def load() -> Protos:
    """The modules, or ``MissingExtraError`` naming the extra to install."""
    names = {
        "grpc": "grpc",
        "aio": "grpc.aio",
        "ext_proc": "envoy.service.ext_proc.v3.external_processor_pb2",
        "ext_proc_grpc": "envoy.service.ext_proc.v3.external_processor_pb2_grpc",
        "mode": "envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2",
        "core": "envoy.config.core.v3.base_pb2",
        "http_status": "envoy.type.v3.http_status_pb2",
        "struct": "google.protobuf.struct_pb2",
        "health": "grpc_health.v1.health",
        "health_pb2": "grpc_health.v1.health_pb2",
        "health_grpc": "grpc_health.v1.health_pb2_grpc",
    }
    try:
        modules = {field: importlib.import_module(name) for field, name in names.items()}
    except ImportError as exc:
        raise MissingExtraError("kvsidecar epp", "epp",
                                "grpcio, grpcio-health-checking, xds-protos", exc) from exc
    return Protos(**modules)
