"""The KV indexer API (Mooncake's RFC #1403): what other routers ask our index."""
