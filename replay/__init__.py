"""Trace replay: live against a gateway, or offline through a model of the fleet."""
