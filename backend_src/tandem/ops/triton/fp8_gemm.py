"""Block-scaled FP8 GEMM on the GPU: ``y = x @ W^T`` for a weight stored as GLM-5.3-Flash's release stores it.

``W [N, K]`` is ``float8_e4m3fn`` with ``scale_inv [ceil(N / bn), ceil(K / bk)]`` float32, one per ``bn x bk``
block (128 x 128 in the release; :mod:`tandem.ops.fp8`): ``W = w_fp8 * scale_inv`` per block. The kernel
reads the FP8 bytes (a quarter of fp32's, half of bf16's: decoding is weight-streaming, so the weight read is
the time), decodes them in registers and applies each block's scale to its partial sums:
``y[m, n] = sum_kb scale_inv[n // bn, kb] * sum_{k in kb} x[m, k] w[n, k]``, in fp32. Reference:
:func:`reference` (dequantize with :func:`tandem.ops.fp8.dequantize`, then ``x @ W^T``); the sums are taken
in another order, so the two agree to fp32 rounding (``tests/test_kernels_fp8.py``).

Shapes: ``x [M, K]`` (fp32, bf16 or fp16; rows contiguous), ``w [N, K]`` ``float8_e4m3fn`` (or its ``uint8``
bytes), ``scale_inv`` as above; ``y [M, N]`` in ``x``'s dtype. Kernel ``_gemm``: grid ``cdiv(M, BLOCK_M) x
cdiv(N, BLOCK_N)``, a ``BLOCK_K`` step that divides ``bk`` (so one scale per row of the tile and step), masked
tails in every dimension. Limits: ``bk`` a multiple of 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import dequantize
from . import interpreted

#: the launchers the engine calls
ENGINE_LAUNCHERS = ("fp8_linear",)


@triton.jit
def _gemm(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    SN,
    SK,
    BN_SCALE: tl.constexpr,
    BK_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, nm = m < M, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mm[:, None] & km[None, :], other=0.0).to(tl.float32)
        wb = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :], other=0)
        w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s = tl.load(s_ptr + (n // BN_SCALE) * SK + k0 // BK_SCALE, mask=nm, other=0.0)
        if IEEE:
            part = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            part = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        acc += part * s[None, :]
    tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x [..., K] @ W^T`` for the block-scaled FP8 ``W [N, K]`` (see the module text) -> ``[..., N]`` in ``x``'s
    dtype. bf16 / fp16 ``x``: the products on bf16 tensor cores (fp32 sums); fp32 ``x``, or under Triton's
    interpreter: fp32 products (IEEE).
    Raises ``ValueError`` naming a shape, dtype or block that does not fit."""
    N, K = w.shape
    bn, bk = block
    if x.shape[-1] != K:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} columns, the weight {K}")
    if w.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"fp8_linear: the weight must be float8_e4m3fn (or its uint8 bytes), got {w.dtype}")
    want = (triton.cdiv(N, bn), triton.cdiv(K, bk))
    if tuple(scale_inv.shape) != want or scale_inv.dtype != torch.float32:
        raise ValueError(
            f"fp8_linear: scale_inv must be float32 {list(want)} for a [{N}, {K}] weight in {bn}x{bk} blocks, "
            f"got {scale_inv.dtype} {list(scale_inv.shape)}"
        )
    if bk % 16:
        raise ValueError(f"fp8_linear: the scale block's columns ({bk}) must be a multiple of 16")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    interp = interpreted()  # small tiles; fp32 products (the interpreter's bf16 tl.dot is wrong, docs/gpu-kernels.md)
    BLOCK_K = 64 if bk % 64 == 0 else 32 if bk % 32 == 0 else 16  # divides bk: one scale per step
    BLOCK_M = 16 if interp else max(16, min(64, triton.next_power_of_2(M)))
    BLOCK_N = 32 if interp else 64
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _gemm[grid](
        x2,
        w.contiguous().view(torch.uint8),
        scale_inv.contiguous(),
        y,
        M,
        N,
        K,
        want[0],
        want[1],
        BN_SCALE=bn,
        BK_SCALE=bk,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        IEEE=x.dtype == torch.float32 or interp,
    )
    return y.reshape(*lead, N)


def reference(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """:func:`fp8_linear` as torch: the weight dequantized (:func:`tandem.ops.fp8.dequantize`), then ``x @
    W^T`` in fp32, returned in ``x``'s dtype."""
    W = dequantize(w.view(torch.float8_e4m3fn), scale_inv, block)
    return (x.float() @ W.t()).to(x.dtype)
