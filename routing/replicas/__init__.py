"""Gateway replicas that agree over NATS (``--nats``): each publishes its placements and their
lifecycle, and folds the others' into its own load and speculative prefixes (docs/replicas.md)."""
