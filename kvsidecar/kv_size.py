"""``kvsidecar kv-size``: KV bytes per token and how many tokens each tier holds."""

from __future__ import annotations

import argparse

from kvcore.layout import DTYPE_BYTES, BlockLayout

_GIB = 1 << 30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvsidecar kv-size",
        description="KV-cache bytes per token and block, and what each tier's capacity holds. "
        "Give a model directory (config.json) or the sizes directly.",
    )
    p.add_argument("--model-path", help="model directory or config.json (Hugging Face fields)")
    p.add_argument("--num-layers", type=int, help="transformer layers")
    p.add_argument("--num-kv-heads", type=int, help="key/value heads (GQA groups)")
    p.add_argument("--head-dim", type=int, help="dimension of one attention head")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="KV dtype (default: model's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    for tier in ("gpu", "host", "disk", "remote"):
        p.add_argument(f"--{tier}-gib", type=float, default=0.0, help=f"{tier} tier capacity, GiB")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.model_path:
            layout = BlockLayout.from_model_path(args.model_path, args.block_size, args.dtype)
        elif args.num_layers and args.num_kv_heads and args.head_dim:
            layout = BlockLayout(
                args.num_layers,
                args.num_kv_heads,
                args.head_dim,
                args.block_size,
                args.dtype or "bfloat16",
            )
        else:
            parser.error("give --model-path, or all of --num-layers --num-kv-heads --head-dim")
    except ValueError as exc:
        parser.error(str(exc))
    print(
        f"layers={layout.num_layers} kv_heads={layout.num_kv_heads} head_dim={layout.head_dim} "
        f"dtype={layout.dtype} block_size={layout.block_size}"
    )
    print(f"KV bytes per token: {layout.bytes_per_token:,}")
    print(f"KV bytes per block: {layout.bytes_per_block:,}")
    rows = [(t, getattr(args, f"{t}_gib")) for t in ("gpu", "host", "disk", "remote")]
    rows = [(t, gib) for t, gib in rows if gib > 0]
    if rows:
        print(f"\n{'tier':<8}{'GiB':>10}{'blocks':>14}{'tokens':>16}")
        for tier, gib in rows:
            blocks = layout.blocks_in(int(gib * _GIB))
            print(f"{tier:<8}{gib:>10.2f}{blocks:>14,}{blocks * layout.block_size:>16,}")
    return 0
