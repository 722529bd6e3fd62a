"""Register-tiled micro-kernels, written as LLVM IR through numba intrinsics: the tiles of the
row-invariant GEMM (:mod:`tandem.ops.cpu.gemm`) and the KDA state passes
(:mod:`tandem.ops.cpu.kda`).

:func:`~tandem.ops.cpu.gemm._mm_blocked`'s loops keep four rows' accumulators in memory: every
step of four input elements loads and stores each accumulator once. Here a tile of ``R`` rows x 64
columns keeps its ``R x 4`` accumulators (vectors of 16 float32) in registers across the whole
input dimension: per input element it loads four weight vectors and ``R`` inputs and issues ``4R``
fused multiply-adds (near this AMD EPYC core's 16 fp32 FMAs a cycle at R = 4). Each output element
is still the one chain of float32 FMAs over the input dimension in order, ``fma(x[r, D-1], w[D-1,
j], ... fma(x[r, 0], w[0, j], 0))`` (``llvm.fma`` is the exactly rounded fused multiply-add, as the
contracted scalar code's), so a tile's results are bit-identical to the blocked kernels' and to
themselves for any number of rows (``tests/test_cpu_tile.py``). Serving's weights are strip-packed
(:func:`~tandem.ops.cpu.gemm.pack_strips`): a tile's ``D x 64`` weights are one contiguous run, which
the hardware prefetchers stream, so every row count, one row included, takes the tiles (on the
unpacked layout one row stays with the blocked kernel: there a tile walks the weights in short runs).

The KDA state passes (decay + ``S'^T k``; delta-rule update + ``S^T q``) keep a head's ``dk``
accumulators in registers the same way, with the loops' arithmetic in the loops' order, and so do the
mHC mixing logits' 64 partial sums (:func:`hc_mix8`, hc_mult 2).

Weights are float32 or the uint16 bits of bfloat16 (``bits << 16``, exact), as
:func:`~tandem.ops.cpu.gemm.kernel_weight` makes them. Indices are not checked: the callers keep
them in range. numba's cache does not see edits here from the files that call these: clear
``backend_src/tandem/ops/cpu/__pycache__`` after changing them.
"""

from __future__ import annotations

from llvmlite import binding as llvm, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: columns of a tile: four vectors of 16 float32
TILE = 64
_LANES, _VECS = 16, 4


_I64 = ir.IntType(64)
_VTY = ir.VectorType(ir.FloatType(), _LANES)
_ZERO = ir.Constant(_VTY, [0.0] * _LANES)


def _ptr(context, builder, ary, aryty, i, j):
    return cgutils.get_item_pointer2(
        context,
        builder,
        ary.data,
        cgutils.unpack_tuple(builder, ary.shape, 2),
        cgutils.unpack_tuple(builder, ary.strides, 2),
        aryty.layout,
        [i, j],
    )


def _vec_ptr(context, builder, ary, aryty, i, j):
    """A pointer to the 16 floats of row ``i`` from column ``j`` of a 2-D array."""
    return builder.bitcast(_ptr(context, builder, ary, aryty, i, j), _VTY.as_pointer())


def _fma(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VTY, [_VTY] * 3), f"llvm.fma.v{_LANES}f32")


def _splat(builder, x, vty=_VTY):
    """A scalar (a float; an int32 for ``vty`` of int32) broadcast to every lane."""
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(
        one, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), _LANES), [0] * _LANES)
    )


@intrinsic
def _f32(typingctx, v):
    """A weight element as float32: a float32 as is; a uint16 as the bfloat16 those bits encode
    (``bits << 16``, exact)."""
    if v == types.float32:
        return types.float32(v), lambda context, builder, sig, args: args[0]
    if v == types.uint16:

        def codegen(context, builder, sig, args):
            bits = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(bits, ir.FloatType())

        return types.float32(v), codegen
    return None


def _acc_loop(context, builder, K, R: int, body, out):
    """A tile's loop: ``R x 4`` accumulator vectors from 0, ``new = body(k, acc)`` for k = 0 .. K-1
    (``K`` an int64 value), then the final ones stored at ``out[r + i, o + 16 v]`` (``out = (array,
    array type, r, o)``: row ``i``, vector ``v``). Returns the intrinsic's (void) value."""
    oa, ot, r0, o0 = out
    i64 = _I64
    entry = builder.block
    loop = builder.append_basic_block("tile.k")
    done = builder.append_basic_block("tile.done")
    builder.cbranch(builder.icmp_signed(">", K, ir.Constant(i64, 0)), loop, done)
    builder.position_at_end(loop)
    k = builder.phi(i64)
    k.add_incoming(ir.Constant(i64, 0), entry)
    acc = [[builder.phi(_VTY) for _ in range(_VECS)] for _ in range(R)]
    for row in acc:
        for a in row:
            a.add_incoming(_ZERO, entry)
    new = body(k, acc)
    k1 = builder.add(k, ir.Constant(i64, 1))
    k.add_incoming(k1, loop)
    for row, nrow in zip(acc, new):
        for a, n in zip(row, nrow):
            a.add_incoming(n, loop)
    builder.cbranch(builder.icmp_signed("<", k1, K), loop, done)
    builder.position_at_end(done)
    res = [[builder.phi(_VTY) for _ in nrow] for nrow in new]  # every phi first
    for rrow, nrow in zip(res, new):
        for a, n in zip(rrow, nrow):
            a.add_incoming(_ZERO, entry)
            a.add_incoming(n, loop)
    for i, rrow in enumerate(res):
        for v, a in enumerate(rrow):
            builder.store(
                a,
                _vec_ptr(
                    context,
                    builder,
                    oa,
                    ot,
                    builder.add(r0, ir.Constant(i64, i)),
                    builder.add(o0, ir.Constant(i64, v * _LANES)),
                ),
                align=4,
            )
    return context.get_dummy_value()


def _tile(R: int):
    """The intrinsic ``tile(x, wt, r, c, out, o)``: ``out[r:r+R, o:o+64] = x[r:r+R, :] @ wt[:, c:c+64]``
    (``x [M, D]`` float32, ``wt [D, O]`` float32 or uint16 bfloat16 bits, ``out`` float32; indices
    int64, unchecked: the caller keeps them in range)."""

    @intrinsic
    def tile(typingctx, x, wt, r, c, out, o):
        if not (
            isinstance(x, types.Array)
            and x.ndim == 2
            and x.dtype == types.float32
            and isinstance(wt, types.Array)
            and wt.ndim == 2
            and wt.dtype in (types.float32, types.uint16)
            and isinstance(out, types.Array)
            and out.ndim == 2
            and out.dtype == types.float32
        ):
            return None
        sig = types.void(x, wt, types.int64, types.int64, out, types.int64)
        bf16 = wt.dtype == types.uint16

        def codegen(context, builder, sig, args):
            xt, wtt, _, _, ot, _ = sig.args
            xv, wv, r0, c0, ov, o0 = args
            xa = context.make_array(xt)(context, builder, xv)
            wa = context.make_array(wtt)(context, builder, wv)
            oa = context.make_array(ot)(context, builder, ov)
            i64, vty, fma = _I64, _VTY, _fma(builder)

            def body(k, acc):
                ws = []
                for v in range(_VECS):
                    p = _ptr(context, builder, wa, wtt, k, builder.add(c0, ir.Constant(i64, v * _LANES)))
                    if bf16:
                        bits = builder.load(
                            builder.bitcast(p, ir.VectorType(ir.IntType(16), _LANES).as_pointer()), align=2
                        )
                        bits = builder.shl(
                            builder.zext(bits, ir.VectorType(ir.IntType(32), _LANES)),
                            ir.Constant(ir.VectorType(ir.IntType(32), _LANES), [16] * _LANES),
                        )
                        ws.append(builder.bitcast(bits, vty))
                    else:
                        ws.append(builder.load(builder.bitcast(p, vty.as_pointer()), align=4))
                new = []
                for i, row in enumerate(acc):
                    xb = _splat(
                        builder, builder.load(_ptr(context, builder, xa, xt, builder.add(r0, ir.Constant(i64, i)), k))
                    )
                    new.append([builder.call(fma, [xb, ws[v], row[v]]) for v in range(_VECS)])
                return new

            return _acc_loop(context, builder, cgutils.unpack_tuple(builder, xa.shape, 2)[1], R, body, (oa, ot, r0, o0))

        return sig, codegen

    return tile


tile1, tile2, tile3, tile4 = (_tile(R) for R in (1, 2, 3, 4))


# -- bfloat16 dot-product tiles --------------------------------------------------------------------
#: whether this CPU has AVX512-BF16's ``vdpbf16ps`` (else :func:`_pair_tile` emulates it, same bits)
HW_BF16 = bool(llvm.get_host_cpu_features().get("avx512bf16", False))
if HW_BF16:
    llvm.initialize_native_asmparser()  # numba's code emitter needs it for inline assembly
_VI = ir.VectorType(ir.IntType(32), _LANES)
_HI = ir.Constant(_VI, [-65536] * _LANES)  # 0xFFFF0000: the odd element of a pair in place
_SH = ir.Constant(_VI, [16] * _LANES)


def _pair_tile(R: int, emulate: bool = not HW_BF16):
    """The intrinsic ``tile(xp, wp, r, out, o)``: ``out[r:r+R, o:o+64] = bf16(x[r:r+R]) @ w[:, :64]``
    on bfloat16 pairs: ``xp [M, D/2]`` uint32, each the bfloat16 bits of ``x[:, 2k]`` (low half) and
    ``x[:, 2k+1]`` (high half); ``wp [D/2, 64]`` uint32, each ``w[2k, j] | w[2k+1, j] << 16`` (one
    strip of :func:`~tandem.ops.cpu.gemm.pack_pairs`). Each output is the chain ``acc = fma(x[2k+1],
    w[2k+1, j], acc); acc = fma(x[2k], w[2k, j], acc)`` for k = 0, 1, ... from 0: what ``vdpbf16ps``
    computes (Intel SDM's order: the odd product first; a bfloat16 product is exact in float32, so each
    step rounds once; measured bit-equal on this fleet's AMD EPYC, ``tests/test_cpu_tile.py``). With
    ``emulate`` the same chain as two float32 FMAs a pair (machines without AVX512-BF16; denormal
    inputs, which ``vdpbf16ps`` flushes to zero, are kept). Indices int64, unchecked."""

    @intrinsic
    def tile(typingctx, xp, wp, r, out, o):
        if not (
            isinstance(xp, types.Array)
            and xp.ndim == 2
            and xp.dtype == types.uint32
            and isinstance(wp, types.Array)
            and wp.ndim == 2
            and wp.dtype == types.uint32
            and isinstance(out, types.Array)
            and out.ndim == 2
            and out.dtype == types.float32
        ):
            return None
        sig = types.void(xp, wp, types.int64, out, types.int64)

        def codegen(context, builder, sig, args):
            xt, wt, _, ot, _ = sig.args
            xv, wv, r0, ov, o0 = args
            xa = context.make_array(xt)(context, builder, xv)
            wa = context.make_array(wt)(context, builder, wv)
            oa = context.make_array(ot)(context, builder, ov)
            i64, vty, fma = _I64, _VTY, _fma(builder)
            dot = ir.InlineAsm(ir.FunctionType(vty, [_VI, _VI, vty]), "vdpbf16ps $2, $1, $0", "=v,v,v,0")

            def halves(v):  # a vector of pairs -> (odd elements, even elements) as float32
                return builder.bitcast(builder.and_(v, _HI), vty), builder.bitcast(builder.shl(v, _SH), vty)

            def body(k, acc):
                ws = [
                    builder.load(
                        builder.bitcast(
                            _ptr(context, builder, wa, wt, k, ir.Constant(i64, v * _LANES)), _VI.as_pointer()
                        ),
                        align=4,
                    )
                    for v in range(_VECS)
                ]
                if emulate:
                    ws = [halves(w) for w in ws]
                new = []
                for i, row in enumerate(acc):  # x's pair (an int32) in every lane
                    xb = _splat(
                        builder,
                        builder.load(_ptr(context, builder, xa, xt, builder.add(r0, ir.Constant(i64, i)), k)),
                        _VI,
                    )
                    if not emulate:
                        new.append([builder.call(dot, [xb, ws[v], row[v]]) for v in range(_VECS)])
                        continue
                    xo, xe = halves(xb)
                    new.append(
                        [
                            builder.call(fma, [xe, ws[v][1], builder.call(fma, [xo, ws[v][0], row[v]])])
                            for v in range(_VECS)
                        ]
                    )
                return new

            return _acc_loop(context, builder, cgutils.unpack_tuple(builder, xa.shape, 2)[1], R, body, (oa, ot, r0, o0))

        return sig, codegen

    return tile


pair1, pair2, pair3, pair4 = (_pair_tile(R) for R in (1, 2, 3, 4))
#: the emulated tiles whatever the CPU (tests compare them with the hardware's)
epair1, epair2, epair3, epair4 = (_pair_tile(R, emulate=True) for R in (1, 2, 3, 4))


# -- the KDA state passes ---------------------------------------------------------------------------
def _state_pass(V: int, update: bool):
    """The intrinsic of one KDA state pass over a head's ``[dk, dk]`` state, ``dk = 16 V``, with the
    ``dk`` accumulators in registers (:func:`~tandem.ops.cpu.kda._kda_rows` runs the same
    arithmetic as loops over arrays).

    ``update=False``: ``decay(src, dst, dec, kn, mem)``: ``dst[i] = src[i] * dec[i]`` and ``mem =
    sum_i dst[i] * kn[i]`` (``fma`` in ``i`` order from 0); ``src`` may be ``dst``.
    ``update=True``: ``update(dst, kn, qn, mem, o)``: ``dst[i] = fma(kn[i], mem, dst[i])`` and ``o = sum_i
    dst[i] * qn[i]`` (``fma`` in ``i`` order from 0). States ``[dk, dk]`` float32 (rows contiguous),
    vectors ``[dk]`` float32 C-contiguous; sizes unchecked."""

    @intrinsic
    def state_pass(typingctx, a, b, c, d, e):
        if not all(isinstance(t, types.Array) and t.dtype == types.float32 for t in (a, b, c, d, e)):
            return None
        sig = types.void(a, b, c, d, e)

        def codegen(context, builder, sig, args):
            arrs = [context.make_array(t)(context, builder, v) for t, v in zip(sig.args, args)]
            tys = sig.args
            i64, vty, zero, fma = _I64, _VTY, _ZERO, _fma(builder)

            def vec(k, v):  # vector v of the [dk] array k, as a pointer
                return builder.bitcast(builder.gep(arrs[k].data, [ir.Constant(i64, v * _LANES)]), vty.as_pointer())

            def splat(k, i):  # element i of the [dk] array k in every lane
                return _splat(builder, builder.load(builder.gep(arrs[k].data, [i])))

            if update:  # dst, kn, qn, mem, o; mem stays in registers
                mem = [builder.load(vec(3, v), align=4) for v in range(V)]
            n = ir.Constant(i64, V * _LANES)
            entry = builder.block
            loop = builder.append_basic_block("state.i")
            done = builder.append_basic_block("state.done")
            builder.branch(loop)
            builder.position_at_end(loop)
            i = builder.phi(i64)
            i.add_incoming(ir.Constant(i64, 0), entry)
            acc = [builder.phi(vty) for _ in range(V)]
            for x in acc:
                x.add_incoming(zero, entry)
            new = []
            if update:
                ki, qi = splat(1, i), splat(2, i)
                for v in range(V):
                    p = _vec_ptr(context, builder, arrs[0], tys[0], i, ir.Constant(i64, v * _LANES))
                    s = builder.call(fma, [ki, mem[v], builder.load(p, align=4)])
                    builder.store(s, p, align=4)
                    new.append(builder.call(fma, [s, qi, acc[v]]))
            else:
                di, ki = splat(2, i), splat(3, i)
                rows = [
                    builder.load(_vec_ptr(context, builder, arrs[0], tys[0], i, ir.Constant(i64, v * _LANES)), align=4)
                    for v in range(V)
                ]  # every load of the row before its stores (src may be dst)
                for v in range(V):
                    s = builder.fmul(rows[v], di)
                    builder.store(
                        s, _vec_ptr(context, builder, arrs[1], tys[1], i, ir.Constant(i64, v * _LANES)), align=4
                    )
                    new.append(builder.call(fma, [s, ki, acc[v]]))
            i1 = builder.add(i, ir.Constant(i64, 1))
            i.add_incoming(i1, loop)
            for x, y in zip(acc, new):
                x.add_incoming(y, loop)
            builder.cbranch(builder.icmp_signed("<", i1, n), loop, done)
            builder.position_at_end(done)
            for v, y in enumerate(new):  # mem (decay) or o (update): the last argument either way
                builder.store(y, vec(4, v), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return state_pass


#: the decay and update passes for dk = 16, 32, 48, 64, 128
decay1, decay2, decay3, decay4, decay8 = (_state_pass(V, False) for V in (1, 2, 3, 4, 8))
update1, update2, update3, update4, update8 = (_state_pass(V, True) for V in (1, 2, 3, 4, 8))


# -- the mHC mixing logits ----------------------------------------------------------------------------
_PAIR = ir.Constant(ir.VectorType(ir.IntType(32), _LANES), [0] * 8 + [1] * 8)


@intrinsic
def hc_mix8(typingctx, xs, r, fn_t, out):
    """The intrinsic ``hc_mix8(xs, r, fn_t, out)``: the mHC mixing logits' eight interleaved partial sums of row ``r``
    of ``xs [M, ND]`` against ``fn_t [ND, 8]`` (C-contiguous): ``out[0, 8k + o] = sum_b xs[r, 8b + k] * fn_t[8b + k, o]``
    over ``b < ND // 8`` in order from 0, a multiply then an add each (no fma), for ``k, o < 8`` (``out [1, 64]``
    float32): :func:`~tandem.ops.cpu.kernels._hc_weights`'s loop with its 64 accumulators in four registers."""
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32 for a in (xs, fn_t, out)):
        return None
    sig = types.void(xs, types.int64, fn_t, out)

    def codegen(context, builder, sig, args):
        xt, _, wt, ot = sig.args
        xv, r0, wv, ov = args
        xa, wa, oa = (context.make_array(t)(context, builder, v) for t, v in ((xt, xv), (wt, wv), (ot, ov)))
        i64 = _I64
        n = builder.sdiv(cgutils.unpack_tuple(builder, xa.shape, 2)[1], ir.Constant(i64, 8))

        def body(b, acc):
            new = []
            for v in range(4):  # inputs 8b + 2v and 8b + 2v + 1: their weight rows are 16 consecutive floats
                j = builder.add(builder.mul(b, ir.Constant(i64, 8)), ir.Constant(i64, 2 * v))
                w = builder.load(
                    builder.bitcast(_ptr(context, builder, wa, wt, j, ir.Constant(i64, 0)), _VTY.as_pointer()), align=4
                )
                x2 = ir.Constant(ir.VectorType(ir.FloatType(), 2), ir.Undefined)
                for h in range(2):
                    xe = builder.load(_ptr(context, builder, xa, xt, r0, builder.add(j, ir.Constant(i64, h))))
                    x2 = builder.insert_element(x2, xe, ir.Constant(ir.IntType(32), h))
                xb = builder.shuffle_vector(x2, ir.Constant(ir.VectorType(ir.FloatType(), 2), ir.Undefined), _PAIR)
                new.append(builder.fadd(acc[0][v], builder.fmul(xb, w)))
            return [new]

        return _acc_loop(context, builder, n, 1, body, (oa, ot, ir.Constant(i64, 0), ir.Constant(i64, 0)))

    return sig, codegen
