"""Giving the C heap's freed memory back to the OS after a big refused message (glibc's
malloc_trim), so that refusals cannot ratchet the server's RSS up.

Why it is needed: glibc raises its mmap threshold to the size of the largest block freed so far
(up to 32 MiB). After the first 3.5 MB message, the next ones' buffers (the envelope being read,
the payload) come from the heap instead of their own mappings, and once freed they stay there as
free heap that a small block above them keeps from being trimmed: 30 refused 3.5 MB Registers
left 10 MB free inside a 20 MB heap (mallinfo2), RSS 56 -> 68.7 MB (issue 41). malloc_trim(0)
hands such free pages back; it took 0.07 ms over a 40 MB heap and runs once per refused message of
TRIM_AFTER bytes or more, which cost its sender at least that much upload.

Elsewhere (musl, macOS) there is no malloc_trim and this does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

TRIM_AFTER = 1 << 20  # a refused message this big is worth a trim


def _find_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_trim = _find_trim()


def give_back(size: int) -> bool:
    """After refusing a message of `size` bytes, once it is dropped: return the heap's free pages
    to the OS when it was big. True when a trim ran."""
    if size < TRIM_AFTER or _trim is None:
        return False
    _trim(0)
    return True
