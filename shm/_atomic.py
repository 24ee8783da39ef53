"""A compare-and-swap on an 8-byte word of shared memory, for standby grants.

A writer and the owner decide who gets a standby grant's slots (``shm.read_index``'s
standby words) by swapping the same word: one locked instruction, so neither needs a fence
between a store of its own and a load of the other's (x86 reorders exactly those). numpy
and the standard library issue no locked instruction; GCC's ``libatomic`` (``libatomic1``,
installed with the compiler runtime nearly everywhere) exports one, called through ctypes
(about 1 µs a call). Without it ``AVAILABLE`` is False and the owner grants no standby
slots: every put reserves.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["AVAILABLE", "compare_exchange"]

_SEQ_CST = 5


def _load() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("atomic")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).__atomic_compare_exchange_8
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_bool,
                   ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_bool
    return fn


_CAS = _load()
AVAILABLE = _CAS is not None


def compare_exchange(address: int, expected: int, desired: int) -> bool:
    """Atomically: if the u64 at ``address`` (8-byte aligned) is ``expected``, store
    ``desired`` and return True; else change nothing and return False."""
    if _CAS is None:
        raise RuntimeError("no atomic compare-and-swap here (libatomic not found)")
    seen = ctypes.c_uint64(expected)
    return bool(_CAS(address, ctypes.addressof(seen), desired, False, _SEQ_CST, _SEQ_CST))
