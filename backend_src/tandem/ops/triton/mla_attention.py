"""DSA-selected MLA attention on the GPU: ragged query rows over their sequences' KV caches.

For query row ``r`` of sequence ``b`` and head ``h``:
``o[r, h] = softmax_j(q[r, h] . K_b[h, j] * scaling | mask[r, j]) @ V_b[h]``, the softmax taken over
the tokens ``j < L_b`` the DSA visibility mask allows (:mod:`tandem.ops.triton.dsa_indexer`: the
selected k-pools and the incomplete tail, causal by construction). Reference:
:func:`tandem.model.mla.masked_attention` (the torch branch of ``MLAttention._heads_out``); :func:`attention`
has its arguments and result.

Shapes: ``q [R, H, dqk]``; per sequence ``K_b [H, L_b, dqk]``, ``V_b [H, L_b, dv]`` (any head
stride, tokens and features contiguous: the :class:`~tandem.model.cache.MLACache` buffers, read in
place through a table of their addresses); ``mask [R, max L_b]`` bool; result ``[R, H, dv]`` in
``q``'s dtype. fp32 inputs use ieee-precision dots (tight agreement with torch); bf16 / fp16
inputs use tensor-core dots with fp32 accumulation on the GPU, fp32 dots in the interpreter (whose
bf16 ``tl.dot`` is wrong in triton 3.7).

This attends over the expanded per-head K / V that tandem's cache keeps beside the latent, which is
what the engine has. The absorbed-latent form (attending over ``latent [L, r]`` with ``kv_b_proj``
folded into the query and the output, so a 512-wide latent row serves every head) is the
GPU-memory-optimal alternative; it is not done here.

Grid ``(tiles, H)``: a tile is up to ``BLOCK_T = 16`` consecutive rows of one sequence (a verify
block of k + 1 <= 16 rows is one tile; longer prefill blocks are split), so the rows share every K
/ V block they load. The program walks the sequence's cache in blocks of ``BLOCK_N`` tokens with an
online softmax (FlashAttention-2, Dao 2023), skipping the blocks that no row of the tile sees (the
unselected pools). Limits: ``dqk, dv <= 256``; no split over the context (one program per tile and
head reads the whole selection); a row that sees no token gets zeros (torch gives NaN).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from . import interpreted

#: the launchers the engine calls (:mod:`tandem.model.mla`; tests count their calls)
ENGINE_LAUNCHERS = ("attention", "attend_rows")
BLOCK_T = 16


@triton.jit
def _attend(
    q_ptr,
    k_tab,
    v_tab,
    kh_tab,
    vh_tab,
    len_ptr,
    mask_ptr,
    m_stride,
    o_ptr,
    t_seq,
    t_row,
    t_n,
    H,
    DQK,
    DV,
    scaling,
    k_ref,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DQ: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(t_seq + tile)
    r0 = tl.load(t_row + tile)
    nt = tl.load(t_n + tile)
    L = tl.load(len_ptr + b)
    kb = tl.load(k_tab + b).to(k_ref.dtype) + h * tl.load(kh_tab + b)
    vb = tl.load(v_tab + b).to(k_ref.dtype) + h * tl.load(vh_tab + b)
    t = tl.arange(0, BLOCK_T)
    rows = r0 + t
    tm = t < nt
    dq = tl.arange(0, BLOCK_DQ)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + rows[:, None] * (H * DQK) + h * DQK + dq[None, :], mask=tm[:, None] & (dq < DQK)[None, :], other=0.0
    )
    m_i = tl.full([BLOCK_T], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_DV], tl.float32)
    for n0 in range(0, L, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < L
        vis = tl.load(mask_ptr + rows[:, None] * m_stride + n[None, :], mask=tm[:, None] & nm[None, :], other=0) != 0
        if tl.max(vis.to(tl.int32)) > 0:  # some row of the tile sees a token of this block
            k = tl.load(kb + n[:, None] * DQK + dq[None, :], mask=nm[:, None] & (dq < DQK)[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q.to(k.dtype), tl.trans(k))
            s = tl.where(vis, s * scaling, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            v = tl.load(vb + n[:, None] * DV + dv[None, :], mask=nm[:, None] & (dv < DV)[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(pr, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
            m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + rows[:, None] * (H * DV) + h * DV + dv[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=tm[:, None] & (dv < DV)[None, :],
    )


def _check_cache(name: str, ts: list[torch.Tensor], H: int, d: int, dtype: torch.dtype) -> None:
    for t in ts:
        if (
            t.dim() != 3
            or t.shape[0] != H
            or t.shape[2] != d
            or t.dtype != dtype
            or t.stride(2) != 1
            or (t.shape[1] > 1 and t.stride(1) != d)
        ):
            raise ValueError(
                f"attend_rows: {name} must be [H={H}, L_b, {d}] {dtype} with tokens and features "
                f"contiguous, got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
            )


def attend_rows(
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    mask: torch.Tensor,
    lengths: list[int],
    scaling: float,
) -> torch.Tensor:
    """Attention of ragged rows: ``q [R, H, dqk]`` holds sequence ``b``'s ``lengths[b]`` rows in turn;
    ``ks[b] [H, L_b, dqk]``, ``vs[b] [H, L_b, dv]`` its cache (``q``'s dtype); ``mask [R, >= max L_b]``
    bool the visibility (columns past ``L_b`` ignored). Returns ``[R, H, dv]`` in ``q``'s dtype.
    Raises ``ValueError`` on inconsistent shapes, dtypes or layouts, or head dims over 256."""
    R, H, DQK = q.shape
    if sum(lengths) != R or len(ks) != len(lengths) or len(vs) != len(lengths) or not ks:
        raise ValueError(
            f"attend_rows: q {tuple(q.shape)}, lengths {lengths}, {len(ks)} K and {len(vs)} V caches disagree"
        )
    DV = vs[0].shape[-1]
    _check_cache("K", ks, H, DQK, q.dtype)
    _check_cache("V", vs, H, DV, q.dtype)
    l_max = max(t.shape[1] for t in ks)
    if (
        any(k.shape[1] != v.shape[1] for k, v in zip(ks, vs))
        or mask.dim() != 2
        or mask.shape[0] != R
        or mask.shape[1] < l_max
        or mask.dtype != torch.bool
    ):
        raise ValueError(f"attend_rows: K / V lengths or mask {tuple(mask.shape)} {mask.dtype} disagree")
    if DQK > 256 or DV > 256:
        raise ValueError(f"attend_rows supports head dims <= 256, got dqk={DQK}, dv={DV}")
    dev = q.device
    out = torch.empty(R, H, DV, dtype=q.dtype, device=dev)
    tiles = [
        (b, r0 + i, min(BLOCK_T, n - i))
        for b, (n, r0) in enumerate(zip(lengths, _starts(lengths)))
        for i in range(0, n, BLOCK_T)
    ]
    if not tiles:
        return out
    # one host-to-device copy for the per-sequence table (K / V addresses, head strides, lengths) and the tiles
    B, n_t = len(ks), len(tiles)
    meta = torch.tensor(
        [t.data_ptr() for t in ks]
        + [t.data_ptr() for t in vs]
        + [t.stride(0) for t in ks]
        + [t.stride(0) for t in vs]
        + [t.shape[1] for t in ks]
        + [x for c in zip(*tiles) for x in c],
        dtype=torch.int64,
    ).to(dev)
    seqs, tl_ = meta[: 5 * B].view(5, B), meta[5 * B :].view(3, n_t)
    mask = mask.contiguous()
    _attend[(n_t, H)](
        q.contiguous(),
        seqs[0],
        seqs[1],
        seqs[2],
        seqs[3],
        seqs[4],
        mask.view(torch.int8),
        mask.stride(0),
        out,
        tl_[0],
        tl_[1],
        tl_[2],
        H,
        DQK,
        DV,
        scaling,
        ks[0],
        BLOCK_T=BLOCK_T,
        BLOCK_N=32,
        BLOCK_DQ=max(16, triton.next_power_of_2(DQK)),
        BLOCK_DV=max(16, triton.next_power_of_2(DV)),
        IEEE=q.dtype == torch.float32 or interpreted(),
    )
    return out


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t [B, H, L, d]`` itself when its tokens and features are contiguous (any batch / head stride), else a copy."""
    return t if t.stride(-1) == 1 and (t.shape[-2] < 2 or t.stride(-2) == t.shape[-1]) else t.contiguous()


def _starts(lengths: list[int]) -> list[int]:
    out, s = [], 0
    for n in lengths:
        out.append(s)
        s += n
    return out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Same arguments and result as :func:`tandem.model.mla.masked_attention`: ``q [B, H, T, dqk]``,
    ``k [B, H, L, dqk]``, ``v [B, H, L, dv]``, ``mask [B, T, L]`` bool -> ``[B, H, T, dv]``.
    Raises ``ValueError`` as :func:`attend_rows`."""
    B, H, T, DQK = q.shape
    if k.shape[:2] != (B, H) or mask.shape != (B, T, k.shape[2]):
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, mask {tuple(mask.shape)} disagree")
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    o = attend_rows(
        q.transpose(1, 2).reshape(B * T, H, DQK),
        list(k.unbind(0)),
        list(v.unbind(0)),
        mask.reshape(B * T, -1),
        [T] * B,
        scaling,
    )
    return o.view(B, T, H, -1).transpose(1, 2)
