"""``kvsidecar <command> ...``: dispatches to one subcommand, importing only that one.

Each subcommand module exposes ``main(argv: list[str] | None) -> int``; the gateway's does
not pull in torch or an engine because nothing else is imported here.
"""

from __future__ import annotations

import importlib
import sys

# name → (module with main(argv), one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kvsidecar.up", "run the local stack on the embedded CPU default"),
    "kv-size": ("kvsidecar.kv_size", "KV bytes per token and tier sizing from a model config"),
    "gateway": ("routing.__main__", "the OpenAI-compatible gateway with KV-aware placement"),
    "epp": ("routing.epp.__main__", "Gateway API Inference Extension endpoint picker (ext_proc)"),
    "indexer": ("kvsidecar.indexer",
                "the KV indexer API (Mooncake RFC #1403) over registered engines' KV events"),
    "sidecar": ("sidecar.__main__", "run beside one engine replica: event relay, proxy, health"),
    "engine": ("refengine.__main__", "the CPU reference engine (SGLang-compatible API and events)"),
    "replay": ("replay.__main__", "replay request traces live or offline, with a report"),
    "top": ("kvsidecar.top", "the fleet live from a gateway: cache, hit rate, load, prediction"),
    "shm": ("shm.__main__", "run a shared-memory KV block store owner (host tier)"),
    "blocks": ("sidecar.transfer.__main__",
               "a block store with sidecar-to-sidecar transfers, no engine (tests, peers)"),
    "inject": ("kvsidecar.inject", "add the sidecar to Kubernetes manifests of SGLang/TRT-LLM"),
    "webhook": ("kvsidecar.webhook", "the sidecar injection as a mutating admission webhook"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: kvsidecar <command> [options]",
        "",
        "An engine-agnostic KV-cache layer for LLM serving.",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "Run `kvsidecar <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"kvsidecar: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest))


if __name__ == "__main__":
    sys.exit(main())
