"""The gateway process: ``Gateway`` owns the server, the workers, the placement core and the
metrics, answers the views (``/health``, ``/v1/models``, ``/v1/workers``, ``/metrics``) and
hands each proxied request to the pipeline."""
