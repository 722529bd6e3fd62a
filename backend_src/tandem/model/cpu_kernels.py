"""CPU kernels for the decode / verify hot path, compiled with numba (no autograd; float32).

On this CPU a torch op costs 3-5 us of dispatch whatever its size, and a decode row of the tiny
trunk is a few hundred such ops: the per-row glue between the matrix products (mHC weights with
their Sinkhorn loop and the block norm, the mHC merge, the KDA conv / gates / recurrence / output
norm, MoE routing / SwiGLU / combine (in :mod:`~tandem.model.cpu_moe`), DSA pool selection) is fused into one call each. Every
kernel has a pure-torch reference it is tested against (``tests/test_cpu_kernels.py``):
:meth:`~tandem.model.layers.HyperConnection.forward` + RMSNorm, :func:`~tandem.model.layers.hc_merge`,
:meth:`~tandem.model.kda.LinearAttention.forward_rows`, :meth:`~tandem.model.layers.MoE.forward`,
:meth:`~tandem.model.mla.Indexer.select`; :func:`reference` runs the model on them.

Each row is computed by the same sequence of float32 operations whatever the number of rows in the
call, so a row's result is bit-identical alone (plain decoding) or inside a verify block.
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import torch
from numba import njit
from tandem_kernels import dispatch

from .cache import KDARows

_F = np.float32

#: serving code takes these kernels when autograd is off; :func:`reference` turns them off
ENABLED = True


def active(t: torch.Tensor | None = None) -> bool:
    """True when the serving hot path should call these kernels: enabled, autograd off, the Triton
    kernels not forced (:func:`tandem_kernels.dispatch.numba_allowed`) and, when given, ``t`` on the CPU."""
    return ENABLED and not torch.is_grad_enabled() and dispatch.numba_allowed() and (t is None or t.is_cpu)


@contextlib.contextmanager
def reference():
    """Within this block the model runs its pure-torch reference code (tests, A/B benches)."""
    global ENABLED
    old, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = old


_PARAMS: dict[int, tuple[int, np.ndarray, torch.Tensor]] = {}


def np_param(p: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous numpy array of a weight, made once per storage (a view when the weight
    already is fp32 and contiguous, so in-place loads show through; a copy otherwise)."""
    hit = _PARAMS.get(id(p))
    if hit is not None and hit[2] is p and hit[0] == p.data_ptr():
        return hit[1]
    a = p.detach().float().contiguous().numpy()
    _PARAMS[id(p)] = (p.data_ptr(), a, p)
    return a


def np_rows(t: torch.Tensor) -> np.ndarray:
    """Activations as a float32 C-contiguous numpy array (no copy when they already are)."""
    if t.dtype != torch.float32:
        t = t.float()
    return (t if t.is_contiguous() else t.contiguous()).numpy()


@njit(cache=True, nogil=True, inline="always")
def _dot(a, b):  # pragma: no cover - numba
    # sum_j a[j] * b[j] over eight interleaved partial sums combined in a fixed order (eight
    # independent chains instead of one serial one; the same order for a row in any batch)
    n = a.shape[0]
    z = np.float32(0.0)
    s0, s1, s2, s3, s4, s5, s6, s7 = z, z, z, z, z, z, z, z
    for j in range(0, n - n % 8, 8):
        s0 += a[j] * b[j]
        s1 += a[j + 1] * b[j + 1]
        s2 += a[j + 2] * b[j + 2]
        s3 += a[j + 3] * b[j + 3]
        s4 += a[j + 4] * b[j + 4]
        s5 += a[j + 5] * b[j + 5]
        s6 += a[j + 6] * b[j + 6]
        s7 += a[j + 7] * b[j + 7]
    acc = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
    for j in range(n - n % 8, n):
        acc += a[j] * b[j]
    return acc


@njit(cache=True, nogil=True)
def _hc_weights(streams, fn, base, scale, n, iters, eps, norm_eps, nw, nw_eps, post, comb, collapsed):  # pragma: no cover - numba
    M, ND = streams.shape
    D = ND // n
    n_mix = fn.shape[0]
    mix = np.empty(n_mix, np.float32)
    one = np.float32(1.0)
    for r in range(M):
        x = streams[r]
        inv = one / np.sqrt(_dot(x, x) / np.float32(ND) + norm_eps)
        for o in range(n_mix):
            mix[o] = _dot(x, fn[o]) * inv
        col = collapsed[r]
        for i in range(n):
            pre = one / (one + np.exp(-(mix[i] * scale[0] + base[i]))) + eps
            post[r, i] = np.float32(2.0) / (one + np.exp(-(mix[n + i] * scale[1] + base[n + i])))
            for d in range(D):
                if i == 0:
                    col[d] = pre * x[d]
                else:
                    col[d] += pre * x[i * D + d]
        inv = one / np.sqrt(_dot(col, col) / np.float32(D) + nw_eps)  # the block's input RMSNorm
        for d in range(D):
            col[d] = nw[d] * (col[d] * inv)
        c = comb[r]
        for i in range(n):  # softmax over each row of the n x n logits, + eps
            mx = -np.inf
            for j in range(n):
                v = mix[2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j]
                c[i, j] = v
                mx = max(mx, v)
            s = np.float32(0.0)
            for j in range(n):
                c[i, j] = np.exp(c[i, j] - mx)
                s += c[i, j]
            for j in range(n):
                c[i, j] = c[i, j] / s + eps
        for it in range(2 * iters - 1):  # column step, then (iters - 1) x (row step, column step)
            for a in range(n):
                s = np.float32(0.0)
                for b in range(n):
                    s += c[b, a] if it % 2 == 0 else c[a, b]
                s += eps
                for b in range(n):
                    if it % 2 == 0:
                        c[b, a] = c[b, a] / s
                    else:
                        c[a, b] = c[a, b] / s


def hc_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               iters: int, eps: float, norm_eps: float, norm_w: torch.Tensor, norm_w_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC weights of rows ``streams [B, T, N, D]`` (any float dtype): ``post [B,T,N]`` and
    ``comb [B,T,N,N]`` fp32, and the block's RMSNorm (weight ``norm_w [D]``, eps ``norm_w_eps``) of
    the collapsed block input, ``[B, T, D]`` in the streams' dtype.

    The math of :meth:`tandem.model.layers.HyperConnection.forward` (RMS-normalised streams, the
    ``fn [(2+N)N, N*D]`` mixing, sigmoid / softmax heads, Sinkhorn-Knopp) in one pass per row."""
    b, t, n, d = streams.shape
    s = np_rows(streams.reshape(b * t, n * d))
    post = np.empty((b * t, n), _F)
    comb = np.empty((b * t, n, n), _F)
    col = np.empty((b * t, d), _F)
    _hc_weights(s, np_param(fn), np_param(base), np_param(scale), n, iters, _F(eps), _F(norm_eps),
                np_param(norm_w), _F(norm_w_eps), post, comb, col)
    return (torch.from_numpy(post).view(b, t, n), torch.from_numpy(comb).view(b, t, n, n),
            torch.from_numpy(col).view(b, t, d).to(streams.dtype))


@njit(cache=True, nogil=True, fastmath={"contract"})
def _kda_rows(mixed, tail, convw, fgate, a_log, dt_bias, lower, blog, gate, onw, eps, S0, qscale,
              H, dk, full, states, keep, y):  # pragma: no cover - numba
    # mixed [T, 3C] pre-conv q|k|v; tail [3C, K-1]; convw [3C, K]; fgate [T, C] (f_b output); a_log [H];
    # blog [T, H] beta logits; gate [T, C] output-gate logits; S0 [H, dk, dk] the state before row 0
    # (read only). With keep, row t's state goes to states[t] ([T, H, dk, dk]), else every row's to
    # states[0] (the state after the last row). The state passes run along rows of the state
    # (contiguous, vectorised): decay of the previous state + S'^T k, then update + S^T q, in place
    T, C3 = mixed.shape
    C = C3 // 3
    K = convw.shape[1]
    one, zero = np.float32(1.0), np.float32(0.0)
    for c in range(C3):
        for j in range(K - 1):
            full[c, j] = tail[c, j]
        for t in range(T):
            full[c, K - 1 + t] = mixed[t, c]
    act = np.empty(C3, np.float32)
    o, mem = np.empty(dk, np.float32), np.empty(dk, np.float32)
    dec, kn, qn = np.empty(dk, np.float32), np.empty(dk, np.float32), np.empty(dk, np.float32)
    for t in range(T):
        for c in range(C3):  # depthwise causal conv + SiLU
            acc = full[c, t] * convw[c, 0]
            for j in range(1, K):
                acc = acc + full[c, t + j] * convw[c, j]
            act[c] = acc / (one + np.exp(-acc))
        dst = states[t] if keep else states[0]
        src = S0 if t == 0 else (states[t - 1] if keep else states[0])
        for h in range(H):
            q0, k0, v0 = h * dk, C + h * dk, 2 * C + h * dk
            qa, ka = act[q0: q0 + dk], act[k0: k0 + dk]
            iq = qscale / np.sqrt(_dot(qa, qa) + np.float32(1e-6))
            ik = one / np.sqrt(_dot(ka, ka) + np.float32(1e-6))
            beta = one / (one + np.exp(-blog[t, h]))
            a_exp = np.exp(a_log[h])
            for i in range(dk):
                x = a_exp * (fgate[t, h * dk + i] + dt_bias[h * dk + i])
                dec[i] = np.exp(lower / (one + np.exp(-x)))
                kn[i], qn[i] = ka[i] * ik, qa[i] * iq
                mem[i], o[i] = zero, zero
            Sp, Sh = src[h], dst[h]
            for i in range(dk):  # decay the previous state into this row's, then S'^T k
                d, ki, prev, row = dec[i], kn[i], Sp[i], Sh[i]
                for j in range(dk):
                    s = prev[j] * d
                    row[j] = s
                    mem[j] += s * ki
            for j in range(dk):
                mem[j] = (act[v0 + j] - mem[j]) * beta
            for i in range(dk):  # delta-rule update, S^T q
                ki, qi, row = kn[i], qn[i], Sh[i]
                for j in range(dk):
                    s = row[j] + ki * mem[j]
                    row[j] = s
                    o[j] += s * qi
            inv = one / np.sqrt(_dot(o, o) / np.float32(dk) + eps)  # gated RMSNorm of the head output
            for j in range(dk):
                g = gate[t, h * dk + j]
                y[t, h * dk + j] = onw[j] * (o[j] * inv) * (one / (one + np.exp(-g)))


@njit(cache=True, nogil=True)
def _kda_many(mixed, tails, t_col, convw, fgate, a_log, dt_bias, lower, blog, gate, onw, eps, S0, s_idx, qscale, H,
              dk, offs, full, states, keep, y):  # pragma: no cover - numba
    # sequence j owns rows offs[j]:offs[j+1], full columns offs[j] + j*(K-1) ..., its conv tail is
    # tails[:, t_col[j]: t_col[j] + K-1] and it starts from S0[s_idx[j]] (both read only); its states go
    # to states[offs[j]:offs[j+1]] (keep) or states[j]
    km1 = convw.shape[1] - 1
    for j in range(offs.shape[0] - 1):
        a, b = offs[j], offs[j + 1]
        f0 = a + j * km1
        _kda_rows(mixed[a:b], tails[:, t_col[j]: t_col[j] + km1], convw, fgate[a:b], a_log, dt_bias, lower, blog[a:b], gate[a:b], onw, eps,
                  S0[s_idx[j]], qscale, H, dk, full[:, f0: f0 + km1 + b - a], states[a:b] if keep else states[j: j + 1],
                  keep, y[a:b])


def _shared_states(S0s: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """The sequences' starting states ``S0s[j] [1, H, dk, dk]`` as one array ``[M, H, dk, dk]`` and an
    index per sequence, without a copy when they are all states of one earlier pass (views into its
    shared buffer, :class:`~tandem.model.cache.KDARows`: the steady decode case); else joined."""
    one = S0s[0]
    size = one[0].numel()
    st = one.untyped_storage()
    if all(s.dtype == torch.float32 and s.is_contiguous() and s.untyped_storage().data_ptr() == st.data_ptr()
           and s.storage_offset() % size == 0 for s in S0s):
        base = torch.empty(0, dtype=torch.float32).set_(st, 0, (st.nbytes() // 4 // size, *one.shape[1:]))
        return base.numpy(), np.array([s.storage_offset() // size for s in S0s], np.int64)
    return np_rows(torch.cat(S0s) if len(S0s) > 1 else S0s[0]), np.arange(len(S0s), dtype=np.int64)


def _shared_tails(tails: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """The sequences' conv tails ``tails[j] [1, 3C, K-1]`` as one array ``[3C, W]`` and a starting
    column per sequence, without a copy when they are all columns of one earlier pass's pre-conv
    buffer (:class:`~tandem.model.cache.KDARows`); else joined (``W = n (K-1)``)."""
    one = tails[0]
    _, C3, km1 = one.shape
    W = one.stride(1)
    st = one.untyped_storage()
    if (one.dtype == torch.float32 and st.nbytes() == 4 * C3 * W and
            all(t.stride() == (C3 * W, W, 1) and t.untyped_storage().data_ptr() == st.data_ptr()
                and t.storage_offset() + km1 <= W for t in tails)):
        base = torch.empty(0, dtype=torch.float32).set_(st, 0, (C3, W))
        return base.numpy(), np.array([t.storage_offset() for t in tails], np.int64)
    return np_rows(torch.cat(tails, 2)[0]), np.arange(0, len(tails) * km1, km1, dtype=np.int64)


def kda_rows_fused(mixed: torch.Tensor, tails: list[torch.Tensor], conv_w: torch.Tensor, fgate: torch.Tensor,
                   A_log: torch.Tensor, dt_bias: torch.Tensor, lower: float, beta_logits: torch.Tensor,
                   gate: torch.Tensor, onorm_w: torch.Tensor, eps: float, S0s: list[torch.Tensor], heads: int,
                   lengths: list[int], keep_states: bool = True) -> tuple[torch.Tensor, list]:
    """KDA rows of several sequences after their projections, each row by row (the recurrence of
    Kimi Linear, arXiv:2510.26692, eq. 1-2): conv + SiLU, L2-normalised q (scaled ``dk^-1/2``) and k,
    the safe forget gate ``lower * sigmoid(exp(A_log) * (f + dt_bias))``, ``beta = sigmoid(b)``, the
    delta rule, then the gated RMSNorm of each head's output. One call for all sequences.

    Args: ``mixed [1, sum T, 3C]`` (q|k|v projections, ``C = H * dk``; sequence ``j``'s ``lengths[j]``
    rows in turn), ``tails[j] [1, 3C, K-1]``, ``conv_w [3C, 1, K]``, ``fgate [1, sum T, C]`` (``f_b_proj``
    output), ``A_log [H]``, ``dt_bias [C]``, ``beta_logits [1, sum T, H]``, ``gate [1, sum T, C]``
    (``g_b_proj`` output), ``onorm_w [dk]``, ``S0s[j] [1, H, dk, dk]`` (not modified). Returns the normed
    output ``[1, sum T, C]`` fp32 and per sequence a :class:`~tandem.model.cache.KDARows` over the
    shared buffers of the pre-conv inputs with the tails and of every row's state (with one sequence:
    its ``[1, 3C, K-1+T]`` and ``[1, T, H, dk, dk]`` exactly) — what
    :meth:`~tandem.model.kda.LinearAttention.forward_rows` computes before ``o_proj``. Without
    ``keep_states`` (a prime: nothing to roll back) per sequence the pair ``(tail [1, 3C, K-1], S [1,
    H, dk, dk])`` after its last row instead."""
    N, C3 = mixed.shape[1], mixed.shape[2]
    C, K = C3 // 3, conv_w.shape[-1]
    dk, n = C // heads, len(lengths)
    offs = np.array([0, *itertools.accumulate(lengths)], np.int64)
    full = np.empty((C3, N + n * (K - 1)), _F)
    states = np.empty((N if keep_states else n, heads, dk, dk), _F)
    y = np.empty((N, C), _F)
    S0, s_idx = _shared_states(S0s)  # read only: every row's state is written to ``states``
    tl, t_col = _shared_tails(tails)
    _kda_many(np_rows(mixed[0]), tl, t_col, np_param(conv_w).reshape(C3, K), np_rows(fgate[0]), np_param(A_log),
              np_param(dt_bias), _F(lower), np_rows(beta_logits[0]), np_rows(gate[0]), np_param(onorm_w), _F(eps), S0,
              s_idx, _F(dk ** -0.5), heads, dk, offs, full, states, keep_states, y)
    o = offs.tolist()
    if not keep_states:
        ends = [o[j + 1] + (j + 1) * (K - 1) for j in range(n)]  # one past sequence j's last full column
        return torch.from_numpy(y)[None], [(torch.from_numpy(full[None, :, e - (K - 1): e].copy()), torch.from_numpy(states[j: j + 1]))
                                          for j, e in enumerate(ends)]
    ft, st = torch.from_numpy(full)[None], torch.from_numpy(states)[None]
    return torch.from_numpy(y)[None], [KDARows(ft, st, K - 1, o[j] + j * (K - 1), o[j]) for j in range(n)]


@njit(cache=True, nogil=True)
def _hc_merge(post, comb, block, residual, out):  # pragma: no cover - numba
    M, n, D = residual.shape
    for r in range(M):
        for i in range(n):
            p = post[r, i]
            for d in range(D):
                acc = p * block[r, d]
                for m in range(n):
                    acc += comb[r, m, i] * residual[r, m, d]
                out[r, i, d] = acc


def hc_merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """:func:`tandem.model.layers.hc_merge` for fp32 rows: ``post ⊗ block_out + comb^T @ residual``.
    ``post [B,T,N]``, ``comb [B,T,N,N]``, ``block_out [B,T,D]``, ``residual [B,T,N,D]`` -> ``[B,T,N,D]``."""
    b, t, n, d = residual.shape
    out = np.empty((b * t, n, d), _F)
    _hc_merge(np_rows(post.reshape(b * t, n)), np_rows(comb.reshape(b * t, n, n)), np_rows(block_out.reshape(b * t, d)),
              np_rows(residual.reshape(b * t, n, d)), out)
    return torch.from_numpy(out).view(b, t, n, d)


@njit(cache=True, nogil=True)
def _dsa_mask(dots, w, sq, sw, q_pos, kp, k_pools, mask):  # pragma: no cover - numba
    T, H, P = dots.shape
    L = mask.shape[1]
    score = np.empty(P, np.float32)
    for t in range(T):
        for j in range(L):
            mask[t, j] = False
        n_c = min((q_pos[t] + 1) // kp, P)  # complete pools ending at or before the query
        for p in range(n_c):
            acc = np.float32(0.0)
            for h in range(H):
                acc += (w[t, h] * sw) * max(dots[t, h, p] * sq, np.float32(0.0))
            score[p] = acc
        if n_c <= k_pools:
            chosen = np.arange(n_c)
        else:  # the k best, ties toward the earlier pool (a stable sort of -score)
            chosen = np.argsort(-score[:n_c], kind="mergesort")[:k_pools]
        for c in chosen:
            for j in range(c * kp, (c + 1) * kp):
                mask[t, j] = True
        for j in range(((q_pos[t] + 1) // kp) * kp, min(q_pos[t] + 1, L)):  # the incomplete tail
            mask[t, j] = True


def dsa_mask(dots: torch.Tensor, weights: torch.Tensor, q_pos: torch.Tensor, kv_len: int, kp: int,
             k_pools: int, q_scale: float, w_scale: float) -> torch.Tensor:
    """DSA k-pool selection of one sequence (:meth:`tandem.model.mla.Indexer.select` over
    :meth:`~tandem.model.mla.Indexer.scores`, the reference): pool score
    ``sum_h (w_h * w_scale) * relu(dot_hp * q_scale)``, the ``k_pools`` best complete pools, ties
    toward the earlier one, plus the incomplete tail. ``dots [1, T, H, P]`` = indexer queries · pool
    keys (unscaled), ``weights [1, T, H]`` (``weights_proj`` output), ``q_pos [T]`` absolute positions.
    Returns the visibility mask ``[1, T, kv_len]`` bool."""
    _, T, H, P = dots.shape
    mask = np.empty((T, kv_len), np.bool_)
    _dsa_mask(np_rows(dots[0]), np_rows(weights[0]), _F(q_scale),
              _F(w_scale), q_pos.numpy(), kp, k_pools, mask)
    return torch.from_numpy(mask)[None]

