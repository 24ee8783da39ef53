"""The engine's typed configuration and its command line (flag names follow SGLang's)."""

from __future__ import annotations

import argparse
import enum
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from refengine.kv_events import KVEventsConfig
from refengine.timing import TimingModel
from refengine.tokenizer import DEFAULT_MODEL_PATH

__all__ = ["DEFAULT_POOL_BYTES", "Compute", "DisaggMode", "EngineConfig", "build_parser"]

DEFAULT_POOL_BYTES = 1 << 30  # default KV pool budget when --max-total-tokens is not given


class Compute(enum.Enum):
    TORCH = "torch"
    SIM = "sim"


class DisaggMode(enum.Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    model_path: Path = DEFAULT_MODEL_PATH
    model_preset: str | None = None
    served_model_name: str | None = None
    page_size: int = 16
    max_total_tokens: int | None = None  # None: derived from the model (see with_model)
    chunked_prefill_size: int = 512
    max_running_requests: int = 64
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    kv_events_config_raw: str | None = None
    compute: Compute = Compute.TORCH
    timing: TimingModel = field(default_factory=TimingModel)
    replicas: int = 1
    hicache_storage_backend: str | None = None
    hicache_extra_config: dict[str, Any] = field(default_factory=dict)
    hicache_host_pages: int = 256
    disaggregation_mode: DisaggMode = DisaggMode.NULL
    torch_threads: int | None = None
    random_seed: int = 0
    ready_file: Path | None = None
    log_level: str = "info"
    api_key: str | None = field(default=None, repr=False)  # never in a log line

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"--max-total-tokens ({self.max_total_tokens}) must hold at least one page "
                f"(--page-size {self.page_size})"
            )
        if self.chunked_prefill_size < 1:
            raise ValueError("--chunked-prefill-size must be >= 1")
        if self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.replicas < 1:
            raise ValueError("--replicas must be >= 1")
        if self.replicas > 1 and self.compute is Compute.TORCH:
            raise ValueError("--replicas > 1 needs --compute sim (one torch model per process)")
        if self.hicache_host_pages < 1:
            raise ValueError("--hicache-host-pages must be >= 1")
        if self.disaggregation_mode is not DisaggMode.NULL and not self.hicache_storage_backend:
            raise ValueError(
                "--disaggregation-mode prefill/decode moves pages through the page store: "
                "set --hicache-storage-backend (e.g. file with "
                "--hicache-storage-backend-extra-config '{\"file_path\": DIR}')"
            )
        if not (self.model_path / "tokenizer.json").exists():
            raise ValueError(f"--model-path {self.model_path} has no tokenizer.json")

    @property
    def num_pages(self) -> int:
        if self.max_total_tokens is None:
            raise RuntimeError("max_total_tokens is unresolved: call with_model() first")
        return self.max_total_tokens // self.page_size

    def with_model(self, kv_bytes_per_token: int) -> EngineConfig:
        """Resolve the default pool size: 32,768 tokens, or fewer if that would take more
        than ``DEFAULT_POOL_BYTES`` of KV (torch compute only; sim pools hold no bytes)."""
        if self.max_total_tokens is not None:
            return self
        tokens = 32768
        if self.compute is Compute.TORCH:
            tokens = min(tokens, DEFAULT_POOL_BYTES // kv_bytes_per_token)
        return replace(
            self, max_total_tokens=max(self.page_size, tokens // self.page_size * self.page_size)
        )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path.name

    @classmethod
    def from_args(cls, argv: list[str] | None) -> EngineConfig:
        args = build_parser().parse_args(argv)
        extra: dict[str, Any] = {}
        if args.hicache_storage_backend_extra_config:
            try:
                extra = json.loads(args.hicache_storage_backend_extra_config)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"--hicache-storage-backend-extra-config is not valid JSON: {exc}"
                ) from exc
        backend = args.hicache_storage_backend
        if backend is None and args.enable_hierarchical_cache:
            backend = "memory"
        timing = TimingModel(
            prefill_base_s=args.sim_prefill_base_ms / 1e3,
            prefill_per_token_s=args.sim_prefill_us_per_token / 1e6,
            decode_base_s=args.sim_decode_base_ms / 1e3,
            decode_per_seq_s=args.sim_decode_us_per_seq / 1e6,
            speedup=args.speedup,
        )
        return cls(
            host=args.host,
            port=args.port,
            model_path=Path(args.model_path),
            model_preset=args.model_preset,
            served_model_name=args.served_model_name,
            page_size=args.page_size,
            max_total_tokens=args.max_total_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            max_running_requests=args.max_running_requests,
            kv_events=KVEventsConfig.from_cli(args.kv_events_config),
            kv_events_config_raw=args.kv_events_config,
            compute=Compute(args.compute),
            timing=timing,
            replicas=args.replicas,
            hicache_storage_backend=backend,
            hicache_extra_config=extra,
            hicache_host_pages=args.hicache_host_pages,
            disaggregation_mode=DisaggMode(args.disaggregation_mode),
            torch_threads=args.torch_threads,
            random_seed=args.random_seed,
            ready_file=Path(args.ready_file) if args.ready_file else None,
            log_level=args.log_level,
            api_key=args.api_key or None,
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvsidecar engine",
        description="The CPU reference engine: a small Llama-style model with a paged, "
        "prefix-cached KV cache, serving SGLang's HTTP API and publishing SGLang's KV events.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    s.add_argument("--port", type=int, default=30000, help="HTTP port; 0 picks a free one")
    s.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="serve N independent engines in this process (sim compute only), on "
        "ports port..port+N-1 (all ephemeral with --port 0)",
    )
    s.add_argument("--ready-file", help="write the ready line(s) (JSON) to this file too")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.add_argument(
        "--api-key",
        help="as SGLang's: every route but /health*, /ready* and /metrics* then needs "
        "'Authorization: Bearer <key>' (401 otherwise)",
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model-path",
        default=str(DEFAULT_MODEL_PATH),
        help="directory with tokenizer.json, tokenizer_config.json, config.json",
    )
    m.add_argument(
        "--model-preset",
        choices=["tiny", "kv-heavy"],
        help="override the directory's model sizes with a preset",
    )
    m.add_argument("--served-model-name", help="model id reported by the API")
    m.add_argument(
        "--compute",
        choices=[c.value for c in Compute],
        default="torch",
        help="torch: run the model; sim: timing model only, no math",
    )
    m.add_argument("--torch-threads", type=int, help="torch intra-op threads")
    m.add_argument("--random-seed", type=int, default=0, help="seed for sampled decoding")
    c = p.add_argument_group("KV cache")
    c.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    c.add_argument(
        "--max-total-tokens",
        type=int,
        help="KV pool size in tokens (default: 32768, capped at 1 GiB of KV)",
    )
    c.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=512,
        help="prompt tokens computed per prefill step",
    )
    c.add_argument("--max-running-requests", type=int, default=64)
    c.add_argument(
        "--kv-events-config",
        help='SGLang\'s JSON, e.g. {"publisher":"zmq","endpoint":"tcp://*:5557",'
        '"replay_endpoint":"tcp://*:5558","topic":"kv-events"}; port * or 0 binds '
        "an ephemeral port",
    )
    h = p.add_argument_group("host tier (HiCache storage interface)")
    h.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        help="write pages through to a page store (memory unless a backend is set)",
    )
    h.add_argument(
        "--hicache-storage-backend",
        choices=["memory", "file", "dynamic"],
        help="page store: in-process dict, a directory, or a class named in the "
        "extra config (module_path, class_name, backend_name)",
    )
    h.add_argument("--hicache-storage-backend-extra-config", help="JSON passed to the backend")
    h.add_argument(
        "--hicache-host-pages", type=int, default=256, help="pages in the host staging pool"
    )
    h.add_argument("--hicache-write-policy", choices=["write_through"], default="write_through")
    d = p.add_argument_group("disaggregation")
    d.add_argument(
        "--disaggregation-mode",
        choices=[m.value for m in DisaggMode],
        default="null",
        help="prefill: stop after the first token and export the prompt's pages; "
        "decode: import the prompt's pages from the page store",
    )
    t = p.add_argument_group("simulated timing (--compute sim)")
    t.add_argument("--speedup", type=float, default=1.0, help="divide every simulated duration")
    t.add_argument("--sim-prefill-base-ms", type=float, default=2.0)
    t.add_argument("--sim-prefill-us-per-token", type=float, default=50.0)
    t.add_argument("--sim-decode-base-ms", type=float, default=8.0)
    t.add_argument("--sim-decode-us-per-seq", type=float, default=200.0)
    return p
