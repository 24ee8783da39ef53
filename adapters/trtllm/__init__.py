"""TensorRT-LLM adapter: KV events from ``POST /kv_cache_events`` (or the LLM API), request
translation to ``trtllm-serve``'s ``/v1/completions``, prefill/decode through its
``disaggregated_params`` (``pd``), and the KV cache connector (``connector``).

Never imports ``tensorrt_llm`` at module load: the one feature that needs it
(``adapters.trtllm.llm_api``) imports it lazily and names the ``trtllm`` extra when missing.
"""
