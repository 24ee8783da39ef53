"""The embedded CPU reference engine: a small Llama-style model with a paged, prefix-cached KV
cache that speaks SGLang's HTTP API, KV-event wire format and HiCache storage interface.

Modules, one concept each:

* ``page_hash`` — SGLang's SHA-256 page-hash chain and its int64 event form;
* ``model`` / ``presets`` — the torch decoder and its size presets;
* ``tokenizer`` — tokenizer and chat template from a model directory;
* ``kv_pool`` / ``prefix_cache`` — page allocator, KV storage and the hash-chain prefix cache;
* ``scheduler`` — pure admission, chunked prefill and decode batching;
* ``executor`` / ``timing`` — the simulated compute and its timing model (no torch);
* ``torch_compute`` — the torch KV pool and executor (loaded by ``--compute torch`` only);
* ``host_tier`` / ``tiering`` — the HiCache-shaped page-store hook and the engine's use of it;
* ``kv_events`` — SGLang's ZMQ PUB + ROUTER replay publisher;
* ``engine`` — the async loop tying them together; ``server`` / ``openai_api`` — HTTP.
"""
