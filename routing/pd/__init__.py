"""Prefill/decode disaggregation in the gateway: the pools, pair placement and backpressure."""
