"""CPU kernels for the decode / verify hot path, compiled with numba (no autograd; float32).

On this CPU a torch op costs 3-5 us of dispatch whatever its size, and a decode row of the tiny trunk is
a few hundred such ops: the per-row glue between the matrix products (mHC weights with their Sinkhorn
loop and the block norm, the mHC merge, the KDA conv / gates / recurrence / output norm (in
:mod:`~tandem.ops.cpu.kda`), MoE routing / SwiGLU / combine (in :mod:`~tandem.ops.cpu.moe`), DSA pool
selection) is fused into one call each. Every kernel has a pure-torch reference it is tested against
(``tests/test_cpu_kernels.py``): :meth:`~tandem.model.layers.HyperConnection.forward` + RMSNorm,
:func:`~tandem.model.layers.hc_merge`, :meth:`~tandem.model.kda.LinearAttention.forward_rows`,
:meth:`~tandem.model.layers.MoE.forward`, :meth:`~tandem.model.mla.Indexer.select`; a model loaded with
:data:`tandem.ops.settings.REFERENCE` runs on them.

Each row is computed by the same sequence of float32 operations whatever the number of rows in the call
(the hot loops' ``exp`` is :func:`_exp`, which vectorises; sums over a row's features run in :func:`_dot`'s
fixed order), so a row's result is bit-identical alone (plain decoding) or inside a verify block.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.typed import List
from numba.extending import intrinsic

from .tile import hc_mix8


_F = np.float32

_PARAMS: dict[
    object, tuple[int, np.ndarray, torch.Tensor]
] = {}  # id(weight) or ("T", id(weight)) -> (storage, array, weight)


def _cached(key, p: torch.Tensor, make) -> np.ndarray:
    """``make()``, kept under ``key`` while ``p`` (the weight it was made from) keeps its storage."""
    hit = _PARAMS.get(key)
    if hit is not None and hit[2] is p and hit[0] == p.data_ptr():
        return hit[1]
    a = make()
    if len(_PARAMS) > 4096:  # not a cache of every model a process ever loaded
        _PARAMS.clear()
    _PARAMS[key] = (p.data_ptr(), a, p)
    return a


def np_param(p: torch.Tensor) -> np.ndarray:
    """A float32 C-contiguous numpy array of a weight, made once per storage (a view when the weight already is fp32
    and contiguous, so in-place loads show through; a copy otherwise)."""
    return _cached(id(p), p, lambda: p.detach().float().contiguous().numpy())


def np_param_t(p: torch.Tensor) -> np.ndarray:
    """:func:`np_param` of a 2-D weight ``[O, I]`` transposed: ``[I, O]`` float32 C-contiguous (a copy, made once per storage)."""
    return _cached(("T", id(p)), p, lambda: np.ascontiguousarray(np_param(p).T))


def np_rows(t: torch.Tensor) -> np.ndarray:
    """Activations as a float32 C-contiguous numpy array (no copy when they already are)."""
    if t.dtype != torch.float32:
        t = t.float()
    return (t if t.is_contiguous() else t.contiguous()).numpy()


@intrinsic
def _pow2i(typingctx, k):
    """``2 ** k`` as float32 for an int32 ``k`` in [-126, 127]: the bits ``(k + 127) << 23``."""
    if k != types.int32:
        return None

    def codegen(context, builder, sig, args):
        bits = builder.shl(builder.add(args[0], ir.Constant(ir.IntType(32), 127)), ir.Constant(ir.IntType(32), 23))
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(k), codegen


@njit(cache=True, nogil=True, inline="always", fastmath={"contract"})
def _exp(x):  # pragma: no cover - numba
    # float32 exp that LLVM vectorises (a libm call per element does not): the Cephes expf
    # reduction and polynomial (S. L. Moshier, Cephes Math Library, expf.c): x = k ln2 + r, |r| <=
    # ln2 / 2, exp(r) by a degree-6 polynomial, 2**k from the exponent bits. At most 1.4 ulp off
    # exp over [-87, 88]; x is clamped to [-87.3, 88.3] (exp(-87.3) ~ 1.2e-38, exp(88.3) ~ 2.2e38)
    # (so SiLU / sigmoid of x <= -88 give a tiny value instead of 0). Inlined, it takes the caller's
    # fastmath flags: with "contract" (the KDA kernel) its steps fuse into FMAs, without (the MoE
    # kernel) they do not; each is one fixed per-element function, so rows stay batch-invariant.
    # numba's on-disk cache does not see edits here from the files that inline it: clear their
    # __pycache__ after changing _exp or _dot.
    x = min(max(x, np.float32(-87.3)), np.float32(88.3))
    k = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - k * np.float32(0.693359375)
    r = r - k * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    return p * _pow2i(np.int32(k))


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
def _hc_weights(
    streams, fn_t, base, scale, n, iters, eps, norm_eps, nw, nw_eps, post, comb, collapsed
):  # pragma: no cover - numba
    # fn_t [N*D, (2+N)N]: the mixing weight transposed (np_param_t)
    M, ND = streams.shape
    D = ND // n
    n_mix = fn_t.shape[1]
    n8 = ND - ND % 8
    mix, part, one = np.empty(n_mix, np.float32), np.empty((8, n_mix), np.float32), np.float32(1.0)
    in_regs, part64 = n_mix == 8 and fn_t.strides[0] == 32 and fn_t.strides[1] == 4, part.reshape(1, 8 * n_mix)
    for r in range(M):
        x = streams[r]
        inv = one / np.sqrt(_dot(x, x) / np.float32(ND) + norm_eps)
        # every mixing output as _dot(x, fn[o]) sums it (eight interleaved partial sums, combined in that order), all
        # outputs at once along a row of fn_t; 8 outputs (hc_mult 2): the same sums in registers, 1.21 -> 0.19 us a row
        if in_regs:
            hc_mix8(streams, r, fn_t, part64)
        else:
            part[:] = np.float32(0.0)
            for j in range(0, n8, 8):
                for k in range(8):
                    xv, w, acc = x[j + k], fn_t[j + k], part[k]
                    for o in range(n_mix):
                        acc[o] += xv * w[o]
        for o in range(n_mix):
            acc_o = ((part[0, o] + part[1, o]) + (part[2, o] + part[3, o])) + (
                (part[4, o] + part[5, o]) + (part[6, o] + part[7, o])
            )
            for j in range(n8, ND):
                acc_o += x[j] * fn_t[j, o]
            mix[o] = acc_o * inv
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


def hc_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
    norm_w: torch.Tensor,
    norm_w_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC weights of rows ``streams [B, T, N, D]`` (any float dtype): ``post [B,T,N]`` and ``comb [B,T,N,N]`` fp32, and
    the block's RMSNorm (weight ``norm_w [D]``, eps ``norm_w_eps``) of the collapsed block input, ``[B, T, D]`` in the
    streams' dtype.

    The math of :meth:`tandem.model.layers.HyperConnection.forward` (RMS-normalised streams, the
    ``fn [(2+N)N, N*D]`` mixing, sigmoid / softmax heads, Sinkhorn-Knopp) in one pass per row."""
    b, t, n, d = streams.shape
    s = np_rows(streams.reshape(b * t, n * d))
    post, comb, col = np.empty((b * t, n), _F), np.empty((b * t, n, n), _F), np.empty((b * t, d), _F)
    _hc_weights(
        s,
        np_param_t(fn),
        np_param(base),
        np_param(scale),
        n,
        iters,
        _F(eps),
        _F(norm_eps),
        np_param(norm_w),
        _F(norm_w_eps),
        post,
        comb,
        col,
    )
    return (
        torch.from_numpy(post).view(b, t, n),
        torch.from_numpy(comb).view(b, t, n, n),
        torch.from_numpy(col).view(b, t, d).to(streams.dtype),
    )


@njit(cache=True, nogil=True)
def _hc_merge(post, comb, block, residual, out):  # pragma: no cover - numba
    # out[r, i, d] = ((post[r, i] * block[r, d] + comb[r, 0, i] * residual[r, 0, d]) + ...) over the
    # streams m in order; each loop runs along d (contiguous: vectorised; with m innermost it ran
    # scalar, 8 rows 6.4 -> 1.0 us), the same operations per element in the same order
    M, n, D = residual.shape
    for r in range(M):
        b = block[r]
        for i in range(n):
            p = post[r, i]
            o = out[r, i]
            for d in range(D):
                o[d] = p * b[d]
            for m in range(n):
                c = comb[r, m, i]
                res = residual[r, m]
                for d in range(D):
                    o[d] += c * res[d]


def hc_merge(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """:func:`tandem.model.layers.hc_merge` for fp32 rows: ``post ⊗ block_out + comb^T @ residual``.
    ``post [B,T,N]``, ``comb [B,T,N,N]``, ``block_out [B,T,D]``, ``residual [B,T,N,D]`` -> ``[B,T,N,D]``."""
    b, t, n, d = residual.shape
    out = np.empty((b * t, n, d), _F)
    _hc_merge(
        np_rows(post.reshape(b * t, n)),
        np_rows(comb.reshape(b * t, n, n)),
        np_rows(block_out.reshape(b * t, d)),
        np_rows(residual.reshape(b * t, n, d)),
        out,
    )
    return torch.from_numpy(out).view(b, t, n, d)


@njit(cache=True, nogil=True)
def _rms(x, w, eps, out):  # pragma: no cover - numba
    # out [N, d] = w * x / sqrt(mean(x^2) + eps) per row of x [N, d] (a column slice is fine): the
    # block norm's arithmetic in _hc_weights
    N, d = x.shape
    one = np.float32(1.0)
    for r in range(N):
        inv = one / np.sqrt(_dot(x[r], x[r]) / np.float32(d) + eps)
        for j in range(d):
            out[r, j] = w[j] * (x[r, j] * inv)


@njit(cache=True, nogil=True)
def _layer_norm(x, w, b, eps, out):  # pragma: no cover - numba
    # out [N, d] = (x - mean) / sqrt(var + eps) * w + b per row (biased variance), sums in index order
    N, d = x.shape
    one = np.float32(1.0)
    for r in range(N):
        m = np.float32(0.0)
        for j in range(d):
            m += x[r, j]
        m = m / np.float32(d)
        var = np.float32(0.0)
        for j in range(d):
            var += (x[r, j] - m) * (x[r, j] - m)
        inv = one / np.sqrt(var / np.float32(d) + eps)
        for j in range(d):
            out[r, j] = (x[r, j] - m) * inv * w[j] + b[j]


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _swiglu_row(g, u, limit, out):  # pragma: no cover - numba
    # out [I] = silu(min(g, L)) * clamp(u, -L, L) (the experts' and the dense MLP's); g, u, out 1-D contiguous and
    # apart: LLVM vectorises it (on strided or overlapping arrays it ran scalar: 8 rows 11.7 -> 1.4 us)
    one = np.float32(1.0)
    for i in range(out.shape[0]):
        a = min(g[i], limit)
        out[i] = a / (one + _exp(-a)) * min(max(u[i], -limit), limit)


@njit(cache=True, nogil=True, error_model="numpy")
def _swiglu(g, u, limit, out):  # pragma: no cover - numba
    # out [N, I] = _swiglu_row of each row; C-contiguous arrays, out not g or u
    for r in range(g.shape[0]):
        _swiglu_row(g[r], u[r], limit, out[r])


def _rows_call(kernel, x: torch.Tensor, *args) -> torch.Tensor:
    d = x.shape[-1]
    xs = np_rows(x.reshape(-1, d))
    out = np.empty_like(xs)
    kernel(xs, *args, out)
    return torch.from_numpy(out).view(x.shape)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 rows ``x [..., d]`` with weight ``w [d]`` (:class:`tandem.model.layers.RMSNorm`, its
    reference): one kernel call, each row on its own (~3 us a row here; ``torch.rms_norm`` ~22 us)."""
    return _rows_call(_rms, x, np_param(w), _F(eps))


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """``nn.LayerNorm`` (its reference) of fp32 rows ``x [..., d]``: one kernel call, each row on its own."""
    return _rows_call(_layer_norm, x, np_param(w), np_param(b), _F(eps))


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """:func:`tandem.model.layers.clamped_swiglu` (its reference) of fp32 rows ``[..., I]``, with the
    arithmetic of the MoE kernels' experts."""
    g, u = np_rows(gate.reshape(-1, gate.shape[-1])), np_rows(up.reshape(-1, up.shape[-1]))
    out = np.empty_like(g)
    _swiglu(g, u, _F(limit), out)
    return torch.from_numpy(out).view(gate.shape)


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


def dsa_mask(
    dots: torch.Tensor,
    weights: torch.Tensor,
    q_pos: torch.Tensor,
    kv_len: int,
    kp: int,
    k_pools: int,
    q_scale: float,
    w_scale: float,
) -> torch.Tensor:
    """DSA k-pool selection of one sequence (:meth:`tandem.model.mla.Indexer.select` over
    :meth:`~tandem.model.mla.Indexer.scores`, the reference): pool score
    ``sum_h (w_h * w_scale) * relu(dot_hp * q_scale)``, the ``k_pools`` best complete pools, ties
    toward the earlier one, plus the incomplete tail. ``dots [1, T, H, P]`` = indexer queries · pool
    keys (unscaled), ``weights [1, T, H]`` (``weights_proj`` output), ``q_pos [T]`` absolute positions.
    Returns the visibility mask ``[1, T, kv_len]`` bool."""
    _, T, H, P = dots.shape
    mask = np.empty((T, kv_len), np.bool_)
    _dsa_mask(np_rows(dots[0]), np_rows(weights[0]), _F(q_scale), _F(w_scale), q_pos.numpy(), kp, k_pools, mask)
    return torch.from_numpy(mask)[None]


@njit(cache=True, nogil=True)
def _top2(x, idx, gap):  # pragma: no cover - numba
    # per row of x [R, V]: the first index of the largest value and (largest - second largest)
    R, V = x.shape
    for r in range(R):
        b, s, bi = x[r, 0], -np.inf, 0
        for v in range(1, V):
            y = x[r, v]
            if y > s:
                if y > b:
                    s, b, bi = b, y, v
                else:
                    s = y
        idx[r], gap[r] = bi, b - s


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy targets and top-2 gaps of ``logits [R, V]`` fp32 (``V >= 2``; one pass over each row
    where ``topk(2)`` sorts): the argmax ``[R]`` int64 (the first of equal maxima, as ``argmax``)
    and ``top1 - top2`` ``[R]`` fp32 (0 at a tie). Reference: ``logits.topk(2, -1)``."""
    x = np_rows(logits)
    idx, gap = np.empty(x.shape[0], np.int64), np.empty(x.shape[0], _F)
    _top2(x, idx, gap)
    return torch.from_numpy(idx), torch.from_numpy(gap)


@njit(cache=True)
def _list_with(x):  # pragma: no cover - numba
    out = List()
    out.append(x)
    return out


@njit(cache=True)
def _append(out, x):  # pragma: no cover - numba
    out.append(x)


def typed_list(items: list) -> List:
    """A numba typed list of ``items`` (one numba type, at least one), filled by cached compiled functions
    whose signatures depend on the element type only: a typed list filled from Python compiles its methods
    at run time, uncached (seconds at every process start)."""
    out = _list_with(items[0])
    for x in items[1:]:
        _append(out, x)
    return out


def compiled_call(fn, entries: dict, key, args: tuple):
    """``fn(*args)`` for a numba function ``fn``, through the compiled entry point ``entries[key]`` once one is
    kept there: numba's dispatcher types every argument at every call (for a model's nested typed lists, hundreds
    of type hashes: a few hundred microseconds a call), the entry point only unboxes them. The caller keeps
    ``key`` to calls whose arguments have the same numba types (the first call of a key goes through the
    dispatcher, which compiles or loads what it needs, and keeps its entry point)."""
    entry = entries.get(key)
    if entry is not None:
        return entry(*args)
    out = fn(*args)
    entries[key] = fn.overloads[tuple(fn.typeof_pyval(a) for a in args)].entry_point
    return out
