"""SGLang adapter: KV events over ZMQ (with replay), request translation to ``/generate``.

Speaks SGLang's wire formats; never imports the ``sglang`` package.
"""
