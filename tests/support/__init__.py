"""Helpers shared by the suites, imported as ``tests.support.*``; fixtures live in conftest.py.

- ``polling``: waits until a deadline (``wait_until``, ``wait_for``, ``eventually``,
  ``wait_http_ok[_async]``); never a fixed sleep.
- ``processes``: ready files, ready log events and stdout lines of child processes, and a
  ``ProcessGroup`` that stops what a test started.
- ``gateway``: ``routable``, until a running gateway's workers take requests.
- ``net``: ``ports_free``, whether a stopped process let its ports go.
- ``publishers``: faults at an engine's KV-event publisher (``DropOneSend``).
- ``store_owner``: real block store owners, in a thread or as ``python -m shm``
  (``kvsidecar.local_store``, which the benchmarks start theirs with).
- ``tier_stack``: ``LocalStack`` specs of reference engines whose HiCache hook writes through
  to their sidecar's store, for the KV-tier tests.
- ``transfer_peers``: in-process transfer peers (behind the ``make_peer`` fixture).
- ``tiny_model``: a tiny Llama-3-style model directory (behind ``tiny_model_dir``).
- ``sglang_standin`` / ``trtllm_standin``: engine stand-ins run as processes (SGLang 0.5.23's
  HTTP surface validated with SGLang's own request models; trtllm-serve's OpenAI surface),
  over the deterministic ``standin_model``, with ``standin_http``'s body recorder.
- ``openai_shapes``: replies checked against SGLang's OpenAI response models.
- ``scripts``: ``load_script``, a script of ``scripts/`` as a module, imports as when run.
"""
