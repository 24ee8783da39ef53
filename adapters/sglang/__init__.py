"""SGLang adapter: KV events over ZMQ (with replay), request translation to ``/generate``, and
the HiCache storage backend (``hicache.py``) SGLang loads into its own process.

The adapter speaks SGLang's wire formats and imports nothing of SGLang; only the storage
backend subclasses SGLang's ``HiCacheStorage`` when SGLang is installed (it runs inside it).
"""
