"""vLLM adapter: KV events over ZMQ with replay (``vllm/distributed/kv_events.py``, through
the stream shared with SGLang, ``adapters.zmq_events``), request translation to
``/v1/completions`` with token ids, load from ``/metrics`` and ``/load``.

Speaks vLLM's wire formats and imports nothing of vLLM.
"""
