"""``python -m refengine`` / ``kvsidecar engine``: serve the CPU reference engine.

Prints one JSON *ready line* per replica on stdout once it is serving (``{"event":
"server_started", "replica", "host", "port", "url", "kv_events_endpoint",
"kv_replay_endpoint"}``), with the ports actually bound (``--port 0`` and ZMQ port ``*``/``0``
pick free ones); ``--ready-file`` gets the same lines. Logs go to stderr as JSON.
SIGTERM/SIGINT: report unhealthy, stop accepting, finish in-flight work (up to 10 s), stop.
"""

from __future__ import annotations

import sys

import uvloop

from kvcore.logs import configure_logging
from refengine.config import EngineConfig

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    cfg = EngineConfig.from_args(argv)  # a bad flag or config: argparse's error, exit 2
    configure_logging(cfg.log_level)
    from refengine.launcher import serve  # noqa: PLC0415 - torch loads only once flags are valid

    try:
        uvloop.run(serve(cfg))
    except ValueError as exc:
        print(f"refengine: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
