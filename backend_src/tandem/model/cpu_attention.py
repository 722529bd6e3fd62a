"""CPU kernel for the MLA / DSA rows of decode and verify, compiled with numba (float32, no autograd).

One call computes, for a few query rows of one sequence over its cache, what
:meth:`tandem.model.mla.MLAttention._heads_out` computes with torch (its reference, and the path for
longer blocks): the DSA indexer's pool scores, the k-pool selection
(:func:`tandem.model.cpu_kernels._dsa_mask`), then per head softmax attention over the selected
tokens only. Each row runs the same float32 operations whatever the number of rows in the call, so
a row's output is bit-identical alone (plain decoding) or inside a verify block.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from .cpu_kernels import _dot, _dsa_mask, np_rows

_F = np.float32


@njit(cache=True, nogil=True, fastmath={"contract"})
def _mla_rows(q, K, V, L, iq, iw, pk, q_pos, kp, k_pools, scaling, q_scale, w_scale, out):  # pragma: no cover - numba
    # q [T, H, dqk]; K [H, cap, dqk] and V [H, cap, dv] the cache buffers, the first L tokens used;
    # iq [T, Hi * di]; iw [T, Hi]; pk [P, di]; q_pos [T] -> out [T, H * dv]
    T, H, dq = q.shape
    dv = V.shape[2]
    Hi, P, di = iw.shape[1], pk.shape[0], pk.shape[1]
    dots = np.empty((T, Hi, P), np.float32)
    for t in range(T):
        for h in range(Hi):
            for p in range(P):
                dots[t, h, p] = _dot(iq[t, h * di: (h + 1) * di], pk[p])
    mask = np.empty((T, L), np.bool_)
    _dsa_mask(dots, iw, q_scale, w_scale, q_pos, kp, k_pools, mask)
    idx = np.empty(L, np.int64)
    s = np.empty(L, np.float32)
    for t in range(T):
        n = 0
        for j in range(L):
            if mask[t, j]:
                idx[n] = j
                n += 1
        for h in range(H):
            mx = -np.inf
            for a in range(n):
                s[a] = _dot(K[h, idx[a]], q[t, h]) * scaling
                mx = max(mx, s[a])
            tot = np.float32(0.0)
            for a in range(n):
                s[a] = np.exp(s[a] - mx)
                tot += s[a]
            o = out[t, h * dv: (h + 1) * dv]
            o[:] = np.float32(0.0)
            for a in range(n):
                w, vj = s[a] / tot, V[h, idx[a]]
                for e in range(dv):
                    o[e] += w * vj[e]


def query_arrays(rows: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The query-side arrays of projected rows (``MLAttention.project`` in the serving layout), once
    for all sequences: ``q [N, H, dqk]``, ``iq [N, Hi * di]``, ``iw [N, Hi]`` (C-contiguous fp32)."""
    return np_rows(rows["q"][0].transpose(0, 1)), np_rows(rows["iq"][0]), np_rows(rows["iw"][0])


def empty_out(rows: dict[str, torch.Tensor]) -> np.ndarray:
    """An uninitialised ``[N, H * dv]`` fp32 output for the rows' heads."""
    _, H, N, dv = rows["v"].shape
    return np.empty((N, H * dv), _F)


def mla_rows_into(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], off: int, n: int, cache, pos0: int, kp: int,
                  k_pools: int, scaling: float, q_scale: float, w_scale: float, out: np.ndarray) -> None:
    """MLA heads' outputs, with DSA selection, of rows ``off .. off + n`` of :func:`query_arrays`: one
    sequence's rows, which its ``cache`` (an :class:`~tandem.model.cache.MLACache`) already holds at
    ``pos0 ..`` (its K / V buffers are read in place). ``kp`` pool size; ``k_pools`` pools kept;
    ``scaling`` the attention scale ``dqk^-1/2``; ``q_scale``, ``w_scale`` the indexer's ``di^-1/2``
    and ``Hi^-1/2``. Writes ``out[off: off + n]`` (``[n, H * dv]`` fp32): softmax attention over the
    visible tokens (the k best complete pools by ``sum_h w_h * relu(iq_h . pk)``, ties toward the
    earlier pool, plus the incomplete tail)."""
    q, iq, iw = arrays
    n_pools = cache.n_pools()
    pk = np.zeros((0, iq.shape[1] // iw.shape[1]), _F) if not n_pools else cache.buffer_np("pk")[0, :n_pools]
    _mla_rows(q[off: off + n], cache.buffer_np("k")[0], cache.buffer_np("v")[0], len(cache), iq[off: off + n],
              iw[off: off + n], pk, np.arange(pos0, pos0 + n, dtype=np.int64), kp, k_pools, _F(scaling), _F(q_scale),
              _F(w_scale), out[off: off + n])
