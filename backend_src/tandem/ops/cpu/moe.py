"""The MoE kernels of the decode / verify hot path (see :mod:`tandem.ops.cpu.kernels`, whose
conventions they share): sigmoid top-k routing, clamped SwiGLU, the weighted combine, and
:func:`moe_rows` around two MKL GEMMs per run of selected experts. Reference:
:meth:`tandem.model.layers.MoE.forward`."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from ..settings import DEFAULT, KernelSettings
from . import gemm
from .gemm import _strips_gemm, _threads
from .kernels import _F, _swiglu_row, np_param


@njit(cache=True, nogil=True)
def _moe_route(logits, bias, top_k, norm, scale, w):  # pragma: no cover - numba
    # logits [N, E] fp32 -> w [N, E+1] (0 for unselected experts, 1 for the shared one, last)
    N, E = logits.shape
    one = np.float32(1.0)
    sc, ch, sel = np.empty(E, np.float32), np.empty(E, np.float32), np.empty(E, np.bool_)
    for r in range(N):
        for e in range(E):
            sc[e] = one / (one + np.exp(-logits[r, e]))
            ch[e] = sc[e] + bias[e]
            w[r, e] = np.float32(0.0)
            sel[e] = False
        tot = np.float32(0.0)
        for _ in range(top_k):  # the best remaining choice; ties go to the lower expert id
            best = -1
            for e in range(E):
                if not sel[e] and (best < 0 or ch[e] > ch[best]):
                    best = e
            sel[best] = True
            w[r, best] = sc[best]
            tot += sc[best]
        for e in range(E):
            if norm:
                w[r, e] = w[r, e] / (tot + np.float32(1e-20))
            w[r, e] = w[r, e] * scale
        w[r, E] = one


@njit(cache=True, nogil=True)
def _moe_act(gu, limit, act):  # pragma: no cover - numba
    # gu [N, n * 2I] (n experts' gate | up) -> clamped SwiGLU act [n, N, I]
    n, N, n_inter = act.shape
    one = np.float32(1.0)
    for e in range(n):
        for r in range(N):
            for i in range(n_inter):
                g = min(gu[r, e * 2 * n_inter + i], limit)
                u = min(max(gu[r, e * 2 * n_inter + n_inter + i], -limit), limit)
                act[e, r, i] = g / (one + np.exp(-g)) * u


@njit(cache=True, nogil=True)
def _moe_combine(h, w, out):  # pragma: no cover - numba
    # out[r] += sum_e w[r, e] h[e, r] over the nonzero weights, experts in order
    E1, N, D = h.shape
    for r in range(N):
        for d in range(D):
            acc = out[r, d]
            for e in range(E1):
                if w[r, e] != np.float32(0.0):
                    acc += w[r, e] * h[e, r, d]
            out[r, d] = acc


@njit(cache=True, nogil=True, error_model="numpy")
def _scratch(x, down):  # pragma: no cover - numba
    # an expert's buffers for _expert: the gathered rows [N, D], gate | up [N, 2I], the activation [N, I]
    N, D = x.shape
    n_inter = down[1].shape[1]
    return np.empty((N, D), _F), np.empty((N, 2 * n_inter), _F), np.empty((N, n_inter), _F)


@njit(cache=True, nogil=True, error_model="numpy")
def _expert(x, w, e, up, down, limit, h, xs, gu, act):  # pragma: no cover - numba
    # expert e on the rows that selected it (w[r, e] != 0), in row order: gate | up GEMM, clamped SwiGLU,
    # down GEMM into h[:n] (n of them, returned), one thread (_strips_gemm: _mmp's body without the split);
    # xs, gu, act: _scratch's buffers
    N, D = x.shape
    n_inter = act.shape[1]
    n = 0
    for r in range(N):
        if w[r, e] != np.float32(0.0):
            xs[n] = x[r]
            n += 1
    if n > 0:
        _strips_gemm(xs[:n], up[0][e], up[1][e], 0, 2 * n_inter, gu[:n])
        for j in range(n):  # gate | up of a row: contiguous halves (vectorised; strided [n, I] views ran scalar)
            _swiglu_row(gu[j, :n_inter], gu[j, n_inter:], limit, act[j])
        _strips_gemm(act[:n], down[0][e], down[1][e], 0, D, h[:n])
    return n


@njit(cache=True, nogil=True, parallel=True)
def _experts_split(x, w, up, down, limit, owner, n_threads, hs):  # pragma: no cover - numba
    # _expert of every expert into hs[e], expert e on thread owner[e]
    for t in prange(n_threads):
        xs, gu, act = _scratch(x, down)
        for e in range(owner.shape[0]):
            if owner[e] == t:
                _expert(x, w, e, up, down, limit, hs[e], xs, gu, act)


@njit(cache=True, nogil=True, error_model="numpy")
def _moe_sparse(x, w, up, down, limit, out):  # pragma: no cover - numba
    # each expert e on the rows that selected it (w[r, e] != 0): gate | up GEMM, clamped SwiGLU, down GEMM
    # (row-invariant), then out[r] += w[r, e] * h in expert order; out [N, D] zeros; up and down strip-packed
    # per expert (kernel_weight: [E+1, D, 2I] and [E+1, I, D]). With numba's threads for this thread above one
    # (groups.kernel_threads) and two rows or more, the experts run across the threads, each expert's rows on
    # one (the largest first, to the least loaded thread), then the same combine: the same bits
    N, D = x.shape
    E1 = down[1].shape[0]
    hs = np.empty((E1, N, D), _F)
    T = min(_threads(), E1)
    if T > 1 and N > 1:
        rows = np.zeros(E1, np.int64)
        for e in range(E1):
            for r in range(N):
                if w[r, e] != np.float32(0.0):
                    rows[e] += 1
        owner, load = np.full(E1, -1, np.int64), np.zeros(T, np.int64)
        for e in np.argsort(-rows, kind="mergesort"):
            if rows[e] > 0:
                t = np.argmin(load)
                owner[e], load[t] = t, load[t] + rows[e]
        _experts_split(x, w, up, down, limit, owner, T, hs)
    else:
        xs, gu, act = _scratch(x, down)
        for e in range(E1):
            _expert(x, w, e, up, down, limit, hs[e], xs, gu, act)
    for e in range(E1):
        j = 0
        for r in range(N):
            if w[r, e] != np.float32(0.0):
                for d in range(D):
                    out[r, d] += w[r, e] * hs[e, j, d]
                j += 1


def _runs(used: list[bool]) -> list[list[int]]:
    """``[a, b)`` per run of consecutive True entries (plain Python: ~1 us, numpy's split ~20 us)."""
    runs: list[list[int]] = []
    for e, u in enumerate(used):
        if u and runs and runs[-1][1] == e:
            runs[-1][1] = e + 1
        elif u:
            runs.append([e, e + 1])
    return runs


def moe_rows(
    x: torch.Tensor,
    router_w: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    norm: bool,
    scale: float,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    limit: float,
    invariant: bool = False,
    kernels: KernelSettings = DEFAULT,
) -> torch.Tensor:
    """Sigmoid-routed MoE plus shared expert over a few fp32 rows (:meth:`tandem.model.layers.MoE.forward`
    is the reference). Only the experts some row selects are computed, each run of consecutive ones
    in one GEMM over all rows (a row's weight for an expert it did not select is 0), so a decode row
    reads the top-k experts' weights, not all of them.

    ``x [N, D]``; ``router_w [E, D]``, ``bias [E]`` (DeepSeek-V3 score correction); ``w_up
    [(E+1) * 2I, D]`` (each expert's gate | up rows, the shared expert last; an input-major view);
    ``w_down [E+1, I, D]``. Returns ``[N, D]`` fp32: ``sum_e w_e * down_e(swiglu(gate_e x, up_e x))``
    with the top-k normalised sigmoid weights and weight 1 for the shared expert, summed over the
    selected experts in expert order.

    ``invariant``: each expert runs on only the rows that selected it, with the row-invariant GEMM
    of :mod:`~tandem.ops.cpu.gemm` (a row's output bit-identical for any number of rows; the
    trunk's verify under ``batch_invariant``), on weights packed for ``kernels``."""
    N = x.shape[0]
    E1, n_inter, D = w_down.shape
    w = np.empty((N, E1), _F)
    xn = np.ascontiguousarray(x.numpy())
    logits = (
        gemm.mm_rows(xn, gemm.kernel_weight(router_w, kernels))
        if invariant
        else torch.nn.functional.linear(x, router_w).numpy()
    )
    _moe_route(logits, np_param(bias), top_k, norm, _F(scale), w)
    out = np.zeros((N, D), _F)
    if invariant:
        _moe_sparse(
            xn,
            w,
            gemm.kernel_weight(w_up, kernels, experts=E1),
            gemm.kernel_weight(w_down, kernels, transpose=False),
            _F(limit),
            out,
        )
        return torch.from_numpy(out)
    up = w_up.t()  # [D, (E+1) * 2I], contiguous
    for a, b in _runs(w.any(0).tolist()):
        act = np.empty((b - a, N, n_inter), _F)
        _moe_act(torch.mm(x, up[:, a * 2 * n_inter : b * 2 * n_inter]).numpy(), _F(limit), act)
        _moe_combine(torch.bmm(torch.from_numpy(act), w_down[a:b]).numpy(), w[:, a:b], out)
    return torch.from_numpy(out)
