"""Giving freed memory back to the system in the engine core's process.

A session's caches and a prime's buffers are freed when the session closes, but glibc's allocator keeps
freed heap memory in the arena of the thread that allocated it (the compute thread, the decode pool's
threads each get one), and raises its mmap threshold after large frees so
later large buffers come from those heaps too: the process's resident memory then stays at the high
water mark of every arena, and a flood of short turns leaves it gigabytes above what its open sessions
hold. ``malloc_trim(0)`` returns the free pages of every arena to the system (``madvise(MADV_DONTNEED)``
on whole free pages); :class:`Trimmer` calls it after sessions close, at most once per ``every_s``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

_libc = None


def malloc_trim() -> bool:
    """Return the free heap pages of every malloc arena to the system (glibc ``malloc_trim(0)``, the GIL
    released meanwhile). Returns whether memory was released; False where glibc is absent."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes, _libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _libc = False
    return bool(_libc and _libc.malloc_trim(0))


class Trimmer:
    """Calls :func:`malloc_trim` after a request that closed sessions (:meth:`closed`), at most once per
    ``every_s`` seconds; a close within ``every_s`` of the last trim is trimmed after the next request
    that finds the interval over (:meth:`after_request`), so the last closes of a flood are trimmed too."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self._last = 0.0
        self._due = False
        #: trims done (for tests and the log)
        self.trims = 0

    def closed(self) -> None:
        """Sessions were closed: their memory is free in the allocator."""
        self._due = True

    def after_request(self) -> bool:
        """Trim when a close is pending and ``every_s`` has passed since the last trim. Returns whether it trimmed."""
        now = time.monotonic()
        if not self._due or now - self._last < self.every_s:
            return False
        self._due, self._last = False, now
        malloc_trim()
        self.trims += 1
        return True
