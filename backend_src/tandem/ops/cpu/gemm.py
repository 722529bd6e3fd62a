"""Row-invariant matrix products for the verify hot path (numba, float32, no autograd).

A BLAS picks its kernel by the number of rows: MKL on this fleet's AMD EPYC machines sums a row
differently at M >= 4 than at M <= 3 (and on Intel at M = 1 than at M >= 2), so the same row's
logits differ in the last bits alone (plain decoding), inside a verify block of k+1 rows, or in a
batch of sessions (the M=1 vs M=k+1 batch-invariance gap; vLLM's batch-invariance RFC). Here every
output element is one fixed sequence of float32 fused multiply-adds over the input dimension,
``out[r, j] = fma(x[r, D-1], w[D-1, j], ... fma(x[r, 0], w[0, j], 0))``, whatever the number of
rows, their position or their neighbours: a row is bit-identical in any batch by construction, on
any CPU. The serving parameter ``batch_invariant`` routes the trunk's verify passes here
(:attr:`~tandem.ops.settings.KernelSettings.rows`); the reference is ``x @ w.T`` (``tests/test_cpu_gemm.py``).

It is also faster than MKL for these few-row shapes. Rows go in fours with the input dimension in
steps of 4 (one accumulator load and store per 4 fmas, every operand in a register), the last three as
four with a zero row, or the last two or one in one block with steps of 8 (a weight slice is read once
per block). For two or more rows, whole 64-column strips take the register tiles of
:mod:`~tandem.ops.cpu.tile` instead (accumulators in registers over the whole input dimension; the
same fma chain, so the same bits).

Serving's weights are strip-packed (:func:`kernel_weight`, :func:`pack_strips`): each 64-column strip
``[D, 64]`` one contiguous run, read front to back by the tiles for every row count (:func:`_mmp`);
unpacked, the reads come in pieces the hardware prefetchers do not follow, and a weight that does not
stay in the cache streams at a fraction of the memory bandwidth.

bfloat16 weights with an even input dimension (the shipped checkpoint's) are packed as bfloat16 pairs
by default (:func:`~tandem.ops.cpu.pairs.pack_pairs`): the GEMM rounds its input rows to bfloat16 and
runs AVX512-BF16 dot products with float32 accumulation, about twice the float32 tiles' rate (a bf16
GEMM's numerics, one fixed chain per element, so as row-invariant as the float32 path), or on a CPU with
AMX its tiles (:mod:`~tandem.ops.cpu.amx`, a model's ``amx`` setting: the strips viewed as int32). A model
loaded with ``gemm_inputs="fp32"`` (:class:`~tandem.ops.settings.KernelSettings`) keeps the float32 inputs.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
import numba
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..settings import DEFAULT, KernelSettings
from .amx import amx_gemm, uses_amx
from .pairs import _pair_tail, _pair_tiles, bf16_pairs, pack_pairs
from .tile import TILE, _f32, tile1, tile2, tile3, tile4

#: columns per block: four rows' accumulators (4 x 2 KB) and eight weight rows' slices stay in L1
_BLOCK = 512


@njit(cache=True, nogil=True, inline="always")
def _w8(wt, k, wc, n):  # pragma: no cover - numba
    # weight rows k .. k+7, columns wc .. wc+n
    return (
        wt[k, wc : wc + n],
        wt[k + 1, wc : wc + n],
        wt[k + 2, wc : wc + n],
        wt[k + 3, wc : wc + n],
        wt[k + 4, wc : wc + n],
        wt[k + 5, wc : wc + n],
        wt[k + 6, wc : wc + n],
        wt[k + 7, wc : wc + n],
    )


@njit(cache=True, nogil=True, inline="always")
def _x8(x, r, k):  # pragma: no cover - numba
    return x[r, k], x[r, k + 1], x[r, k + 2], x[r, k + 3], x[r, k + 4], x[r, k + 5], x[r, k + 6], x[r, k + 7]


@njit(cache=True, nogil=True, inline="always")
def _w4(wt, k, wc, n):  # pragma: no cover - numba
    # weight rows k .. k+3, columns wc .. wc+n
    return wt[k, wc : wc + n], wt[k + 1, wc : wc + n], wt[k + 2, wc : wc + n], wt[k + 3, wc : wc + n]


@njit(cache=True, nogil=True, inline="always")
def _x4(x, r, k):  # pragma: no cover - numba
    return x[r, k], x[r, k + 1], x[r, k + 2], x[r, k + 3]


@njit(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy", boundscheck=False)
def _rows4(x, wt, r, wc, o0, n, out):  # pragma: no cover - numba
    # rows r .. r+3, columns o0 .. o0+n of out (wt's from wc): k in steps of 4 (the 16 inputs, four
    # weight rows and four accumulators stay in registers: with steps of 8 the 32 inputs spilled and
    # the loop ran on loads, 1.2-2x slower), then one at a time
    a0, a1, a2, a3 = out[r, o0 : o0 + n], out[r + 1, o0 : o0 + n], out[r + 2, o0 : o0 + n], out[r + 3, o0 : o0 + n]
    a0[:] = 0.0
    a1[:] = 0.0
    a2[:] = 0.0
    a3[:] = 0.0  # noqa: E702
    D = x.shape[1]
    for k in range(0, D - D % 4, 4):
        w0, w1, w2, w3 = _w4(wt, k, wc, n)
        x00, x01, x02, x03 = _x4(x, r, k)
        x10, x11, x12, x13 = _x4(x, r + 1, k)
        x20, x21, x22, x23 = _x4(x, r + 2, k)
        x30, x31, x32, x33 = _x4(x, r + 3, k)
        for j in range(n):
            v0, v1, v2, v3 = _f32(w0[j]), _f32(w1[j]), _f32(w2[j]), _f32(w3[j])
            a0[j] = a0[j] + x00 * v0 + x01 * v1 + x02 * v2 + x03 * v3
            a1[j] = a1[j] + x10 * v0 + x11 * v1 + x12 * v2 + x13 * v3
            a2[j] = a2[j] + x20 * v0 + x21 * v1 + x22 * v2 + x23 * v3
            a3[j] = a3[j] + x30 * v0 + x31 * v1 + x32 * v2 + x33 * v3
    for k in range(D - D % 4, D):
        w = wt[k, wc : wc + n]
        x0, x1, x2, x3 = x[r, k], x[r + 1, k], x[r + 2, k], x[r + 3, k]
        for j in range(n):
            a0[j] += x0 * _f32(w[j])
            a1[j] += x1 * _f32(w[j])
            a2[j] += x2 * _f32(w[j])
            a3[j] += x3 * _f32(w[j])


@njit(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy", boundscheck=False)
def _rows2(x, wt, r, wc, o0, n, out):  # pragma: no cover - numba
    # rows r .. r+1, columns o0 .. o0+n of out (wt's from wc): k in steps of 8, then one at a time
    a0, a1 = out[r, o0 : o0 + n], out[r + 1, o0 : o0 + n]
    a0[:] = 0.0
    a1[:] = 0.0  # noqa: E702
    D = x.shape[1]
    for k in range(0, D - D % 8, 8):
        w0, w1, w2, w3, w4, w5, w6, w7 = _w8(wt, k, wc, n)
        x00, x01, x02, x03, x04, x05, x06, x07 = _x8(x, r, k)
        x10, x11, x12, x13, x14, x15, x16, x17 = _x8(x, r + 1, k)
        for j in range(n):
            a0[j] = (
                a0[j]
                + x00 * _f32(w0[j])
                + x01 * _f32(w1[j])
                + x02 * _f32(w2[j])
                + x03 * _f32(w3[j])
                + x04 * _f32(w4[j])
                + x05 * _f32(w5[j])
                + x06 * _f32(w6[j])
                + x07 * _f32(w7[j])
            )
            a1[j] = (
                a1[j]
                + x10 * _f32(w0[j])
                + x11 * _f32(w1[j])
                + x12 * _f32(w2[j])
                + x13 * _f32(w3[j])
                + x14 * _f32(w4[j])
                + x15 * _f32(w5[j])
                + x16 * _f32(w6[j])
                + x17 * _f32(w7[j])
            )
    for k in range(D - D % 8, D):
        w = wt[k, wc : wc + n]
        x0, x1 = x[r, k], x[r + 1, k]
        for j in range(n):
            a0[j] += x0 * _f32(w[j])
            a1[j] += x1 * _f32(w[j])


@njit(cache=True, nogil=True, fastmath={"contract"}, error_model="numpy", boundscheck=False)
def _rows1(x, wt, r, wc, o0, n, out):  # pragma: no cover - numba
    # rows r .. r+0, columns o0 .. o0+n of out (wt's from wc): k in steps of 8, then one at a time
    a0 = out[r, o0 : o0 + n]
    a0[:] = 0.0  # noqa: E702
    D = x.shape[1]
    for k in range(0, D - D % 8, 8):
        w0, w1, w2, w3, w4, w5, w6, w7 = _w8(wt, k, wc, n)
        x00, x01, x02, x03, x04, x05, x06, x07 = _x8(x, r, k)
        for j in range(n):
            a0[j] = (
                a0[j]
                + x00 * _f32(w0[j])
                + x01 * _f32(w1[j])
                + x02 * _f32(w2[j])
                + x03 * _f32(w3[j])
                + x04 * _f32(w4[j])
                + x05 * _f32(w5[j])
                + x06 * _f32(w6[j])
                + x07 * _f32(w7[j])
            )
    for k in range(D - D % 8, D):
        w = wt[k, wc : wc + n]
        x0 = x[r, k]
        for j in range(n):
            a0[j] += x0 * _f32(w[j])


@njit(cache=True, nogil=True)
def _mm(x, wt, c0, c1, out):  # pragma: no cover - numba
    # out [M, c1 - c0] = x [M, D] @ wt[:, c0:c1]: for M >= 2 the register tiles of tile.py over
    # whole 64-column strips (a strip's weights read once for all rows), the rest as _mm_blocked;
    # one row as _mm_blocked (it streams the weights in longer runs: ~1.5x faster for the LM head)
    M = x.shape[0]
    n = c1 - c0
    nt = n - n % TILE if M >= 2 else 0
    for j in range(0, nt, TILE):
        r = 0
        while r + 4 <= M:
            tile4(x, wt, r, c0 + j, out, j)
            r += 4
        if M - r == 3:
            tile3(x, wt, r, c0 + j, out, j)
        elif M - r == 2:
            tile2(x, wt, r, c0 + j, out, j)
        elif M - r == 1:
            tile1(x, wt, r, c0 + j, out, j)
    if nt < n:
        _mm_blocked(x, wt, c0 + nt, c1, out, nt)


@njit(cache=True, nogil=True)
def _mm_blocked(x, wt, c0, c1, out, oc):  # pragma: no cover - numba
    # out[:, oc: oc + c1 - c0] = x [M, D] @ wt[:, c0:c1], wt [D, O] C-contiguous, by column blocks; rows in
    # fours, then the last three (padded to four), two or one in one block: every element is the same fma chain over k in order whichever
    # block computes it (k in steps of 4 or 8 chains the fmas in the same order: a + x0*w0 + x1*w1 ...)
    M = x.shape[0]
    p = 4 if M % 4 == 3 else 0  # rows of the padded block (none unless three are left)
    pad, pad_out = np.zeros((p, x.shape[1]), x.dtype), np.empty((p, _BLOCK), np.float32)
    if M % 4 == 3:
        pad[:3] = x[M - 3 :]
    for o0 in range(0, c1 - c0, _BLOCK):
        n = min(_BLOCK, c1 - c0 - o0)
        r = 0
        while r + 4 <= M:
            _rows4(x, wt, r, c0 + o0, oc + o0, n, out)
            r += 4
        if r + 3 == M:  # the last three rows as four (a zero row): the weight slice is read once
            _rows4(pad, wt, 0, c0 + o0, 0, n, pad_out)
            out[r:, oc + o0 : oc + o0 + n] = pad_out[:3, :n]
        elif r + 2 == M:
            _rows2(x, wt, r, c0 + o0, oc + o0, n, out)
        elif r < M:
            _rows1(x, wt, r, c0 + o0, oc + o0, n, out)


@njit(cache=True, nogil=True)
def _tiles(x, w, out, j):  # pragma: no cover - numba
    # out[:, j:j+64] = x [M, D] @ w [D, 64] (one strip of a packed weight): rows in fours, then the last three, two or one
    M = x.shape[0]
    r = 0
    while r + 4 <= M:
        tile4(x, w, r, 0, out, j)
        r += 4
    if M - r == 3:
        tile3(x, w, r, 0, out, j)
    elif M - r == 2:
        tile2(x, w, r, 0, out, j)
    elif M - r == 1:
        tile1(x, w, r, 0, out, j)


@njit(cache=True, nogil=True)
def cols(pw):  # pragma: no cover - numba
    """The output width ``O`` of a strip-packed weight (:func:`pack_strips`)."""
    return pw[0].shape[-3] * TILE + pw[1].shape[-1]


def _strips_gemm(x, strips, tail, c0, c1, out):  # pragma: no cover - numba (typed by _packed_gemm)
    raise NotImplementedError


def _strips_impl(x, strips, tail, c0, c1, out):  # pragma: no cover - numba
    S = strips.shape[0]
    s1 = min(c1 // TILE, S)
    for s in range(c0 // TILE, s1):
        _tiles(x, strips[s], out, s * TILE - c0)
    done = max(s1 * TILE, c0)
    if done < c1:
        _mm_blocked(x, tail, done - S * TILE, c1 - S * TILE, out, done - c0)


def _pairs_impl(x, strips, tail, c0, c1, out):  # pragma: no cover - numba
    S = strips.shape[0]
    s1 = min(c1 // TILE, S)
    xp = bf16_pairs(x)
    for s in range(c0 // TILE, s1):
        _pair_tiles(xp, strips[s], out, s * TILE - c0)
    done = max(s1 * TILE, c0)
    if done < c1:
        _pair_tail(xp, tail, done - S * TILE, c1 - S * TILE, out, done - c0)


def _amx_impl(x, strips, tail, c0, c1, out):  # pragma: no cover - numba (an @overload returns a Python function)
    amx_gemm(x, strips, tail, c0, c1, out)


@overload(_strips_gemm)
def _packed_gemm(x, strips, tail, c0, c1, out):  # pragma: no cover - numba
    # _mmp's body for float32 / bfloat16-bit strips (pack_strips), bfloat16 pairs (pack_pairs: uint32) or
    # the same pairs for the AMX tiles (int32: kernel_weight with the AMX tiles)
    if strips.dtype == types.int32:
        return _amx_impl
    return _pairs_impl if strips.dtype == types.uint32 else _strips_impl


numba.get_num_threads()  # starts numba's threading layer, which registers the symbol _threads calls


@intrinsic
def _threads(typingctx):
    """numba's thread count for the calling thread (``numba.set_num_threads``, a thread's own), read
    from the threading layer's ``get_num_threads`` by name, as numba's parallel loops do (unlike
    ``numba.get_num_threads`` in compiled code, a function that calls this can be cached)."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []), "get_num_threads")
        return builder.call(fn, [])

    return types.int64(), codegen


#: the least ``rows x input x output`` multiply-adds a GEMM splits its columns across threads for: below
#: it the threads' start and join (about 2 us with OpenMP here) cost more than half the work saves
#: (one thread, bf16 pairs: ``[1, 256] x [256, 768]`` 4.5 us alone, 4.2 split in two; ``[1, 256] x [256,
#: 1536]`` 9.6 and 6.1; ``[8, 256] x [256, 768]`` 14.7 and 9.4)
SPLIT_WORK = 1 << 18


@njit(cache=True, nogil=True, parallel=True)
def _mmp_split(x, pw, c0, c1, out, n):  # pragma: no cover - numba
    # _mmp's columns in n runs of whole strips (the last run also the tail), one a thread: each output
    # element the same chain as alone, so the same bits
    strips, tail = pw
    S = (c1 - c0) // TILE
    for t in prange(n):
        a = c0 + (S * t // n) * TILE
        b = c1 if t == n - 1 else c0 + (S * (t + 1) // n) * TILE
        if b > a:
            _strips_gemm(x, strips, tail, a, b, out[:, a - c0 :])


@njit(cache=True, nogil=True)
def _mmp(x, pw, c0, c1, out):  # pragma: no cover - numba
    # out [M, c1 - c0] = x [M, D] @ W[:, c0:c1] for W packed (pack_strips or pack_pairs): each whole
    # 64-column strip by the register tiles, its weights one contiguous run (the hardware prefetchers
    # stream it: 2-3x the bandwidth of _mm's strided reads once the weights outgrow the cache), the tail
    # columns by _mm_blocked (pairs: _pair_tail); c0 % 64 == 0 and c1 at a strip boundary or O (mm_rows
    # checks). Strips: the same fma chain per element as _mm, so the same bits; pairs: x rounded to
    # bfloat16 first, then the pair tiles' chain. With numba's threads for this thread above one
    # (numba.set_num_threads, groups.run_groups) and SPLIT_WORK or more, the columns split across them
    strips, tail = pw
    n = min(_threads(), (c1 - c0) // TILE)
    if n > 1 and x.shape[0] * x.shape[1] * (c1 - c0) >= SPLIT_WORK:
        _mmp_split(x, pw, c0, c1, out, n)
    else:
        _strips_gemm(x, strips, tail, c0, c1, out)


def pack_strips(wt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``wt [..., D, O]`` (float32 or bfloat16 bits, :func:`kernel_weight`'s layout) strip-packed:
    ``(strips [..., O // 64, D, 64], tail [..., D, O % 64])``, each C-contiguous, so a 64-column strip
    of the weight is one contiguous run of ``D * 64`` elements, read front to back by :func:`_mmp`."""
    *lead, D, n_out = wt.shape
    S = n_out // TILE
    strips = np.ascontiguousarray(np.swapaxes(wt[..., : S * TILE].reshape(*lead, D, S, TILE), -3, -2))
    return strips, np.ascontiguousarray(wt[..., S * TILE :])


def mm_rows(x: np.ndarray, wt, c0: int = 0, c1: int | None = None) -> np.ndarray:
    """``x [M, D] @ W[:, c0:c1]`` float32, each row bit-identical for any M; ``W [D, O]`` C-contiguous
    (float32 or the uint16 bits of bfloat16 values) or strip-packed (:func:`pack_strips`, as
    :func:`kernel_weight` makes it; then ``c0`` must be a multiple of 64 and ``c1`` one or ``O``).
    Returns a new ``[M, c1 - c0]`` float32 array. Raises ``ValueError`` for a packed range off the strips."""
    packed = isinstance(wt, tuple)
    n_out = cols(wt) if packed else wt.shape[1]
    c1 = n_out if c1 is None else c1
    if packed and (c0 % TILE or (c1 % TILE and c1 != n_out)):
        raise ValueError(f"a packed weight's columns go in strips of {TILE}: got {c0}..{c1} of {n_out}")
    out = np.empty((x.shape[0], c1 - c0), np.float32)
    (_mmp if packed else _mm)(np.ascontiguousarray(x), wt, c0, c1, out)
    return out


def is_bf16(pw) -> bool:
    """Whether a kernel weight (packed or not) holds bfloat16 bits."""
    return (pw[0] if isinstance(pw, tuple) else pw).dtype in (np.uint16, np.uint32, np.int32)


_W: dict[tuple, tuple] = {}


def kernel_weight(
    w: torch.Tensor, kernels: KernelSettings, transpose: bool = True, experts: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The packed array pair (:func:`pack_pairs` or :func:`pack_strips`) the kernels read for the fp32 weight ``w``:
    of ``w.t()`` (``[D, O]`` from an input-major ``[O, D]``), or with ``transpose=False`` of ``w``
    itself (e.g. experts' ``[E, I, D]``), or with ``experts=E`` of ``w.t()`` split into ``E`` column
    groups ``[E, D, O / E]`` (each expert's gate | up rows); as the uint16 bits of bfloat16 when every
    value is exactly a bfloat16 (the shipped weights are bf16 upcast to fp32: half the bytes to stream
    from memory, the same products bit for bit), else float32. bfloat16 weights with an even input
    dimension come as bfloat16 pairs (:func:`pack_pairs`: the GEMM rounds its input rows to bfloat16,
    bf16 x bf16 products accumulated in float32, ~2x the fp32 tiles' speed; on AMX tiles when
    ``kernels.amx`` and the CPU has them) unless ``kernels.gemm_inputs`` is ``"fp32"``. Made once per
    weight tensor, layout and settings (again after an in-place change: ``_version``); ``w`` must outlive
    its use (parameters and the serving layout's fused buffers)."""
    inputs, amx = kernels.gemm_inputs, uses_amx(kernels.amx)
    key = (id(w), transpose, experts, inputs, amx)
    hit = _W.get(key)
    if hit is not None and hit[0] is w and hit[1] == (w.data_ptr(), w._version):
        return hit[2]
    t = (w.detach().t() if transpose else w.detach()).contiguous()
    if experts:
        t = t.view(t.shape[0], experts, -1).transpose(0, 1)
    b = t.to(torch.bfloat16)
    arr = b.view(torch.int16).numpy().view(np.uint16) if torch.equal(b.float(), t) else t.contiguous().numpy()
    if len(_W) > 4096:  # not a cache of temporaries
        _W.clear()
    pairs = arr.dtype == np.uint16 and arr.shape[-2] % 2 == 0 and inputs == "bf16"
    packed = (pack_pairs if pairs else pack_strips)(arr)
    if pairs and amx:  # the same bits as int32: _mmp takes the AMX tiles
        packed = (packed[0].view(np.int32), packed[1])
    _W[key] = (w, (w.data_ptr(), w._version), packed)
    return packed


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, kernels: KernelSettings = DEFAULT
) -> torch.Tensor:
    """``F.linear(x [..., D], w [O, D], b)``; in the row-invariant mode (``kernels.rows``), for CPU float32
    rows with the numba kernels on for ``kernels`` (:meth:`~tandem.ops.settings.KernelSettings.numba_on`), the row-invariant
    kernel on :func:`kernel_weight`'s array. Returns ``[..., O]``."""
    if kernels.rows and x.dtype == torch.float32 == w.dtype and kernels.numba_on(x):
        y = torch.from_numpy(mm_rows(x.reshape(-1, x.shape[-1]).numpy(), kernel_weight(w, kernels))).view(
            *x.shape[:-1], w.shape[0]
        )
        return y if b is None else y + b
    return F.linear(x, w, b)


class ServingLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`linear` (the serving layout's class; same parameters)."""

    #: the model's settings (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels)
