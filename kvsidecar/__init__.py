"""The ``kvsidecar`` command line: one console script, a subcommand per process."""
