"""Memory a long prompt took, handed back to the system.

When a long prompt ends, the engine drops the pool it grew (`Drama3Engine`), and torch frees its
tensors; but on Linux the C library keeps most freed memory of a CPU process in its heap for the
next allocation, so the process's resident memory stays at the peak (drama3-tiny: +180 MB after
three prompts of 2,048 + 2,048 characters, all of it given back by a trim). `return_freed_memory`
asks glibc to give its free heap pages back (`malloc_trim(0)`); elsewhere (macOS, musl, Windows)
it does nothing. The engine trims when it drops a grown pool, and once more after it has been idle
a moment (`engine.IDLE_TRIM_DELAY`), when the requests' callers have freed what they held too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> bool:
    """Give the C heap's free pages back to the system; whether a trim ran (False: no glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
