"""``kvsidecar top``: the fleet live, as one gateway sees it.

Polls the gateway's ``GET /v1/workers`` (health, parity, in-flight load, cached blocks,
capacity) and ``GET /metrics`` (the engines' usage against the gateway's predictions) and
prints one row per worker:

* ``cache``: GPU blocks the gateway's index holds for the worker, over its KV capacity when
  the worker reports one (``occ``: the fraction);
* ``hit``: cached prompt tokens the engine reported, over the prompt tokens it reported, for
  the requests that carried a usage object;
* ``pred err``: per such request, the cached tokens predicted at placement less those the
  engine reported (positive: the gateway expected cache the engine did not have);
* ``in-flight``, ``reqs``, ``parity``, ``health`` as the gateway has them;
* ``itl+1``: the inter-token latency the gateway predicts for the worker's batch with one
  more stream (its learned decode-interference model; ``-`` before it has a fit).

Rates are over the last interval; the first table (and ``--once``) covers everything since the
gateway started. A footer gives the scored placements' achieved over achievable overlap and
why a shallower worker was chosen (``kvsidecar_gateway_placement_reason``), and the scorer's
learned parameters (overlap weight, prefill load scale, the decode-interference fit). Plain
text: a
refreshing screen with ANSI clears, or one table with ``--once``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Snapshot", "fetch", "main", "render"]

_P = "kvsidecar_gateway_"
# per-worker counters read from /metrics (the family name, without _total)
_WORKER_COUNTERS = (
    "worker_requests",
    "worker_actual_cached_tokens",
    "worker_usage_prompt_tokens",
    "worker_prediction_checks",
    "worker_overpredicted_tokens",
    "worker_underpredicted_tokens",
)
_CLEAR = "\x1b[H\x1b[2J"


@dataclass
class Snapshot:
    """One poll of the gateway."""

    t: float
    workers: list[dict[str, Any]]
    router_mode: str
    scorer: dict[str, Any] = field(default_factory=dict)
    counters: dict[str, dict[str, float]] = field(default_factory=dict)  # family → worker → n
    reasons: dict[str, float] = field(default_factory=dict)
    best_blocks: float = 0.0
    chosen_blocks: float = 0.0


class GatewayError(Exception):
    """The gateway could not be read."""


def _get(url: str, api_key: str | None, timeout_s: float) -> bytes:
    request = urllib.request.Request(url)
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body: bytes = resp.read()
            return body
    except urllib.error.HTTPError as exc:
        raise GatewayError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise GatewayError(f"{url}: {reason}") from exc


def parse_metrics(text: str, snap: Snapshot) -> None:
    """Fill ``snap`` with the counters ``top`` reads from a Prometheus exposition."""
    wanted = {_P + name: name for name in _WORKER_COUNTERS}
    for family in text_string_to_metric_families(text):
        name = family.name
        if name in wanted:
            table = snap.counters.setdefault(wanted[name], {})
            for s in family.samples:
                if s.name.endswith("_total"):
                    table[s.labels.get("worker", "")] = s.value
        elif name == _P + "placement_reason":
            for s in family.samples:
                if s.name.endswith("_total"):
                    snap.reasons[s.labels.get("reason", "")] = s.value
        elif name in (_P + "best_overlap_blocks", _P + "chosen_overlap_blocks"):
            value = sum(s.value for s in family.samples if s.name.endswith("_total"))
            if name.endswith("best_overlap_blocks"):
                snap.best_blocks = value
            else:
                snap.chosen_blocks = value


def fetch(gateway: str, api_key: str | None = None, timeout_s: float = 5.0) -> Snapshot:
    """Read ``/v1/workers`` and ``/metrics`` once."""
    base = gateway.rstrip("/")
    try:
        state = orjson.loads(_get(base + "/v1/workers", api_key, timeout_s))
    except orjson.JSONDecodeError as exc:
        raise GatewayError(f"{base}/v1/workers: not JSON ({exc})") from exc
    if type(state) is not dict or type(state.get("workers")) is not list:
        raise GatewayError(f"{base}/v1/workers: no worker list (is this a kvsidecar gateway?)")
    scorer = state.get("scorer")
    snap = Snapshot(time.monotonic(), state["workers"], str(state.get("router_mode", "?")),
                    scorer if type(scorer) is dict else {})
    text = _get(base + "/metrics", api_key, timeout_s).decode(errors="replace")
    try:
        parse_metrics(text, snap)
    except ValueError as exc:
        raise GatewayError(f"{base}/metrics: not a Prometheus exposition ({exc})") from exc
    return snap


def _delta(now: Snapshot, prev: Snapshot | None, family: str, worker: str) -> float:
    value = now.counters.get(family, {}).get(worker, 0.0)
    if prev is not None:
        value -= prev.counters.get(family, {}).get(worker, 0.0)
    return value


def _row(w: dict[str, Any], now: Snapshot, prev: Snapshot | None) -> list[str]:
    wid = str(w.get("worker_id", "?"))
    cached = (w.get("cached_blocks") or {}).get("gpu", 0)
    capacity = w.get("capacity_blocks")
    cache = f"{cached}/{capacity}" if capacity else f"{cached}/-"
    occ = f"{100 * cached / capacity:.0f}%" if capacity else "-"
    prompt = _delta(now, prev, "worker_usage_prompt_tokens", wid)
    hit_tokens = _delta(now, prev, "worker_actual_cached_tokens", wid)
    hit = f"{100 * hit_tokens / prompt:.0f}%" if prompt > 0 else "-"
    checks = _delta(now, prev, "worker_prediction_checks", wid)
    over = _delta(now, prev, "worker_overpredicted_tokens", wid)
    under = _delta(now, prev, "worker_underpredicted_tokens", wid)
    error = f"{(over - under) / checks:+.1f}" if checks > 0 else "-"
    requests = _delta(now, prev, "worker_requests", wid)
    model = w.get("itl_model")
    itl = f"{1000 * model['next_itl_s']:.1f}ms" if model else "-"
    return [
        wid,
        str(w.get("health", "?")),
        str(w.get("parity", "-")),
        str(w.get("in_flight", 0)),
        f"{requests:.0f}",
        cache,
        occ,
        hit,
        error,
        itl,
    ]


_HEAD = ["worker", "health", "parity", "in-flight", "reqs", "cache", "occ", "hit", "pred err",
         "itl+1"]
_RIGHT = {3, 4, 5, 6, 7, 8, 9}  # numeric columns, right-aligned


def render(gateway: str, now: Snapshot, prev: Snapshot | None) -> str:
    """One table: a header line, a row per worker, and the placement footer."""
    span = "since start" if prev is None else f"last {now.t - prev.t:.1f}s"
    rows = [_HEAD] + [_row(w, now, prev) for w in now.workers]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEAD))]
    lines = [
        f"kvsidecar top — {gateway}  mode={now.router_mode}  workers={len(now.workers)}  "
        f"rates: {span}  (pred err: predicted − reported cached tokens per request)",
        "",
    ]
    for r in rows:
        cells = [c.rjust(widths[i]) if i in _RIGHT else c.ljust(widths[i]) for i, c in enumerate(r)]
        lines.append("  ".join(cells).rstrip())
    best = now.best_blocks - (prev.best_blocks if prev else 0.0)
    chosen = now.chosen_blocks - (prev.chosen_blocks if prev else 0.0)
    reasons = {
        k: v - (prev.reasons.get(k, 0.0) if prev else 0.0) for k, v in sorted(now.reasons.items())
    }
    lines.append("")
    if best > 0 or any(reasons.values()):
        achieved = f"{100 * chosen / best:.0f}%" if best > 0 else "-"
        why = "  ".join(f"{k}={v:.0f}" for k, v in reasons.items() if v)
        lines.append(
            f"overlap achieved/achievable: {chosen:.0f}/{best:.0f} blocks ({achieved})  "
            f"placements by reason: {why or '-'}"
        )
    else:
        lines.append("overlap achieved/achievable: no scored placements (kv/approx modes only)")
    lines.append(_scorer_line(now.scorer))
    return "\n".join(lines)


def _scorer_line(scorer: dict[str, Any]) -> str:
    """The scorer's weights and the decode-interference fit, on one line."""
    if not scorer:
        return "scorer: -"
    out = (f"scorer: overlap_weight={scorer.get('overlap_weight', 0):.3g}  "
           f"prefill_load_scale={scorer.get('prefill_load_scale', 0):.3g}")
    decode = scorer.get("decode_interference")
    if not decode:
        return out + "  decode interference: off"
    if not decode.get("priced"):
        return out + "  decode interference: learning"
    return out + (
        f"  decode interference: itl={1000 * decode['fleet_itl_base_s']:.1f}ms"
        f"+{1000 * decode['fleet_itl_per_stream_s']:.2f}ms/stream"
        f"  output={decode['output_tokens']:.0f} tok"
        f"  prefill={1e6 * decode['prefill_s_per_token']:.1f}us/tok"
        f"  target={1000 * decode['itl_target_s']:.0f}ms  weight={decode['weight']:g}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvsidecar top",
        description="The fleet live, as a gateway sees it: per worker cache occupancy, "
        "hit rate, load and prediction error, refreshed every --interval-s.",
    )
    p.add_argument(
        "--gateway",
        default="http://127.0.0.1:8000",
        help="the gateway's base URL (default http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--interval-s", type=float, default=2.0, help="seconds between refreshes (default 2)"
    )
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.add_argument(
        "--api-key-env",
        default="KVSIDECAR_API_KEY",
        help="environment variable holding an API key for a gateway run with --api-key-file "
        "(default KVSIDECAR_API_KEY; unset: no key sent)",
    )
    p.add_argument("--timeout-s", type=float, default=5.0, help="per-request timeout (default 5)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.interval_s <= 0 or args.timeout_s <= 0:
        parser.error("--interval-s and --timeout-s must be > 0")
    if not args.gateway.startswith(("http://", "https://")):
        parser.error(f"--gateway must be an http:// or https:// URL, got {args.gateway!r}")
    api_key = os.environ.get(args.api_key_env) or None
    if args.once:
        try:
            print(render(args.gateway, fetch(args.gateway, api_key, args.timeout_s), None))
        except GatewayError as exc:
            print(f"kvsidecar top: cannot read the gateway: {exc}", file=sys.stderr)
            return 1
        return 0
    prev: Snapshot | None = None
    try:
        while True:
            try:
                now = fetch(args.gateway, api_key, args.timeout_s)
            except GatewayError as exc:
                sys.stdout.write(f"{_CLEAR}kvsidecar top: cannot read the gateway: {exc}\n")
            else:
                sys.stdout.write(_CLEAR + render(args.gateway, now, prev) + "\n")
                prev = now
            sys.stdout.flush()
            time.sleep(args.interval_s)
    except KeyboardInterrupt:
        return 0
