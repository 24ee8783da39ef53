"""The workers requests go to: one registry (kind, role, health, capacity), the probes, the
sidecars' discovery and their event feeds."""
