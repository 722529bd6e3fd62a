"""The threads the CPU serving path runs on: groups of sequences side by side on a pool kept for the process
(the compiled kernels release the GIL, so each group's call runs on a core of its own), and within a call
numba's threads, which the large GEMMs split their columns across (:func:`~tandem.ops.cpu.gemm._mmp`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numba


@contextmanager
def kernel_threads(n: int):
    """Run the block with ``n`` numba threads for this thread (clamped to ``1 .. NUMBA_NUM_THREADS``; a
    thread's own setting, restored after): a compiled call made here splits its large GEMMs' columns across
    them. Nothing else in the process changes."""
    prev = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        numba.set_num_threads(prev)


def run_groups(fn, groups: list, split: int = 1) -> list:
    """``fn(group)`` for each group, the first on this thread and the others on :func:`thread_pool`'s
    threads at once; a group alone runs under :func:`kernel_threads` of ``split`` (the ``split_threads``
    setting), several under one each; their lists of per-sequence results joined in group order. Raises what
    a call raised."""
    n = split if len(groups) == 1 else 1

    def call(g):
        with kernel_threads(n):
            return list(fn(g))

    futures = [thread_pool(len(groups) - 1).submit(call, g) for g in groups[1:]]
    out = call(groups[0])
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
