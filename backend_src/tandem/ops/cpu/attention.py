"""CPU kernels for the MLA / DSA rows of decode and verify, compiled with numba (float32, no autograd).

:func:`mla_many` appends every sequence's rows to its cache in place (with the DSA pools they
complete, :func:`pool_keys`' arithmetic) and then computes, for each sequence's few query rows over
its cache, what
:meth:`tandem.model.mla.MLAttention._heads_out` computes with torch (its reference, and the path for
longer blocks): the DSA indexer's pool scores, the k-pool selection
(:func:`tandem.ops.cpu.kernels._dsa_mask`), then per head softmax attention over the selected
tokens only: two kernel calls a layer for all the sessions of a round, the caches' buffers addressed
by pointer (:meth:`tandem.model.cache.MLACache.kernel_ptrs`). Each row runs the same float32
operations whatever the number of rows or sequences in the call, so a row's output is bit-identical
alone (plain decoding), inside a verify block or in a batch of sessions.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .kernels import _dot, _dsa_mask, _exp, np_param, np_rows
from .tile import _I64

_F = np.float32
_V8 = ir.VectorType(ir.FloatType(), 8)


def _carry_loop(builder, start, stop, step: int, init, name: str, body):
    """A counted loop in LLVM IR carrying one value: ``v = body(i, v)`` for ``i = start, start + step, ... < stop``
    (int64 values), from ``init``; returns the last ``v`` (``init`` when no step runs)."""
    pre = builder.block
    loop, done = builder.append_basic_block(name), builder.append_basic_block(name + ".done")
    builder.cbranch(builder.icmp_signed("<", start, stop), loop, done)
    builder.position_at_end(loop)
    i, v = builder.phi(_I64), builder.phi(init.type)
    i.add_incoming(start, pre)
    v.add_incoming(init, pre)
    nv = body(i, v)
    i1 = builder.add(i, ir.Constant(_I64, step))
    i.add_incoming(i1, loop)
    v.add_incoming(nv, loop)
    builder.cbranch(builder.icmp_signed("<", i1, stop), loop, done)
    builder.position_at_end(done)
    out = builder.phi(init.type)
    out.add_incoming(init, pre)
    out.add_incoming(nv, loop)
    return out


@intrinsic
def dot_fma(typingctx, a, b):
    """The intrinsic ``dot_fma(a, b)``: :func:`~tandem.ops.cpu.kernels._dot` as a kernel with fastmath "contract"
    computes it (eight interleaved partial sums, each a chain of fmas ``s_k = fma(a[j+k], b[j+k], s_k)`` over ``j`` in
    steps of 8 from 0, combined ``((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7))``, then ``acc = fma(a[j], b[j], acc)`` over the
    last ``n % 8``), with the partial sums as one vector of eight: ``a``, ``b`` float32 C-contiguous 1-D of one length
    (unchecked)."""
    if not all(
        isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32 and x.layout == "C" for x in (a, b)
    ):
        return None
    sig = types.float32(a, b)

    def codegen(context, builder, sig, args):
        (at, bt), (av, bv) = sig.args, args
        aa, ba = context.make_array(at)(context, builder, av), context.make_array(bt)(context, builder, bv)
        i64, f32 = _I64, ir.FloatType()
        n = cgutils.unpack_tuple(builder, aa.shape, 1)[0]
        n8 = builder.sub(n, builder.srem(n, ir.Constant(i64, 8)))
        fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8, [_V8] * 3), "llvm.fma.v8f32")
        fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")

        def at(arr, k):
            return builder.gep(arr.data, [k])

        s = _carry_loop(
            builder,
            ir.Constant(i64, 0),
            n8,
            8,
            ir.Constant(_V8, [0.0] * 8),
            "dot.j8",
            lambda j, acc: builder.call(
                fma8, [builder.load(builder.bitcast(at(x, j), _V8.as_pointer()), align=4) for x in (aa, ba)] + [acc]
            ),
        )
        p = [builder.extract_element(s, ir.Constant(ir.IntType(32), k)) for k in range(8)]
        tot = builder.fadd(
            builder.fadd(builder.fadd(p[0], p[1]), builder.fadd(p[2], p[3])),
            builder.fadd(builder.fadd(p[4], p[5]), builder.fadd(p[6], p[7])),
        )
        return _carry_loop(
            builder,
            n8,
            n,
            1,
            tot,
            "dot.tail",
            lambda k, t: builder.call(fma1, [builder.load(at(aa, k)), builder.load(at(ba, k)), t]),
        )

    return sig, codegen


def _dotc(a, b):  # pragma: no cover - numba only
    """:func:`~tandem.ops.cpu.kernels._dot` in a kernel with fastmath "contract" (bit for bit): contiguous
    float32 vectors take :func:`dot_fma` (its partial sums in a register: 19 -> 5 ns a
    64-long dot here), other layouts the loop itself."""
    raise NotImplementedError("numba only")


@overload(_dotc, inline="always")
def _dotc_impl(a, b):
    if all(isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32 and x.layout == "C" for x in (a, b)):
        return lambda a, b: dot_fma(a, b)
    return lambda a, b: _dot(a, b)


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
                dots[t, h, p] = _dotc(iq[t, h * di : (h + 1) * di], pk[p])
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
                s[a] = _dotc(K[h, idx[a]], q[t, h]) * scaling
                mx = max(mx, s[a])
            for a in range(n):  # (a loop of its own: vectorised)
                s[a] = _exp(s[a] - mx)
            tot = np.float32(0.0)
            for a in range(n):
                tot += s[a]
            o = out[t, h * dv : (h + 1) * dv]
            o[:] = np.float32(0.0)
            for a in range(n):
                w, vj = s[a] / tot, V[h, idx[a]]
                for e in range(dv):
                    o[e] += w * vj[e]


@intrinsic
def _f32_ptr(typingctx, addr):
    """An int64 address as a float32 pointer (for ``numba.carray`` over a buffer the caller keeps alive)."""
    if addr != types.int64:
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.PointerType(ir.FloatType()))

    return types.CPointer(types.float32)(addr), codegen


@njit(cache=True, nogil=True, error_model="numpy")
def _pools(ik, ig, ape, p0, p1, pk):  # pragma: no cover - numba
    # the compressed keys of pools p0 .. p1-1 (rows p*kp .. p*kp+kp-1 of ik / ig [L, di]) into pk [., di]:
    # per channel, the softmax over the pool's rows of ig + ape [kp, di], weighting ik
    kp, di = ape.shape
    m, tot, acc = np.empty(di, np.float32), np.empty(di, np.float32), np.empty(di, np.float32)
    for p in range(p0, p1):
        r0 = p * kp
        for d in range(di):
            m[d] = ig[r0, d] + ape[0, d]
        for j in range(1, kp):
            for d in range(di):
                m[d] = max(m[d], ig[r0 + j, d] + ape[j, d])
        tot[:] = np.float32(0.0)
        acc[:] = np.float32(0.0)
        for j in range(kp):
            for d in range(di):
                e = np.exp(ig[r0 + j, d] + ape[j, d] - m[d])
                tot[d] += e
                acc[d] += e * ik[r0 + j, d]
        for d in range(di):
            pk[p, d] = acc[d] / tot[d]


def pool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """The DSA indexer's compressed pool keys (serving kernel of
    :meth:`tandem.model.mla.Indexer.pool_keys`, its reference): ``keys, gates [1, n, di]`` fp32, ``ape
    [kp, di]`` -> ``[1, n // kp, di]``, per channel ``sum_j softmax_j(gates + ape) * keys`` over each
    complete pool's ``kp`` rows. The same arithmetic as the pools :func:`mla_many` completes."""
    a = np_param(ape)
    n = keys.shape[1] // a.shape[0]
    out = np.empty((n, a.shape[1]), _F)
    _pools(np_rows(keys[0]), np_rows(gates[0]), a, 0, n, out)
    return torch.from_numpy(out)[None]


@njit(cache=True, nogil=True)
def _append_many(lat, k, v, ik, ig, ape, offs, ptrs, used, pools):  # pragma: no cover - numba
    # rows offs[j]:offs[j+1] of lat [N, r], k [H, N, dqk], v [H, N, dv], ik / ig [N, di] to sequence
    # j's cache buffers (ptrs[j]: MLACache.kernel_ptrs) after its used[j] rows, then the pools they
    # complete after its pools[j] (_pools)
    H, _, dq = k.shape
    dv, r, di = v.shape[2], lat.shape[1], ik.shape[1]
    kp = ape.shape[0]
    for j in range(offs.shape[0] - 1):
        a, b, L = offs[j], offs[j + 1], used[j]
        end = L + b - a
        carray(_f32_ptr(ptrs[j, 0]), (end, r))[L:] = lat[a:b]
        carray(_f32_ptr(ptrs[j, 1]), (H, ptrs[j, 6], dq))[:, L:end] = k[:, a:b]
        carray(_f32_ptr(ptrs[j, 2]), (H, ptrs[j, 7], dv))[:, L:end] = v[:, a:b]
        cik, cig = carray(_f32_ptr(ptrs[j, 3]), (end, di)), carray(_f32_ptr(ptrs[j, 4]), (end, di))
        cik[L:] = ik[a:b]
        cig[L:] = ig[a:b]
        if end // kp > pools[j]:
            _pools(cik, cig, ape, pools[j], end // kp, carray(_f32_ptr(ptrs[j, 5]), (end // kp, di)))


@njit(cache=True, nogil=True)
def _attend_many(
    q, iq, iw, offs, ptrs, used, pools, kp, k_pools, scaling, q_scale, w_scale, out
):  # pragma: no cover - numba
    # _mla_rows of sequence j's rows offs[j]:offs[j+1] over its cache buffers (ptrs[j]), whose used[j]
    # rows already include them, and its pools[j] complete pools
    H, dq, di = q.shape[1], q.shape[2], iq.shape[1] // iw.shape[1]
    dv = out.shape[1] // H
    for j in range(offs.shape[0] - 1):
        a, b, L = offs[j], offs[j + 1], used[j]
        K = carray(_f32_ptr(ptrs[j, 1]), (H, ptrs[j, 6], dq))
        V = carray(_f32_ptr(ptrs[j, 2]), (H, ptrs[j, 7], dv))
        pk = carray(_f32_ptr(ptrs[j, 5]), (pools[j], di))
        _mla_rows(
            q[a:b],
            K,
            V,
            L,
            iq[a:b],
            iw[a:b],
            pk,
            np.arange(L - (b - a), L),
            kp,
            k_pools,
            scaling,
            q_scale,
            w_scale,
            out[a:b],
        )


def query_arrays(rows: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The query-side arrays of projected rows (``MLAttention.project`` in the serving layout), once
    for all sequences: ``q [N, H, dqk]``, ``iq [N, Hi * di]``, ``iw [N, Hi]`` (C-contiguous fp32)."""
    return np_rows(rows["q"][0].transpose(0, 1)), np_rows(rows["iq"][0]), np_rows(rows["iw"][0])


def empty_out(rows: dict[str, torch.Tensor]) -> np.ndarray:
    """An uninitialised ``[N, H * dv]`` fp32 output for the rows' heads."""
    _, H, N, dv = rows["v"].shape
    return np.empty((N, H * dv), _F)


def mla_rows_into(
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray],
    off: int,
    n: int,
    cache,
    pos0: int,
    kp: int,
    k_pools: int,
    scaling: float,
    q_scale: float,
    w_scale: float,
    out: np.ndarray,
) -> None:
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
    _mla_rows(
        q[off : off + n],
        cache.buffer_np("k")[0],
        cache.buffer_np("v")[0],
        len(cache),
        iq[off : off + n],
        iw[off : off + n],
        pk,
        np.arange(pos0, pos0 + n, dtype=np.int64),
        kp,
        k_pools,
        _F(scaling),
        _F(q_scale),
        _F(w_scale),
        out[off : off + n],
    )


def cache_args(caches: list, lengths: list[int], like: dict[str, torch.Tensor]) -> tuple[np.ndarray, ...]:
    """What the in-place kernels take for appending ``lengths[j]`` rows to each :class:`~tandem.model.cache.MLACache`
    ``caches[j]`` (room reserved first, new buffers shaped like ``like``'s rows): ``(offs [n+1], ptrs [n, 10]
    (:meth:`~tandem.model.cache.MLACache.kernel_ptrs`), used [n] rows, pools [n])``, int64; call each
    cache's ``extend`` after the kernel wrote the rows."""
    for c, m in zip(caches, lengths):
        c.reserve(m, like)
    offs = np.zeros(len(caches) + 1, np.int64)
    np.cumsum(lengths, out=offs[1:])
    return (
        offs,
        np.array([c.kernel_ptrs() for c in caches], np.int64),
        np.array([len(c) for c in caches], np.int64),
        np.array([c.n_pools() for c in caches], np.int64),
    )


def mla_many(
    rows: dict[str, torch.Tensor],
    caches: list,
    lengths: list[int],
    ape: torch.Tensor,
    kp: int,
    k_pools: int,
    scaling: float,
    q_scale: float,
    w_scale: float,
) -> np.ndarray:
    """The serving path of several sequences' MLA rows in two kernel calls: every sequence's rows of
    ``rows`` (``MLAttention.project``'s serving layout, ``[1, sum R, .]`` / ``[1, H, sum R, .]``, the
    sequences' ``lengths`` in turn) appended in place to its :class:`~tandem.model.cache.MLACache`
    (``caches``) with the pools they complete (:func:`pool_keys`' arithmetic; ``ape [kp, di]``), then
    each sequence's heads' outputs as :func:`mla_rows_into` computes them (the same per-row
    arithmetic, so bit-identical to it). Returns ``[sum R, H * dv]`` fp32."""
    offs, ptrs, used, pools = cache_args(caches, lengths, rows)
    _append_many(
        np_rows(rows["latent"][0]),
        np_rows(rows["k"][0]),
        np_rows(rows["v"][0]),
        np_rows(rows["ik"][0]),
        np_rows(rows["ig"][0]),
        np_param(ape),
        offs,
        ptrs,
        used,
        pools,
    )
    for c, m in zip(caches, lengths):
        c.extend(m)
    q, iq, iw = query_arrays(rows)
    out = empty_out(rows)
    used += offs[1:] - offs[:-1]
    _attend_many(q, iq, iw, offs, ptrs, used, used // kp, kp, k_pools, _F(scaling), _F(q_scale), _F(w_scale), out)
    return out
