"""The bfloat16-pair GEMM on Intel AMX (AMX-BF16 ``tdpbf16ps``), where the CPU has it.

The serving GEMM on bfloat16 weights (:func:`~tandem.ops.cpu.gemm._mmp` over
:func:`~tandem.ops.cpu.pairs.pack_pairs`' strips) runs AVX512-BF16 dot products in register tiles of
four rows: its cost grows with the rows, so a verify block of 8 rows or a batch of 8 sessions costs
~2-4x one row. An AMX tile multiply takes up to 16 rows at once: ``tdpbf16ps`` adds ``A [m, 16 pairs]
x B [16 pairs, 16 columns]`` into a float32 tile ``C [m, 16]``, 8,192 multiply-adds an instruction,
and the weights reach it as tile loads of the same strip layout (a strip's ``D/2`` pair rows of 64
columns, 256 bytes apart). So the weight stream, not the arithmetic, sets the time at any row count up
to 16: a batch of sessions or a verify block costs about what one row does, while one row costs a little
more than on the AVX512-BF16 tiles (tile loads, and the core's power licence for the matrix unit).

**Row invariance.** A tile's row ``r`` depends only on row ``r`` of ``A`` and on ``B``: the same bits
for 1 to 16 rows, alone or among others (measured; ``tests/test_cpu_amx.py``), and every call walks
the input dimension in the same 16-pair chunks, so each row is bit-identical in any batch. The
hardware does not round after each product as ``vdpbf16ps``' chain does (Intel SDM's pseudocode):
its sums differ from that chain in the last bits and lie closer to the exact sum (median error half
the chain's on random inputs). So on a CPU with AMX every bfloat16-pair GEMM takes these tiles, one
row included; the columns past the last whole strip keep :func:`~tandem.ops.cpu.pairs._pair_tail`
(the same code for every row count, so still row-invariant). Denormal inputs and outputs flush to
zero, as in ``vdpbf16ps``.

**Use.** Linux lends a process the tile registers only after ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`` (kernel 5.16+): :data:`HW_AMX` is true when the CPU has AMX-BF16 and that
request succeeded at import. Each call loads its tile configuration (``ldtilecfg``: rows ``m`` of
``A`` and ``C``, a tail chunk when ``D/2`` is not a multiple of 16) and releases the tiles at the end
(``tilerelease``), so a thread switch between calls saves no tile state. The instructions are inline
assembly through numba intrinsics; numba's cache does not see edits here from the files that call
them: clear ``backend_src/tandem/ops/cpu/__pycache__`` after changing this file.
"""

from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import binding as llvm, ir
from numba import njit, types
from numba.extending import intrinsic

from .pairs import _pair_tail, bf16_pairs
from .tile import HW_BF16

_ARCH_GET_XCOMP_PERM, _ARCH_REQ_XCOMP_PERM, _XTILEDATA, _SYS_ARCH_PRCTL = 0x1022, 0x1023, 18, 158


def _request_tiles() -> bool:
    """Ask Linux for the AMX tile registers (per process, every thread); True when granted."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XTILEDATA) != 0:
            return False
        mask = ctypes.c_uint64(0)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0 and bool(
            mask.value >> _XTILEDATA & 1
        )
    except (OSError, AttributeError):
        return False


_FEATURES = llvm.get_host_cpu_features()
#: whether the bfloat16-pair GEMM runs on AMX tiles here (the CPU has AMX-BF16 and Linux lent the tiles)
HW_AMX = bool(_FEATURES.get("amx-bf16", False) and _FEATURES.get("amx-tile", False)) and _request_tiles()
if HW_AMX:
    llvm.initialize_native_asmparser()  # numba's code emitter needs it for inline assembly


def uses_amx(amx: bool) -> bool:
    """Whether bfloat16-pair GEMMs take the AMX tiles for the setting ``amx`` (the serving parameter, a
    model's :attr:`~tandem.ops.settings.KernelSettings.amx`): ``amx`` and :data:`HW_AMX`. AMX and
    AVX512-BF16 tiles are each row-invariant but their sums differ in the last bits, so a model packs its
    weights for one (:func:`~tandem.ops.cpu.gemm.kernel_weight`) and uses it for every row count."""
    return bool(amx) and HW_AMX


def gemm_tiles(amx: bool) -> str:
    """Which tiles bfloat16-pair GEMMs run on for the setting ``amx``: ``"AMX"``, ``"AVX512-BF16"`` or
    ``"fp32 FMA"`` (``vdpbf16ps``' chain emulated on a CPU without AVX512-BF16); for logs and reports."""
    return "AMX" if uses_amx(amx) else "AVX512-BF16" if HW_BF16 else "fp32 FMA"


#: rows of a tile (``A`` and ``C``), pairs of a chunk of the input dimension
ROWS, PAIRS = 16, 16
_A, _B, _AT, _BT = 4, 5, 6, 7  # tile registers: C tiles 0-3 (64 columns), A, B, the input tail's A and B


def _codegen(template: str, nargs: int):
    def codegen(context, builder, sig, args):
        fn = ir.FunctionType(ir.VoidType(), [ir.IntType(64)] * nargs)
        builder.call(ir.InlineAsm(fn, template, ",".join(["r"] * nargs + ["~{memory}"]), side_effect=True), list(args))
        return context.get_dummy_value()

    return codegen


def _op(template: str, nargs: int):
    """An intrinsic running ``template`` (AT&T inline assembly) on ``nargs`` int64 operands (byte
    addresses and strides), ordered against every memory access around it."""
    if nargs == 0:

        @intrinsic
        def op(typingctx):
            return types.void(), _codegen(template, 0)
    elif nargs == 2:

        @intrinsic
        def op(typingctx, address, stride):
            return types.void(types.int64, types.int64), _codegen(template, 2)
    else:

        @intrinsic
        def op(typingctx, a_address, a_stride, b_address, b_stride):
            return types.void(types.int64, types.int64, types.int64, types.int64), _codegen(template, 4)

    return op


@intrinsic
def _ldtilecfg(typingctx, address):
    return types.void(types.int64), _codegen("ldtilecfg ($0)", 1)


def _chunk(a: int, b: int):
    """``C_v += A x B_v`` for the four 16-column tiles ``v`` of a strip: ``A`` (tile ``a``) loaded from
    ``($0, stride $1)``, each ``B_v`` (tile ``b``) from ``64 v($2, stride $3)``."""
    steps = [f"tileloadd ($0,$1,1), %tmm{a}"]
    for v in range(4):
        steps += [f"tileloadd {64 * v}($2,$3,1), %tmm{b}", f"tdpbf16ps %tmm{b}, %tmm{a}, %tmm{v}"]
    return _op("\n".join(steps), 4)


_release = _op("tilerelease", 0)
_zero = _op("\n".join(f"tilezero %tmm{v}" for v in range(4)), 0)
_chunk_full, _chunk_tail = _chunk(_A, _B), _chunk(_AT, _BT)
_store = _op("\n".join(f"tilestored %tmm{v}, {64 * v}($0,$1,1)" for v in range(4)), 2)


def _configs() -> np.ndarray:
    """``[ROWS, PAIRS, 64]`` uint8: the tile configuration (palette 1) for ``m`` rows (index ``m - 1``) and
    an input tail of ``kr`` pairs: the C tiles and A ``m`` rows of 64 bytes, B 16 pair rows of 64
    bytes, and for ``kr > 0`` the tail's A (``m`` rows of ``4 kr`` bytes) and B (``kr`` rows)."""
    cfg = np.zeros((ROWS, PAIRS, 64), np.uint8)
    for m in range(1, ROWS + 1):
        for kr in range(PAIRS):
            c = cfg[m - 1, kr]
            c[0] = 1
            colsb, rows = c[16:48].view(np.uint16), c[48:64]
            colsb[:5], rows[:5] = 64, m
            colsb[_B], rows[_B] = 64, PAIRS
            if kr:
                colsb[_AT], rows[_AT] = 4 * kr, m
                colsb[_BT], rows[_BT] = 64, kr
    return cfg


_CFG = _configs()


@njit(cache=True, nogil=True)
def amx_strips(xp, strips, s0, s1, out):  # pragma: no cover - numba
    """``out[:, 64 (s - s0) + c] = bf16 pairs xp [M, K] @ strip s [K, 64]`` for strips ``s0 <= s < s1``
    of :func:`~tandem.ops.cpu.pairs.pack_pairs` (``strips [S, K, 64]`` uint32, each strip C-contiguous)
    on AMX tiles: rows in sixteens, the input dimension in chunks of 16 pairs (then its tail). ``xp``
    uint32 with contiguous rows; ``out`` float32 ``[M, >= 64 (s1 - s0)]`` with contiguous rows. Requires
    :data:`HW_AMX` (else the first tile instruction faults); indices unchecked."""
    M, K = xp.shape
    if M == 0 or s1 <= s0:
        return
    kr = K % PAIRS
    kf = K - kr
    xa, xs = xp.ctypes.data, xp.strides[0]
    wa, ws, wr = strips.ctypes.data, strips.strides[0], strips.strides[1]
    oa, os = out.ctypes.data, out.strides[0]
    r0 = 0
    while r0 < M:
        m = min(ROWS, M - r0)
        if r0 == 0 or m < ROWS:
            _ldtilecfg(_CFG[m - 1, kr].ctypes.data)
        xr = xa + r0 * xs
        for s in range(s0, s1):
            _zero()
            w = wa + s * ws
            for k in range(0, kf, PAIRS):
                _chunk_full(xr + 4 * k, xs, w + k * wr, wr)
            if kr:
                _chunk_tail(xr + 4 * kf, xs, w + kf * wr, wr)
            _store(oa + r0 * os + 256 * (s - s0), os)
        r0 += ROWS
    _release()


@njit(cache=True, nogil=True)
def amx_gemm(x, strips, tail, c0, c1, out):  # pragma: no cover - numba
    """``out [M, c1 - c0] = x [M, D] @ W[:, c0:c1]`` for ``W`` packed by
    :func:`~tandem.ops.cpu.pairs.pack_pairs` with its strips viewed as int32 (the type that routes
    :func:`~tandem.ops.cpu.gemm._mmp` here): ``x`` rounded to bfloat16 pairs, whole strips on the
    tiles, the columns past them by :func:`~tandem.ops.cpu.pairs._pair_tail`. ``c0 % 64 == 0``, ``c1``
    at a strip boundary or ``O`` (as :func:`~tandem.ops.cpu.gemm.mm_rows` checks)."""
    S = strips.shape[0]
    s0, s1 = c0 // 64, min(c1 // 64, S)
    xp = bf16_pairs(x)
    if s0 < s1:
        if out.strides[1] == 4:
            amx_strips(xp, strips, s0, s1, out)
        else:  # the tiles store rows of contiguous float32
            tmp = np.empty((x.shape[0], 64 * (s1 - s0)), np.float32)
            amx_strips(xp, strips, s0, s1, tmp)
            out[:, : tmp.shape[1]] = tmp
    done = max(s1 * 64, c0)
    if done < c1:
        _pair_tail(xp, tail, done - S * 64, c1 - S * 64, out, done - c0)
