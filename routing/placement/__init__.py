"""The placement core: pure and synchronous, driven by the gateway's event loop.

``PrefixIndex`` (which worker holds which blocks, from the sidecars' events), ``PendingPrefixes``
(what was just routed, until its events confirm it), ``ActiveLoad`` (what is in flight on each
worker: the gateway's one in-flight count) and ``Scorer`` (Dynamo's cost over overlap and
load), assembled by ``KvRouter``; ``policies`` picks a worker per ``--router-mode``.
``Refusal`` is what the stages above answer when no worker can be had.
"""
