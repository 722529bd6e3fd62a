"""Drafter block attention of the DFlash specs: every sequence's block of ``S`` queries attends,
non-causally, to that sequence's injected context K/V and then to the block's own ``S`` keys, for
all sequences in one launch.

Computes, per sequence ``j`` and head ``h`` (DFlash, Chen et al. 2026, arXiv:2602.06036, §3: block
queries over ``[context K/V, block K/V]``; the softmax attention of Vaswani et al. 2017, eq. 1)::

    o[h, jS + i] = softmax_c(q[h, jS + i] . [ctx_k_j ; k_j][h, c] * d^-0.5) @ [ctx_v_j ; v_j][h, c]

the list branch of :meth:`tandem.model.dflash.DFlashAttention.forward`, whose reference is
:func:`tandem.model.dflash.block_attention` (``F.scaled_dot_product_attention`` per sequence).

Shapes (``N`` sequences, ``S`` block rows each, ``R = N * S``, ``H`` heads, head dim ``d``):

* ``q``, ``k``, ``v``: ``[H, R, d]`` (any strides; :func:`block_attention` takes the model's
  ``[1, H, R, d]``): the sequences' blocks in turn;
* context ``ctx_k``, ``ctx_v``: ``[H, C_total, d]`` packed along the rows, sequence ``j`` at rows
  ``ctx_offsets[j] : ctx_offsets[j + 1]`` (``ctx_offsets`` int32 ``[N + 1]``, ragged, ``C_j = 0``
  allowed);
* output ``[H, R, d]`` in ``q``'s dtype (fp32, bf16 or fp16; softmax and accumulation in fp32).

Grid ``(N, H)``: one program per sequence and head holds its ``S`` queries (a ``BLOCK_S x BLOCK_D``
tile, padded to >= 16 for ``tl.dot``), streams the context in ``BLOCK_C``-row tiles with an online
softmax (running max / sum in the log2 domain, Milakov & Gimelshein 2018; FlashAttention, Dao et al.
2022), then folds in the block's own keys (all visible). Masks cover non-power-of-two ``H``, ``d``,
``S`` and the ragged context tails.

Limits: one program streams a sequence's whole context (no split along the context: for long
contexts and few sequences x heads the GPU is under-occupied); ``S <= 128`` and ``d <= 256`` (one
register tile); :func:`block_attention` packs the per-sequence context lists with one ``torch.cat``
(a copy of the context K/V per call); fp32 dot products use IEEE precision (no TF32). Under the
interpreter the tiles are upcast to fp32 before ``tl.dot`` (triton 3.7's interpreter returns garbage
for bf16 ``tl.dot``), so interpreted bf16 runs are more exact than compiled ones.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import interpreted

MAX_S, MAX_D = 128, 256


@triton.jit
def _online_step(q, kt, vt, valid, m_i, l_i, acc, qk_scale, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """One online-softmax step (Milakov & Gimelshein 2018): queries ``q [BLOCK_S, BLOCK_D]`` over a
    tile of keys ``kt [BLOCK_D, n]`` / values ``vt [n, BLOCK_D]`` whose columns ``valid [n]`` exist;
    running max ``m_i``, denominator ``l_i`` (log2 domain) and numerator ``acc``, updated."""
    if DOT_F32:
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=PREC) * qk_scale  # [BLOCK_S, n], log2 domain
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)


@triton.jit
def _block_attention_kernel(
    Q,
    K,
    V,
    CK,
    CV,
    OUT,
    CTX_OFF,
    sq_h,
    sq_r,
    sq_d,
    sk_h,
    sk_r,
    sk_d,
    sv_h,
    sv_r,
    sv_d,
    sck_h,
    sck_c,
    sck_d,
    scv_h,
    scv_c,
    scv_d,
    so_h,
    so_r,
    so_d,
    S,
    D,
    qk_scale,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    j = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    rs = tl.arange(0, BLOCK_S)
    rc = tl.arange(0, BLOCK_C)
    rd = tl.arange(0, BLOCK_D)
    ms, md = rs < S, rd < D
    rows = (j * S + rs).to(tl.int64)
    q = tl.load(Q + h * sq_h + rows[:, None] * sq_r + rd[None, :] * sq_d, mask=ms[:, None] & md[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_S], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    c0 = tl.load(CTX_OFF + j)
    c1 = tl.load(CTX_OFF + j + 1)
    for start in range(c0, c1, BLOCK_C):  # the context, in tiles (no iteration when C_j = 0)
        cols = (start + rc).to(tl.int64)
        mc = cols < c1
        kt = tl.load(
            CK + h * sck_h + cols[None, :] * sck_c + rd[:, None] * sck_d, mask=md[:, None] & mc[None, :], other=0.0
        )
        vt = tl.load(
            CV + h * scv_h + cols[:, None] * scv_c + rd[None, :] * scv_d, mask=mc[:, None] & md[None, :], other=0.0
        )
        m_i, l_i, acc = _online_step(q, kt, vt, mc, m_i, l_i, acc, qk_scale, PREC, DOT_F32)
    # the block's own S keys, all visible (at least one: the denominator is never 0)
    kt = tl.load(K + h * sk_h + rows[None, :] * sk_r + rd[:, None] * sk_d, mask=md[:, None] & ms[None, :], other=0.0)
    vb = tl.load(V + h * sv_h + rows[:, None] * sv_r + rd[None, :] * sv_d, mask=ms[:, None] & md[None, :], other=0.0)
    m_i, l_i, acc = _online_step(q, kt, vb, ms, m_i, l_i, acc, qk_scale, PREC, DOT_F32)
    o = acc / l_i[:, None]
    tl.store(
        OUT + h * so_h + rows[:, None] * so_r + rd[None, :] * so_d,
        o.to(OUT.dtype.element_ty),
        mask=ms[:, None] & md[None, :],
    )


def _tile(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def block_attention_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_offsets: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block attention over packed context K/V (see the module docstring).

    ``q``, ``k``, ``v [H, R, d]``; ``ctx_k``, ``ctx_v [H, C_total, d]``; ``ctx_offsets`` int32
    ``[N + 1]`` on the same device (``0 = off_0 <= off_1 <= .. <= off_N = C_total``, not checked
    on the device: no host sync); ``out`` optional ``[H, R, d]`` in ``q``'s dtype. Returns ``o
    [H, R, d]``. Raises ``ValueError`` on shapes, dtypes or devices that disagree, ``R`` not a
    multiple of ``N``, ``S > 128`` or ``d > 256``."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must be one [H, R, d] shape, got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    H, R, d = q.shape
    if ctx_k.dim() != 3 or ctx_k.shape != ctx_v.shape or ctx_k.shape[0] != H or ctx_k.shape[2] != d:
        raise ValueError(f"ctx_k, ctx_v must be [H={H}, C, d={d}], got {list(ctx_k.shape)}, {list(ctx_v.shape)}")
    if ctx_offsets.dim() != 1 or ctx_offsets.numel() < 2 or ctx_offsets.dtype != torch.int32:
        raise ValueError(
            f"ctx_offsets must be int32 [N + 1] with N >= 1, got {ctx_offsets.dtype} {list(ctx_offsets.shape)}"
        )
    N = ctx_offsets.numel() - 1
    if R % N:
        raise ValueError(f"{R} block rows do not split into {N} equal blocks")
    S = R // N
    if S > MAX_S or d > MAX_D:
        raise ValueError(f"block attention handles S <= {MAX_S}, d <= {MAX_D}; got S={S}, d={d}")
    ts = {t.dtype for t in (q, k, v, ctx_k, ctx_v)}
    if len(ts) != 1 or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"q, k, v, ctx_k, ctx_v must share one float dtype (fp32/bf16/fp16), got {sorted(map(str, ts))}"
        )
    if len({t.device for t in (q, k, v, ctx_k, ctx_v, ctx_offsets)}) != 1:
        raise ValueError("q, k, v, ctx_k, ctx_v and ctx_offsets must be on one device")
    o = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if o.shape != q.shape or o.dtype != q.dtype or o.device != q.device:
        raise ValueError(
            f"out must be [H, R, d] = {list(q.shape)} {q.dtype} on {q.device}, got {list(o.shape)} {o.dtype}"
        )
    if ctx_k.shape[1] == 0:  # no context rows at all: any valid pointer (never read)
        ctx_k, ctx_v = k, v
    BLOCK_D = _tile(d)
    _block_attention_kernel[(N, H)](
        q,
        k,
        v,
        ctx_k,
        ctx_v,
        o,
        ctx_offsets,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *ctx_k.stride(),
        *ctx_v.stride(),
        *o.stride(),
        S,
        d,
        d**-0.5 * math.log2(math.e),
        BLOCK_S=_tile(S),
        BLOCK_C=64 if BLOCK_D <= 64 else 32,
        BLOCK_D=BLOCK_D,
        PREC="ieee" if q.dtype == torch.float32 else None,
        DOT_F32=interpreted(),
        num_warps=4,
    )
    return o


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor]
) -> torch.Tensor:
    """The list branch of :meth:`tandem.model.dflash.DFlashAttention.forward` before ``o_proj``
    (same arguments and result as :func:`tandem.model.dflash.block_attention`).

    ``q``, ``k``, ``v [1, H, N * S, d]``: the ``N = len(ctx_k)`` sequences' blocks in turn;
    ``ctx_k[j]``, ``ctx_v[j] [1, H, C_j, d]`` (``C_j >= 0``). Returns ``o [1, H, N * S, d]`` in
    ``q``'s dtype, stored row-major as ``[1, N * S, H, d]`` (so ``o.transpose(1, 2)`` is contiguous).
    Raises ``ValueError`` on mismatched lists or shapes (and as :func:`block_attention_packed`)."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be [1, H, N * S, d], got {list(q.shape)}")
    if not ctx_k or len(ctx_k) != len(ctx_v):
        raise ValueError(f"ctx_k and ctx_v must be lists of one length >= 1, got {len(ctx_k)} and {len(ctx_v)}")
    _, H, R, d = q.shape
    for j, (ck, cv) in enumerate(zip(ctx_k, ctx_v)):
        if ck.dim() != 4 or ck.shape[0] != 1 or ck.shape != cv.shape or ck.shape[1] != H or ck.shape[3] != d:
            raise ValueError(
                f"context {j}: ctx_k, ctx_v must be [1, H={H}, C, d={d}], got {list(ck.shape)}, {list(cv.shape)}"
            )
    lens = [ck.shape[2] for ck in ctx_k]
    offs = [0]
    for c in lens:
        offs.append(offs[-1] + c)
    pk = torch.cat([ck[0] for ck in ctx_k], 1) if len(ctx_k) > 1 else ctx_k[0][0]
    pv = torch.cat([cv[0] for cv in ctx_v], 1) if len(ctx_v) > 1 else ctx_v[0][0]
    off = torch.tensor(offs, dtype=torch.int32).to(q.device, non_blocking=True)
    out = torch.empty((R, H, d), dtype=q.dtype, device=q.device).transpose(0, 1)
    return block_attention_packed(q[0], k[0], v[0], pk, pv, off, out=out).unsqueeze(0)


#: the launchers the engine's hooks call (tests count their calls)
ENGINE_LAUNCHERS = ("block_attention",)
