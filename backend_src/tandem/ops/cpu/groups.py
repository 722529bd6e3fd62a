"""The threads the CPU serving path runs groups of sequences on side by side: a pool kept for the process (the
compiled kernels release the GIL, so each group's call runs on a core of its own)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def run_groups(fn, groups: list) -> list:
    """``fn(group)`` for each group, the first on this thread and the others on :func:`thread_pool`'s
    threads at once; their lists of per-sequence results joined in group order. Raises what a call raised."""
    futures = [thread_pool(len(groups) - 1).submit(fn, g) for g in groups[1:]]
    out = list(fn(groups[0]))
    for f in futures:
        out += f.result()
    return out


_POOL: list = [None, 0, None]  # the pool, its threads, what each runs first


def thread_pool(n: int) -> ThreadPoolExecutor:
    """A pool of ``n`` threads at least, kept for the process (the decode groups' and the prime groups'
    threads, :meth:`~tandem.model.trunk.Trunk.prime_many`); each thread first runs :func:`set_pool_initializer`'s."""
    if _POOL[1] < n:
        if _POOL[0] is not None:
            _POOL[0].shutdown(wait=False)
        _POOL[0], _POOL[1] = ThreadPoolExecutor(max(n, 1), thread_name_prefix="tandem-decode", initializer=_POOL[2]), n
    return _POOL[0]


def set_pool_initializer(fn) -> None:
    """``fn()`` runs first on every thread of :func:`thread_pool` from now on (the served trunk sets its compute
    threads' priority: :func:`tandem.serving.process.set_thread_nice`); the threads made before go."""
    _POOL[2] = fn
    if _POOL[0] is not None:
        _POOL[0].shutdown(wait=False)
        _POOL[0], _POOL[1] = None, 0
