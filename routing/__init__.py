"""The gateway: the OpenAI-compatible entry that places each request where its prefix is cached.

Subpackages, lowest first: ``placement`` (the pure core: prefix index, load, scorer),
``prompt`` (parse, template, tokens, hashes), ``http`` (the server and the keep-alive client
on the wire), ``workers`` (the registry, probes, the sidecars' event feeds), ``pd``
(prefill/decode pairs), ``pipeline`` (one request, stage by stage) and ``serve`` (the
process). ``config`` and ``metrics`` sit beside them.

Imports only ``kvcore`` of ours: never torch, posix_ipc, shm or an engine package.
"""
