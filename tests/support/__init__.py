"""Helpers shared by the suites, imported as ``tests.support.*`` (fixtures: conftest.py)."""
