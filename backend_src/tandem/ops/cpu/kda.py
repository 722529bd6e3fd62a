"""The KDA rows kernel of the decode / verify hot path (numba, float32; conventions of
:mod:`tandem.ops.cpu.kernels`): per sequence, row by row, the causal conv + SiLU, the L2-normalised
q and k, the safe forget gate, the delta-rule recurrence (Kimi Linear, arXiv:2510.26692, eq. 1-2)
and the gated RMSNorm of each head's output, every sequence of a pass in one call. A decode round's
sequences start from rows of the previous pass's buffers, read in place. A head's two state passes
keep their accumulators in registers (:mod:`~tandem.ops.cpu.tile`, head sizes 16, 32, 48, 64 and
128; the same fmas in the same order as the loops other sizes run), so they do not round-trip through
memory on every input element. Reference:
:meth:`tandem.model.kda.LinearAttention.forward_rows` (``tests/test_cpu_kernels.py``)."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from numba import njit

from ..state import KDARows, KDAState
from .kernels import _F, _dot, _exp, np_param, np_rows
from .tile import decay1, decay2, decay3, decay4, decay8, update1, update2, update3, update4, update8


@njit(cache=True, nogil=True, inline="always")
def _beta_step(mem, v, beta):  # pragma: no cover - numba
    # mem <- (v - S'^T k) * beta, between the two state passes
    for j in range(mem.shape[0]):
        mem[j] = (v[j] - mem[j]) * beta


@njit(cache=True, nogil=True, inline="always")
def _state_passes(src, dst, dec, kn, qn, mem, o, v, beta, dk):  # pragma: no cover - numba
    # a head's state passes with their accumulators in registers (tile.py), where dk has them;
    # False: the caller runs them as loops
    if dk == 64:
        decay4(src, dst, dec, kn, mem)
        _beta_step(mem, v, beta)
        update4(dst, kn, qn, mem, o)  # noqa: E702
    elif dk == 128:
        decay8(src, dst, dec, kn, mem)
        _beta_step(mem, v, beta)
        update8(dst, kn, qn, mem, o)  # noqa: E702
    elif dk == 32:
        decay2(src, dst, dec, kn, mem)
        _beta_step(mem, v, beta)
        update2(dst, kn, qn, mem, o)  # noqa: E702
    elif dk == 16:
        decay1(src, dst, dec, kn, mem)
        _beta_step(mem, v, beta)
        update1(dst, kn, qn, mem, o)  # noqa: E702
    elif dk == 48:
        decay3(src, dst, dec, kn, mem)
        _beta_step(mem, v, beta)
        update3(dst, kn, qn, mem, o)  # noqa: E702
    else:
        return False
    return True


@njit(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy")
def _kda_rows(
    mixed, tail, convw, fgate, a_log, dt_bias, lower, blog, gate, onw, eps, S0, qscale, H, dk, full, states, keep, y
):  # pragma: no cover - numba
    # mixed [T, 3C] pre-conv q|k|v; tail [3C, K-1]; convw [K, 3C] (the conv weight transposed: the conv
    # runs along channels, vectorised); fgate [T, C] (f_b output); a_log [H];
    # blog [T, H] beta logits; gate [T, C] output-gate logits; S0 [H, dk, dk] the state before row 0
    # (read only). With keep, row t's state goes to states[t] ([T, H, dk, dk]), else every row's to
    # states[0] (the state after the last row). The state passes run along rows of the state
    # (contiguous, vectorised): decay of the previous state + S'^T k, then update + S^T q, in place
    T, C3 = mixed.shape
    C = C3 // 3
    K = convw.shape[0]
    one, zero = np.float32(1.0), np.float32(0.0)
    win = np.empty((K - 1 + T, C3), np.float32)  # full's columns as rows: the conv reads them along channels
    for c in range(C3):
        for j in range(K - 1):
            v = tail[c, j]
            full[c, j] = v
            win[j, c] = v
        for t in range(T):
            full[c, K - 1 + t] = mixed[t, c]
    for t in range(T):
        for c in range(C3):
            win[K - 1 + t, c] = mixed[t, c]
    act = np.empty(C3, np.float32)
    o, mem = np.empty(dk, np.float32), np.empty(dk, np.float32)
    dec, kn, qn = np.empty(dk, np.float32), np.empty(dk, np.float32), np.empty(dk, np.float32)
    for t in range(T):
        # depthwise causal conv, tap by tap along the channels (contiguous: vectorised), each channel the
        # one chain of fmas over its taps in order (along a channel's strided taps of ``full`` it ran
        # scalar: _kda_many over 8 decode rows took 120 us, now 92, caches warm; bit-identical)
        for c in range(C3):
            act[c] = win[t, c] * convw[0, c]
        for j in range(1, K):
            for c in range(C3):
                act[c] = act[c] + win[t + j, c] * convw[j, c]
        for c in range(C3):  # SiLU (a loop of its own: vectorised)
            act[c] = act[c] / (one + _exp(-act[c]))
        dst = states[t] if keep else states[0]
        src = S0 if t == 0 else (states[t - 1] if keep else states[0])
        for h in range(H):
            q0, k0, v0 = h * dk, C + h * dk, 2 * C + h * dk
            qa, ka = act[q0 : q0 + dk], act[k0 : k0 + dk]
            iq = qscale / np.sqrt(_dot(qa, qa) + np.float32(1e-6))
            ik = one / np.sqrt(_dot(ka, ka) + np.float32(1e-6))
            beta = one / (one + np.exp(-blog[t, h]))
            a_exp = np.exp(a_log[h])
            for i in range(dk):  # (loops of one output array each: vectorised)
                x = a_exp * (fgate[t, h * dk + i] + dt_bias[h * dk + i])
                dec[i] = _exp(lower / (one + _exp(-x)))
            for i in range(dk):
                kn[i], qn[i] = ka[i] * ik, qa[i] * iq
            Sp, Sh = src[h], dst[h]
            if not _state_passes(
                Sh if t > 0 and not keep else Sp, Sh, dec, kn, qn, mem, o, act[v0 : v0 + dk], beta, dk
            ):
                mem[:] = zero
                for i in range(dk):  # decay the previous state into this row's, then S'^T k
                    d, ki, row = dec[i], kn[i], Sh[i]
                    if t > 0 and not keep:  # in place (src is dst): the same arithmetic on one array, which
                        for j in range(dk):  # LLVM vectorises (it runs a loop scalar when its arrays overlap)
                            s = row[j] * d
                            row[j] = s
                            mem[j] += s * ki
                    else:
                        prev = Sp[i]
                        for j in range(dk):
                            s = prev[j] * d
                            row[j] = s
                            mem[j] += s * ki
                _beta_step(mem, act[v0 : v0 + dk], beta)
                o[:] = zero
                for i in range(dk):  # delta-rule update, S^T q
                    ki, qi, row = kn[i], qn[i], Sh[i]
                    for j in range(dk):
                        s = row[j] + ki * mem[j]
                        row[j] = s
                        o[j] += s * qi
            inv = one / np.sqrt(_dot(o, o) / np.float32(dk) + eps)  # gated RMSNorm of the head output
            for j in range(dk):
                g = gate[t, h * dk + j]
                y[t, h * dk + j] = onw[j] * (o[j] * inv) * (one / (one + _exp(-g)))


@njit(cache=True, nogil=True)
def _kda_many(
    mixed,
    tails,
    t_col,
    convw,
    fgate,
    a_log,
    dt_bias,
    lower,
    blog,
    gate,
    onw,
    eps,
    S0,
    s_idx,
    qscale,
    H,
    dk,
    offs,
    full,
    states,
    keep,
    y,
):  # pragma: no cover - numba
    # convw [K, 3C]: the conv weight transposed (conv_taps); sequence j owns rows offs[j]:offs[j+1], full columns offs[j] + j*(K-1) ..., its conv tail is
    # tails[:, t_col[j]: t_col[j] + K-1] and it starts from S0[s_idx[j]] (both read only); its states go
    # to states[offs[j]:offs[j+1]] (keep) or states[j]
    km1 = convw.shape[0] - 1
    for j in range(offs.shape[0] - 1):
        a, b = offs[j], offs[j + 1]
        f0 = a + j * km1
        _kda_rows(
            mixed[a:b],
            tails[:, t_col[j] : t_col[j] + km1],
            convw,
            fgate[a:b],
            a_log,
            dt_bias,
            lower,
            blog[a:b],
            gate[a:b],
            onw,
            eps,
            S0[s_idx[j]],
            qscale,
            H,
            dk,
            full[:, f0 : f0 + km1 + b - a],
            states[a:b] if keep else states[j : j + 1],
            keep,
            y[a:b],
        )


def conv_taps(conv_w: torch.Tensor) -> np.ndarray:
    """The depthwise conv weight ``[3C, 1, K]`` as :func:`_kda_many` takes it: ``[K, 3C]`` float32,
    C-contiguous (a tap's weights along the channels; a new array, made once per layer's plan)."""
    return np.ascontiguousarray(np_param(conv_w).reshape(conv_w.shape[0], conv_w.shape[-1]).T)


def _shared_states(S0s: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """The sequences' starting states ``S0s[j] [1, H, dk, dk]`` as one array ``[M, H, dk, dk]`` and an
    index per sequence, without a copy when they are all states of one earlier pass (views into its
    shared buffer, :class:`~tandem.model.cache.KDARows`: the steady decode case); else joined."""
    one = S0s[0]
    size = one[0].numel()
    st = one.untyped_storage()
    if all(
        s.dtype == torch.float32
        and s.is_contiguous()
        and s.untyped_storage().data_ptr() == st.data_ptr()
        and s.storage_offset() % size == 0
        for s in S0s
    ):
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
    if (
        one.dtype == torch.float32
        and st.nbytes() == 4 * C3 * W
        and all(
            t.stride() == (C3 * W, W, 1)
            and t.untyped_storage().data_ptr() == st.data_ptr()
            and t.storage_offset() + km1 <= W
            for t in tails
        )
    ):
        base = torch.empty(0, dtype=torch.float32).set_(st, 0, (C3, W))
        return base.numpy(), np.array([t.storage_offset() for t in tails], np.int64)
    return np_rows(torch.cat(tails, 2)[0]), np.arange(0, len(tails) * km1, km1, dtype=np.int64)


def _starts(starts: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The conv tails and states the sequences start from (each a :class:`~tandem.model.cache.KDAState`
    or a ``(tail, S)`` pair) as ``(tails [3C, W], columns [n], S0 [M, H, dk, dk], indices [n])``: the
    previous pass's buffers themselves when every state is a row of one pass (a decode round), else
    :func:`_shared_tails` / :func:`_shared_states` of their tensors."""
    r0 = getattr(starts[0], "rows", None)
    if r0 is not None and all(
        getattr(s, "rows", None) is not None and s.rows.full is r0.full and s.rows.states is r0.states for s in starts
    ):
        return (
            np_rows(r0.full[0]),
            np.array([s.rows.col + s.n_rows for s in starts], np.int64),
            np_rows(r0.states[0]),
            np.array([s.rows.row + s.n_rows - 1 for s in starts], np.int64),
        )
    pairs = [(s.tail, s.S) if isinstance(s, KDAState) else s for s in starts]
    return (*_shared_tails([t for t, _ in pairs]), *_shared_states([S for _, S in pairs]))


def kda_rows_fused(
    mixed: torch.Tensor,
    starts: list,
    conv_w: torch.Tensor,
    fgate: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower: float,
    beta_logits: torch.Tensor,
    gate: torch.Tensor,
    onorm_w: torch.Tensor,
    eps: float,
    heads: int,
    lengths: list[int],
    keep_states: bool = True,
) -> tuple[torch.Tensor, list]:
    """KDA rows of several sequences after their projections, each row by row (the recurrence of
    Kimi Linear, arXiv:2510.26692, eq. 1-2): conv + SiLU, L2-normalised q (scaled ``dk^-1/2``) and k,
    the safe forget gate ``lower * sigmoid(exp(A_log) * (f + dt_bias))``, ``beta = sigmoid(b)``, the
    delta rule, then the gated RMSNorm of each head's output. One call for all sequences.

    Args: ``mixed [1, sum T, 3C]`` (q|k|v projections, ``C = H * dk``; sequence ``j``'s ``lengths[j]``
    rows in turn), ``starts[j]`` its state before its first row (a
    :class:`~tandem.model.cache.KDAState` or a pair ``(tail [1, 3C, K-1], S [1, H, dk, dk])``, read only), ``conv_w [3C, 1, K]``, ``fgate [1, sum T, C]`` (``f_b_proj``
    output), ``A_log [H]``, ``dt_bias [C]``, ``beta_logits [1, sum T, H]``, ``gate [1, sum T, C]``
    (``g_b_proj`` output), ``onorm_w [dk]``. Returns the normed
    output ``[1, sum T, C]`` fp32 and per sequence a :class:`~tandem.model.cache.KDARows` over the
    shared buffers of the pre-conv inputs with the tails and of every row's state (with one sequence:
    its ``[1, 3C, K-1+T]`` and ``[1, T, H, dk, dk]`` exactly) — what
    :meth:`~tandem.model.kda.LinearAttention.forward_rows` computes before ``o_proj``. Without
    ``keep_states`` (a prime: nothing to roll back) per sequence the pair ``(tail [1, 3C, K-1], S [1,
    H, dk, dk])`` after its last row instead."""
    N, C3 = mixed.shape[1], mixed.shape[2]
    C, K = C3 // 3, conv_w.shape[-1]
    dk = C // heads
    offs, full, states, (tl, t_col, S0, s_idx) = kda_buffers(starts, lengths, C3, K, heads, keep_states)
    y = np.empty((N, C), _F)
    _kda_many(
        np_rows(mixed[0]),
        tl,
        t_col,
        conv_taps(conv_w),
        np_rows(fgate[0]),
        np_param(A_log),
        np_param(dt_bias),
        _F(lower),
        np_rows(beta_logits[0]),
        np_rows(gate[0]),
        np_param(onorm_w),
        _F(eps),
        S0,
        s_idx,
        _F(dk**-0.5),
        heads,
        dk,
        offs,
        full,
        states,
        keep_states,
        y,
    )
    return torch.from_numpy(y)[None], kda_results(offs, full, states, K, keep_states)


def kda_buffers(starts: list, lengths: list[int], C3: int, K: int, heads: int, keep_states: bool) -> tuple:
    """What :func:`_kda_many` needs beside the rows, for sequences of ``lengths`` rows starting from
    ``starts`` (see :func:`kda_rows_fused`; ``C3 = 3 * heads * dk`` channels, conv width ``K``):
    ``(offs [n+1], full [C3, sum T + n (K-1)], states [sum T or n, H, dk, dk], (tails, columns, S0,
    indices))``, the last from :func:`_starts` (read only)."""
    N, n, dk = sum(lengths), len(lengths), C3 // 3 // heads
    offs = np.array([0, *itertools.accumulate(lengths)], np.int64)
    full = np.empty((C3, N + n * (K - 1)), _F)
    states = np.empty((N if keep_states else n, heads, dk, dk), _F)
    return offs, full, states, _starts(starts)


def kda_results(offs: np.ndarray, full: np.ndarray, states: np.ndarray, K: int, keep_states: bool) -> list:
    """Per sequence what :func:`kda_rows_fused` returns beside the output, from :func:`kda_buffers`'
    arrays after :func:`_kda_many` filled them."""
    o, n = offs.tolist(), offs.shape[0] - 1
    if not keep_states:
        ends = [o[j + 1] + (j + 1) * (K - 1) for j in range(n)]  # one past sequence j's last full column
        return [
            (torch.from_numpy(full[None, :, e - (K - 1) : e].copy()), torch.from_numpy(states[j : j + 1]))
            for j, e in enumerate(ends)
        ]
    ft, st = torch.from_numpy(full)[None], torch.from_numpy(states)[None]
    return [KDARows(ft, st, K - 1, o[j] + j * (K - 1), o[j]) for j in range(n)]
