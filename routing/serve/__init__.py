"""The gateway process: its HTTP server, the keep-alive client to the workers, metrics, and
``Gateway``, which owns them and hands each request to the pipeline."""
