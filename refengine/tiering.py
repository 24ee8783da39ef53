"""Engine-side use of the page store: write-through of computed pages and prefix loads.

Pages move device pool → host staging pool → store (``batch_set_v1``) on write, and store →
host staging pool (``batch_get_v1``) → device pool on load, in batches of at most
``STORAGE_BATCH_SIZE`` pages, as SGLang's cache controller does. These calls block (copies,
file I/O), so the engine runs them in a worker thread.
"""

from __future__ import annotations

from refengine.host_tier import STORAGE_BATCH_SIZE, HostKVPool, PageStore, StorageExtraInfo
from refengine.kv_pool import KVStore

__all__ = ["PageStoreClient"]


class PageStoreClient:
    """The engine's side of the page store: writes computed pages through and loads
    prefixes back (the sidecar's ``HostTier`` is the store's own side)."""

    def __init__(self, store: PageStore, pool: HostKVPool, kv: KVStore) -> None:
        self.store = store
        self.pool = pool
        self.kv = kv
        store.register_mem_pool_host(pool)
        self.batch = min(STORAGE_BATCH_SIZE, pool.num_pages)  # pages per store call
        self.pages_written = 0
        self.pages_loaded = 0

    def count(self, keys: list[str], prefix_keys: list[str]) -> int:
        """How many leading ``keys`` the store holds."""
        total = 0
        for i in range(0, len(keys), self.batch):
            batch = keys[i : i + self.batch]
            info = StorageExtraInfo(prefix_keys=prefix_keys + keys[:i])
            n = self.store.batch_exists(batch, info)
            total += n
            if n < len(batch):
                break
        return total

    def write(self, keys: list[str], pages: list[int], prefix_keys: list[str]) -> int:
        """Write pages not yet in the store; returns how many were written."""
        have = self.count(keys, prefix_keys)
        written = 0
        for i in range(have, len(keys), self.batch):
            batch_keys = keys[i : i + self.batch]
            batch_pages = pages[i : i + self.batch]
            host = self.pool.alloc(len(batch_keys))
            try:
                view = self.pool.pages_view(host)
                if view is not None:
                    self.kv.read_pages(batch_pages, out=view)
                else:
                    self.pool.kv_buffer[self.pool.page_rows(host)] = self.kv.read_pages(batch_pages)
                info = StorageExtraInfo(prefix_keys=prefix_keys + keys[:i])
                ok = self.store.batch_set_v1(batch_keys, host, info)
            finally:
                self.pool.free(host)
            written += sum(ok)
        self.pages_written += written
        return written

    def load(self, keys: list[str], pages: list[int], prefix_keys: list[str]) -> int:
        """Load leading ``keys`` into device ``pages``; returns how many consecutive loaded."""
        loaded = 0
        for i in range(0, len(keys), self.batch):
            batch_keys = keys[i : i + self.batch]
            host = self.pool.alloc(len(batch_keys))
            try:
                info = StorageExtraInfo(prefix_keys=prefix_keys + keys[:i])
                ok = self.store.batch_get_v1(batch_keys, host, info)
                good = next((j for j, v in enumerate(ok) if not v), len(ok))
                if good:
                    view = self.pool.pages_view(host)
                    data = (
                        view[:good]
                        if view is not None
                        else self.pool.kv_buffer[self.pool.page_rows(host)[:good]]
                    )
                    self.kv.write_pages(pages[i : i + good], data)
            finally:
                self.pool.free(host)
            loaded += good
            if good < len(batch_keys):
                break
        self.pages_loaded += loaded
        return loaded
