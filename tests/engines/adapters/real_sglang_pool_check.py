"""Round trip through SGLang's real ``MHATokenToKVPoolHost`` class (run as a script).

``python tests/engines/adapters/real_sglang_pool_check.py SOCKET LAYOUT...``: builds the real
host pool on CPU tensors (``pin_memory=False``, ``device="cpu"``), loads our backend through
SGLang's factory, writes scattered pages with ``batch_set_v1``, reads them into other pages
with ``batch_get_v1`` and compares bytes. Exit 0: byte-exact; 77: the real pool class cannot
be imported in this environment (the reason is printed on stderr); anything else: a failure.
It runs in its own process because a failed import of ``sglang.srt.mem_cache.pool_host``
leaves half-imported sglang modules behind.
"""

from __future__ import annotations

import sys

SKIP = 77
LAYERS, HEADS, HEAD_DIM, PAGE, TOKENS = 3, 2, 8, 4, 64


def main(socket: str, layout: str) -> int:
    import torch

    from tests.support.sglang_shim import stub_vision_modules

    stub_vision_modules()
    try:
        from sglang.srt.mem_cache.device_pool_info import (
            KVBufferLayout,
            KVBuffers,
            MHABufferInfo,
        )
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    except ImportError as exc:
        print(f"SGLang's host pool module does not import here: {exc!r}", file=sys.stderr)
        return SKIP
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    def pool() -> MHATokenToKVPoolHost:
        k = [torch.zeros(TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
        v = [torch.zeros(TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(LAYERS)]
        ptrs = [torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64) for x in (k, v)]
        info = MHABufferInfo(
            buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1],
                              layout=KVBufferLayout.NHD),
            page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
            dtype=torch.bfloat16, device=torch.device("cpu"))
        return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=TOKENS, start_layer=0,
                                    end_layer=LAYERS)

    src, dst = pool(), pool()
    raw = src.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 255, raw.shape, dtype=torch.uint8))
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name="org/model-a",
        extra_config={"backend_name": "kvsidecar", "module_path": "adapters.sglang.hicache",
                      "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1,
                      "socket": socket})
    writer = StorageBackendFactory.create_backend("dynamic", config, src)
    reader = StorageBackendFactory.create_backend("dynamic", config, dst)
    writer.register_mem_pool_host(src)
    reader.register_mem_pool_host(dst)
    # Each layout its own tokens: both runs share one store, whose blocks hold one layout's
    # bytes (a deployment uses one host layout).
    first = 0 if layout == "page_first" else 1000
    keys = get_hash_str(list(range(first, first + 4 * PAGE)), None, page_size=PAGE)
    src_idx, dst_idx = src.alloc(4 * PAGE), dst.alloc(4 * PAGE)
    dst_idx = dst_idx.flip(0).reshape(4, PAGE).flip(1).reshape(-1)  # other pages, reversed
    try:
        if writer.batch_set_v1(keys, src_idx) != [True] * 4:
            return 1
        if reader.batch_get_v1(keys, dst_idx) != [True] * 4:
            return 2
    finally:
        writer.close()
        reader.close()
    for i in range(4):
        a = src.get_data_page(int(src_idx[i * PAGE])).view(torch.uint8)
        b = dst.get_data_page(int(dst_idx[i * PAGE])).view(torch.uint8)
        if not torch.equal(a, b):
            print(f"page {i} differs", file=sys.stderr)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(max(main(sys.argv[1], layout) for layout in sys.argv[2:]))
