"""The bfloat16 dot-product GEMM of the serving path (:func:`~tandem.ops.cpu.gemm._mmp` on weights
packed by :func:`pack_pairs`): the input rows rounded to bfloat16 once (:func:`bf16_pairs`), then
every output element one fixed chain over the input dimension in pairs, ``acc = fma(x[2k+1], w[2k+1,
j], acc); acc = fma(x[2k], w[2k, j], acc)`` from 0, whatever the number of rows: what AVX512-BF16's
``vdpbf16ps`` computes (the tiles of :mod:`~tandem.ops.cpu.tile`, or the same chain emulated with
float32 FMAs on a CPU without it), so a row is bit-identical alone, in a verify block or in a batch of
sessions, as with the float32 tiles. These are the numerics of a bf16 GEMM with float32 accumulation
(what GPU serving stacks run on bf16 checkpoints); every other operation stays float32.

Speed, one thread, AMD EPYC (znver4), ``[M, 256] x [256, 512]`` bf16 weights: M=1 3.7 us (float32
tiles 5.9), M=4 5.7 (11.0), M=8 10.4 (20.8), M=16 19.7 (39.9). The reference is
``tests/test_cpu_tile.py``'s fp32 chain over the bfloat16-rounded inputs.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .tile import TILE, _f32, pair1, pair2, pair3, pair4


@njit(cache=True, nogil=True)
def _pair_tiles(xp, w, out, j):  # pragma: no cover - numba
    # out[:, j:j+64] = bf16 pairs xp [M, D/2] @ one strip w [D/2, 64] of pack_pairs: rows in fours, then the rest
    M = xp.shape[0]
    r = 0
    while r + 4 <= M:
        pair4(xp, w, r, out, j)
        r += 4
    if M - r == 3:
        pair3(xp, w, r, out, j)
    elif M - r == 2:
        pair2(xp, w, r, out, j)
    elif M - r == 1:
        pair1(xp, w, r, out, j)


@njit(cache=True, nogil=True)
def bf16_pairs(x):  # pragma: no cover - numba
    """``x [M, D]`` float32 (D even) rounded to bfloat16 (to nearest, ties to even; NaN stays NaN) as
    ``[M, D/2]`` uint32 pairs: ``x[:, 2k]`` in the low half, ``x[:, 2k+1]`` in the high half."""
    M, D = x.shape
    b = np.ascontiguousarray(x).view(np.uint32)
    h = np.empty((M, D), np.uint16)
    for r in range(M):
        for d in range(D):
            v = b[r, d]
            if (v & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                h[r, d] = np.uint16((v >> np.uint32(16)) | np.uint32(0x40))
            else:
                h[r, d] = np.uint16((v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return h.view(np.uint32)


@njit(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy", boundscheck=False)
def _pair_tail(xp, tail, t0, t1, out, oc):  # pragma: no cover - numba
    # out[:, oc:oc + t1 - t0] = bf16 pairs xp [M, D/2] @ tail[:, t0:t1] (uint16 bfloat16 bits [D, T]): the
    # pair tiles' chain (odd product, then even; exact products, so an fma or a rounded add alike)
    M, K = xp.shape
    n = t1 - t0
    for r in range(M):
        a = out[r, oc : oc + n]
        a[:] = 0.0
        for k in range(K):
            p = xp[r, k]
            xo, xe = _f32(np.uint16(p >> np.uint32(16))), _f32(np.uint16(p & np.uint32(0xFFFF)))
            we, wo = tail[2 * k, t0:t1], tail[2 * k + 1, t0:t1]
            for j in range(n):
                a[j] = (a[j] + xo * _f32(wo[j])) + xe * _f32(we[j])


def pack_pairs(wt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``wt [..., D, O]`` uint16 bfloat16 bits, ``D`` even, packed for the bfloat16 dot-product tiles:
    ``(pairs [..., O // 64, D / 2, 64] uint32, tail [..., D, O % 64] uint16)``, each pair ``wt[2k, j] |
    wt[2k+1, j] << 16`` (``vdpbf16ps``'s operand), a strip one contiguous run as in :func:`pack_strips`."""
    *lead, D, n_out = wt.shape
    S = n_out // TILE
    st = wt[..., : S * TILE].reshape(*lead, D // 2, 2, S, TILE)
    pairs = np.ascontiguousarray(np.moveaxis(st, (-4, -3, -2, -1), (-3, -1, -4, -2)))  # [..., S, D/2, 64, 2]
    return pairs.view(np.uint32).reshape(*lead, S, D // 2, TILE), np.ascontiguousarray(wt[..., S * TILE :])
