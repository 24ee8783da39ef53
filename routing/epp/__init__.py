"""The Gateway API Inference Extension endpoint picker: ``kvsidecar epp``.

Envoy (a Gateway with an ``InferencePool``) asks it, over the ``ext_proc`` gRPC protocol,
which pod serves each request; it places the request with the gateway's own parts (prompt,
router, worker registry, sidecar discovery) and answers with the engine's ``ip:port``.
``grpcio`` and the Envoy messages (``xds-protos``) are the ``epp`` extra, loaded lazily
(``deps``), so the gateway never imports them.
"""
