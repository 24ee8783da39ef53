"""What the ZMQ KV-event streams of SGLang, vLLM and TensorRT-LLM 1.4 share, written once.

The engines publish the same way (SGLang's ``kv_events.py`` follows vLLM's
``vllm/distributed/kv_events.py``; TensorRT-LLM 1.4's pushed events copy vLLM's format): a
PUB socket sending ``[topic, seq, payload]`` with a per-publisher sequence number (one
publisher per DP rank, at the base ports plus its rank: ``endpoints``), and a ROUTER
replaying its buffer from a requested seq, ended by a seq of -1. So the framing
(``framing``), the sequence rules (``sequencer``), the socket loop with gap fill, probes and
restart resyncs (``subscriber``) and the per-batch bookkeeping (``batches``: decode fallback,
decode errors once per seq, native event counts) live here; each adapter brings only its
payload decoding and how its events normalize.
"""
