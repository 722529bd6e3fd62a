"""The DFlash / DFlash2 drafter's round in one numba call on the CPU serving path (fp32 rows, row-invariant GEMMs).

Through the torch modules (:class:`~tandem.model.dflash.DFlashDrafter`) a round of one sequence runs about sixty
small torch ops around a handful of GEMMs: the ingest of the rows the trunk committed (``fc``, ``hidden_norm``,
every layer's context keys and values), the block forward and the LM head over the drafted rows. Here one compiled
function runs all of it for one sequence: the ingest appends the new rows' keys and values in place to the
sequence's context buffers (:class:`ContextKV`), then the block ``[anchor, MASK x k]`` goes through every drafter
layer (RMSNorms, the two-tap convolutions of DFlash2, the projections, per-head q / k RMSNorm, RoPE, attention over
``[context, block]``, clamped SwiGLU), the final norm, the trunk's LM head on the ``k`` drafted rows, and the argmax
(DFlash) or DFlash2's top-``K`` candidates and the selector's greedy path.

The GEMMs, norms, SwiGLU and RoPE tables are the torch path's own kernels and values (the same row-invariant GEMM on
the same packed weights, :func:`~tandem.ops.cpu.kernels._rms`, RoPE's cosines and sines computed by
:func:`tandem.model.dflash.rope`'s arithmetic); the attention's softmax and the selector's dot products sum in
their own order, so the hidden rows agree with the torch path to float32 rounding and the drafts agree but for near
ties (``tests/test_cpu_dflash.py``). Drafts only steer speculation: the verify pass decides every emitted token.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
from numba import njit

from ..state import ContextKV
from .block import _gemm
from .gemm import _mmp, cols, kernel_weight
from .kernels import _F, _exp, _rms, _swiglu, compiled_call, np_param, typed_list

_NO_CONV = np.zeros((4, 0, 1), _F)  # DFlash: no convolutions (a DFlash2 layer's are [4, taps, D])


@njit(cache=True, nogil=True)
def _norm(x, w, eps):  # pragma: no cover - numba
    out = np.empty_like(x)
    _rms(x, w, eps, out)
    return out


@njit(cache=True, nogil=True)
def _conv(x, taps):  # pragma: no cover - numba
    # y_t = sum_j taps[j] * x_{t-j} along the block rows x [B, D] (x_{<0} = 0): TwoTapConv's order of terms
    if taps.shape[0] == 0:
        return x
    B, D = x.shape
    y = np.empty_like(x)
    for t in range(B):
        for c in range(D):
            a = x[t, c] * taps[0, c]
            for j in range(1, taps.shape[0]):
                a = a + (x[t - j, c] * taps[j, c] if t >= j else _F(0.0) * taps[j, c])
            y[t, c] = a
    return y


@njit(cache=True, nogil=True)
def _heads(x, H, d, w, eps, cos_t, sin_t, pos0):  # pragma: no cover - numba
    # x [T, H*d] -> per head RMSNorm (weight w [d]) then RoPE at positions pos0 + t: [H, T, d]
    T = x.shape[0]
    normed = np.empty((T * H, d), _F)
    _rms(np.ascontiguousarray(x).reshape(T * H, d), w, eps, normed)
    out = np.empty((H, T, d), _F)
    half = d // 2
    for t in range(T):
        c, s = cos_t[pos0 + t], sin_t[pos0 + t]
        for h in range(H):
            r = normed[t * H + h]
            for j in range(half):
                out[h, t, j] = r[j] * c[j] + (-r[j + half]) * s[j]
            for j in range(half, d):
                out[h, t, j] = r[j] * c[j] + r[j - half] * s[j]
    return out


@njit(cache=True, nogil=True)
def _attend(q, kb, vb, kc, vc, C, scale):  # pragma: no cover - numba
    # q, kb, vb [H, B, d] the block's; kc, vc [H, cap, d] the context's first C rows: every query attends to all
    # C + B keys (no mask) -> [B, H*d]
    H, B, d = q.shape
    out = np.zeros((B, H * d), _F)
    sc = np.empty(C + B, _F)
    for h in range(H):
        for i in range(B):
            m = _F(-np.inf)
            for j in range(C + B):
                kr = kc[h, j] if j < C else kb[h, j - C]
                a = _F(0.0)
                for e in range(d):
                    a += q[h, i, e] * kr[e]
                a *= scale
                sc[j] = a
                m = max(m, a)
            tot = _F(0.0)
            for j in range(C + B):
                sc[j] = _exp(sc[j] - m)
                tot += sc[j]
            o = out[i, h * d : (h + 1) * d]
            for j in range(C + B):
                vr = vc[h, j] if j < C else vb[h, j - C]
                p = sc[j] / tot
                for e in range(d):
                    o[e] += p * vr[e]
    return out


@njit(cache=True, nogil=True)
def _top_k(row, K):  # pragma: no cover - numba
    # the ids of the K largest values of row [V], largest first (ties: the lower id first), in one pass
    ids, vals = np.full(K, -1, np.int64), np.full(K, -np.inf, _F)
    for c in range(row.shape[0]):
        v = row[c]
        if v > vals[K - 1]:
            j = K - 1
            while j > 0 and v > vals[j - 1]:
                vals[j], ids[j] = vals[j - 1], ids[j - 1]
                j -= 1
            vals[j], ids[j] = v, c
    return ids


@njit(cache=True, nogil=True)
def _round(w, layers, feats, rows, anchor, k, embed, kbufs, vbufs, rope, out, out_h):  # pragma: no cover - numba
    # ingest feats [n, F] at positions rows .. rows+n-1 into every layer's context kbufs[l] / vbufs[l] [H, cap, d],
    # then draft k tokens after `anchor` (at position rows + n) into out [k]: the argmax per position, or with
    # top_k > 0 DFlash2's selector path (pred / succ [V, r] codebooks, hp_w the packed hidden projection); out_h
    # [k+1, D] the block's final hidden rows. w: _Plan.args; rope: (cos, sin) [positions, d]
    fc_w, hn_w, hn_eps, mask_emb, norm_w, norm_eps, lm_w, top_k, pred, succ, hp_w = w
    cos_t, sin_t = rope
    n = feats.shape[0]
    if n > 0:
        ctx = _norm(_gemm(feats, fc_w), hn_w, hn_eps)
        for li in range(len(layers)):
            lay = layers[li]
            H, d = lay[17], lay[18]
            kk = _heads(_gemm(ctx, lay[3]), H, d, lay[9], lay[10], cos_t, sin_t, rows)
            vv = _gemm(ctx, lay[4])
            for h in range(H):
                for t in range(n):
                    kbufs[li][h, rows + t] = kk[h, t]
                    vbufs[li][h, rows + t] = vv[t, h * d : (h + 1) * d]
    C = rows + n  # context rows 0 .. C-1; the block's anchor at position C
    p0 = C
    B, D = k + 1, embed.shape[1]
    x = np.empty((B, D), _F)
    x[0] = embed[anchor]
    for t in range(1, B):
        x[t] = mask_emb
    for li in range(len(layers)):
        lay = layers[li]
        in_w, in_eps, wq, wk, wv, wo, conv, qn_w, qn_eps, kn_w, kn_eps, post_w, post_eps, wg, wu, wd, limit, H, d = lay
        a = _conv(_norm(x, in_w, in_eps), conv[0])
        q = _heads(_gemm(a, wq), H, d, qn_w, qn_eps, cos_t, sin_t, p0)
        kb = _heads(_gemm(a, wk), H, d, kn_w, kn_eps, cos_t, sin_t, p0)
        vflat = _gemm(a, wv)
        vb = np.empty((H, B, d), _F)
        for h in range(H):
            for t in range(B):
                vb[h, t] = vflat[t, h * d : (h + 1) * d]
        o = _attend(q, kb, vb, kbufs[li], vbufs[li], C, _F(1.0 / math.sqrt(d)))
        x = x + _conv(_gemm(o, wo), conv[1])
        m = _conv(_norm(x, post_w, post_eps), conv[2])
        g, u = _gemm(m, wg), _gemm(m, wu)
        act = np.empty_like(g)
        _swiglu(g, u, limit, act)
        x = x + _conv(_gemm(act, wd), conv[3])
    _rms(x, norm_w, norm_eps, out_h)
    hs = np.ascontiguousarray(out_h[1:])
    V = cols(lm_w)
    logits = np.empty((k, V), _F)
    _mmp(hs, lm_w, 0, V, logits)
    if top_k == 0:
        for t in range(k):
            out[t] = np.argmax(logits[t])
        return
    hp = _gemm(hs, hp_w)  # [k, r]
    prev = anchor
    for t in range(k):
        cand = _top_k(logits[t], top_k)
        best, pick = _F(-np.inf), cand[0]
        for b in range(top_k):
            c = cand[b]
            s = _F(0.0)
            for e in range(hp.shape[1]):
                s += pred[prev, e] * hp[t, e] * succ[c, e]
            s = logits[t, c] + s
            if s > best:
                best, pick = s, c
        out[t] = pick
        prev = pick


class _Plan:
    __slots__ = ("key", "layers", "args", "rope", "entry", "params")


_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, _Plan]" = weakref.WeakKeyDictionary()


def fits(model, x: torch.Tensor) -> bool:
    """Whether the compiled round serves ``model`` (a :class:`~tandem.model.dflash.DFlashDrafter`): fp32 weights and
    rows on the CPU with its numba kernels on (:meth:`~tandem.ops.settings.KernelSettings.numba_on`)."""
    return model.fc.weight.dtype == torch.float32 == x.dtype and model.kernels.numba_on(x)


def _rope_tables(model, n: int) -> tuple[np.ndarray, np.ndarray]:
    """RoPE's cosines and sines ``[n, d]`` at positions ``0 .. n-1``: :func:`tandem.model.dflash.rope`'s values."""
    d, theta = model.cfg.head_dim, model.cfg.rope_theta
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(n).float().unsqueeze(-1) * inv
    return torch.cat([ang, ang], -1).cos().numpy(), torch.cat([ang, ang], -1).sin().numpy()


def _plan(model, head: torch.Tensor, head_kernels, positions: int) -> _Plan:
    """The compiled round's weight arguments for ``model`` with the LM head ``head`` (remade when a weight changes in
    place, its storage or the kernel settings change; a parameter object put in another's place is not looked
    for), and RoPE tables for ``positions`` positions at least."""
    p = _PLANS.get(model)
    params = p.params if p is not None and p.params[-1] is head else [*model.parameters(), head]
    key = (head_kernels, model.kernels) + tuple((t.data_ptr(), t._version) for t in params)
    if p is None or p.key != key:
        k = model.kernels
        layers = []
        for lay in model.layers:
            a = lay.self_attn
            conv = np.stack([np_param(c.weight) for c in lay.convs]) if lay.convs is not None else _NO_CONV
            layers.append(
                (
                    np_param(lay.input_layernorm.weight),
                    _F(lay.input_layernorm.variance_epsilon),
                    kernel_weight(a.q_proj.weight, k),
                    kernel_weight(a.k_proj.weight, k),
                    kernel_weight(a.v_proj.weight, k),
                    kernel_weight(a.o_proj.weight, k),
                    np.ascontiguousarray(conv),
                    np_param(a.q_norm.weight),
                    _F(a.q_norm.variance_epsilon),
                    np_param(a.k_norm.weight),
                    _F(a.k_norm.variance_epsilon),
                    np_param(lay.post_attention_layernorm.weight),
                    _F(lay.post_attention_layernorm.variance_epsilon),
                    kernel_weight(lay.gate_proj.weight, k),
                    kernel_weight(lay.up_proj.weight, k),
                    kernel_weight(lay.down_proj.weight, k),
                    _F(lay.limit),
                    a.h,
                    a.d,
                )
            )
        sel = model.selector
        p = _Plan()
        p.key = key
        p.layers = typed_list(layers)
        p.args = (
            kernel_weight(model.fc.weight, k),
            np_param(model.hidden_norm.weight),
            _F(model.hidden_norm.variance_epsilon),
            np_param(model.mask_embedding),
            np_param(model.norm.weight),
            _F(model.norm.variance_epsilon),
            kernel_weight(head, head_kernels),
            0 if sel is None else sel.top_k,
            np_param(sel.predecessor.weight) if sel else np.zeros((1, 1), _F),
            np_param(sel.successor.weight) if sel else np.zeros((1, 1), _F),
            kernel_weight(sel.hidden_proj.weight, k) if sel else kernel_weight(model.fc.weight, k),
        )
        p.rope = (np.zeros((0, model.cfg.head_dim), _F),) * 2
        p.entry, p.params = {}, params
        _PLANS[model] = p
    if p.rope[0].shape[0] < positions:
        p.rope = _rope_tables(model, max(positions, 2 * p.rope[0].shape[0], 1024))
    return p


def draft_round(
    model,
    embed: torch.Tensor,
    head: torch.Tensor,
    head_kernels,
    ctx: ContextKV,
    features: torch.Tensor,
    anchor: int,
    k: int,
) -> tuple[list[int], torch.Tensor]:
    """One sequence's drafter round compiled (see the module text): ingest ``features [n, F]`` (the trunk's rows
    the drafter has not seen, at positions ``ctx.rows ..``) into ``ctx``, then draft ``k >= 1`` tokens after
    ``anchor`` (the token after the last of those rows) with ``model`` over the trunk's ``embed [V, D]`` and LM
    head weight ``head [V, D]`` (packed for ``head_kernels``). Returns the ``k`` drafts."""
    n = features.shape[0]
    ctx.room(n)
    p = _plan(model, head, head_kernels, ctx.rows + n + k + 1)
    out, out_h = np.empty(k, np.int64), np.empty((k + 1, model.cfg.hidden_size), _F)
    kbufs, vbufs = typed_list([b[0].numpy() for b in ctx.k]), typed_list([b[0].numpy() for b in ctx.v])
    feats = np.ascontiguousarray(features.numpy(), _F).reshape(n, -1)
    args = (p.args, p.layers, feats, ctx.rows, anchor, k, np_param(embed), kbufs, vbufs, p.rope, out, out_h)
    compiled_call(_round, p.entry, "round", args)
    ctx.rows += n
    return out.tolist(), torch.from_numpy(out_h)
