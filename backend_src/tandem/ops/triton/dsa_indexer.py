"""DSA indexer on the GPU: k-pool scoring and top-k pool selection for ragged query rows.

For query row ``r`` of sequence ``b`` at absolute position ``p`` (GLM-5's DSA with k-pool
compression; definition in :mod:`tandem.model.mla`, DeepSeek-V3.2 §2.1 for the indexer score):

* candidates: the first ``n_c = min((p + 1) // kp, P_b)`` pools (complete, ending at or before ``p``);
* score ``s_j = sum_h (iw_h Hi^-1/2) relu(iq_h . pk_j di^-1/2)`` (fp32);
* the ``k_pools`` best candidates, ties toward the earlier pool (a stable descending sort), plus the
  incomplete tail ``[floor((p + 1) / kp) kp, p]``, are visible.

Shapes: ``iq [R, Hi, di]``, ``iw [R, Hi]`` (any float dtype), per sequence ``pk [P_b, di]`` (rows
contiguous); results ``pools [R, k_pools]`` int64 (the selected pool ids ascending, ``-1`` padding
when ``n_c < k_pools``) and the visibility mask ``[R, max L_b]`` bool (False past a row's ``L_b``).
Reference: :func:`tandem.model.mla.select_pools` of :func:`tandem.model.mla.pool_scores`; :func:`mask`
has its arguments and result, and gives the same selection bit for bit on the same scores (the
scores are summed in another order, so on the GPU a near-tie within fp32 rounding may resolve
differently).

Kernels: ``_scores`` (grid ``R x cdiv(max P_b, BLOCK_P)``) computes a ``[Hi, BLOCK_P]`` block of
``iq . pk`` with one fp32 ``tl.dot`` (ieee precision), reduces over heads and stores each score's
order-preserving int32 key (``-0.0`` as ``+0.0``: equal, as in torch's sort) in a scratch
``[R, max P_b]``. ``_select`` (grid ``R``) finds, where ``n_c > k_pools``, the ``k_pools``-th
largest key exactly, bit by bit (32 counting passes over the row's candidates), then
keeps the keys above it and the earliest ones equal to it (a running cumsum), writing the ids in
ascending order and the mask (the selected pools and the tail). Per row ``O(32 n_c)``, no sort.
Each sequence's pool keys are read in place through a table of their addresses (no packing copy;
they are cast to fp32 first when stored in another dtype). Limits: ``Hi <= 128``, ``di <= 256``
(one tile each), ``kp`` a power of two; NaN scores are not supported.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

#: the launchers the engine calls (:mod:`tandem.model.mla`; tests count their calls)
ENGINE_LAUNCHERS = ("mask", "select_rows")


@triton.jit
def _scores(
    iq_ptr,
    iw_ptr,
    pk_tab,
    npool_ptr,
    seq_ptr,
    pos_ptr,
    key_ptr,
    key_stride,
    HI,
    DI,
    q_scale,
    w_scale,
    KP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * BLOCK_P
    b = tl.load(seq_ptr + r)
    n_c = tl.minimum((tl.load(pos_ptr + r) + 1) // KP, tl.load(npool_ptr + b))
    if j0 < n_c:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        j = j0 + tl.arange(0, BLOCK_P)
        hm, dm = h < HI, d < DI
        q = tl.load(iq_ptr + r * HI * DI + h[:, None] * DI + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
        pk = tl.load(pk_tab + b).to(tl.pointer_type(tl.float32))
        k = tl.load(pk + j[:, None] * DI + d[None, :], mask=(j < n_c)[:, None] & dm[None, :], other=0.0)
        dots = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_P]
        w = tl.load(iw_ptr + r * HI + h, mask=hm, other=0.0).to(tl.float32) * w_scale
        s = tl.sum(w[:, None] * tl.maximum(dots * q_scale, 0.0), axis=0)
        # the score's order-preserving int32 key: -0.0 -> +0.0, negative floats' bits reversed
        bits = s.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483647 - 1, 0, bits)
        tl.store(key_ptr + r * key_stride + j, tl.where(bits < 0, bits ^ 2147483647, bits), mask=j < n_c)


@triton.jit
def _select(
    key_ptr,
    key_stride,
    npool_ptr,
    seq_ptr,
    pos_ptr,
    len_ptr,
    ids_ptr,
    mask_ptr,
    m_stride,
    K,
    KP: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    b = tl.load(seq_ptr + r)
    p = tl.load(pos_ptr + r)
    n_c = tl.minimum((p + 1) // KP, tl.load(npool_ptr + b))
    krow = key_ptr + r * key_stride
    offs = tl.arange(0, BLOCK_P)
    lowest = -2147483647 - 1  # below every real score's key (it is a NaN's)
    # thr: the largest t with #{key >= t} >= K, i.e. the K-th largest key (lowest when n_c <= K)
    thr = (p * 0).to(tl.int64) + lowest
    if n_c > K:
        step = thr * 0 + 2147483648
        for _ in range(32):
            trial = thr + step
            cnt = 0
            for j0 in range(0, n_c, BLOCK_P):
                key = tl.load(krow + j0 + offs, mask=j0 + offs < n_c, other=lowest)
                cnt += tl.sum((key >= trial).to(tl.int32), axis=0)
            thr = tl.where(cnt >= K, trial, thr)
            step = step // 2
    n_gt = 0
    for j0 in range(0, n_c, BLOCK_P):
        key = tl.load(krow + j0 + offs, mask=j0 + offs < n_c, other=lowest)
        n_gt += tl.sum((key > thr).to(tl.int32), axis=0)
    need = K - n_gt  # how many of the keys equal to thr are kept: the earliest
    n_eq = 0
    n_sel = 0
    kk = tl.arange(0, KP)
    for j0 in range(0, n_c, BLOCK_P):
        j = j0 + offs
        key = tl.load(krow + j, mask=j < n_c, other=lowest)
        eq = ((key == thr) & (j < n_c)).to(tl.int32)
        sel = ((key > thr) | ((eq != 0) & (n_eq + tl.cumsum(eq, axis=0) - eq < need))) & (j < n_c)
        si = sel.to(tl.int32)
        slot = n_sel + tl.cumsum(si, axis=0) - si
        tl.store(ids_ptr + r * K + slot, j.to(tl.int64), mask=sel)
        tok = j[:, None] * KP + kk[None, :]
        tl.store(mask_ptr + r * m_stride + tok, tl.full([BLOCK_P, KP], 1, tl.int8), mask=sel[:, None])
        n_eq += tl.sum(eq, axis=0)
        n_sel += tl.sum(si, axis=0)
    tail = ((p + 1) // KP) * KP + kk
    tail_ok = (tail <= p) & (tail < tl.load(len_ptr + b))
    tl.store(mask_ptr + r * m_stride + tail, tl.full([KP], 1, tl.int8), mask=tail_ok)


def select_rows(
    iq: torch.Tensor,
    iw: torch.Tensor,
    pks: list[torch.Tensor],
    lengths: list[int],
    pos: torch.Tensor,
    kv_lens: list[int],
    kp: int,
    k_pools: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DSA selection of ragged rows: ``iq [R, Hi, di]``, ``iw [R, Hi]`` hold sequence ``b``'s
    ``lengths[b]`` rows in turn, at absolute positions ``pos [R]`` (int);
    ``pks[b] [P_b, di]`` its pool keys (fp32 or not: cast), ``kv_lens[b]`` its cache length.
    Returns ``pools [R, k_pools]`` int64 (ascending, ``-1`` padded) and ``mask [R, max kv_lens]``
    bool. Raises ``ValueError`` on inconsistent shapes or sizes beyond the limits."""
    R, HI, DI = iq.shape
    if iw.shape != (R, HI) or pos.shape != (R,) or sum(lengths) != R or not len(pks) == len(lengths) == len(kv_lens):
        raise ValueError(
            f"select_rows: iq {tuple(iq.shape)}, iw {tuple(iw.shape)}, pos {tuple(pos.shape)}, "
            f"lengths {lengths}, {len(pks)} pool-key tensors, {len(kv_lens)} kv lengths disagree"
        )
    if HI > 128 or DI > 256 or k_pools < 1 or kp < 1 or kp & (kp - 1):
        raise ValueError(
            f"select_rows supports Hi <= 128, di <= 256, k_pools >= 1, kp a power of two; "
            f"got Hi={HI}, di={DI}, k_pools={k_pools}, kp={kp}"
        )
    dev = iq.device
    if any(t.dim() != 2 or t.shape[1] != DI for t in pks):
        raise ValueError(f"pool keys must be [P_b, di={DI}], got {[tuple(t.shape) for t in pks]}")
    npools = [t.shape[0] for t in pks]
    if any(n * kp > L for n, L in zip(npools, kv_lens)):
        raise ValueError(f"more pools than the caches hold: P_b {npools}, kp={kp}, kv_lens {kv_lens}")
    p_max = max(npools, default=0)
    B = len(pks)
    pks = [t.float().contiguous() if t.shape[0] else iq.new_zeros(1, DI, dtype=torch.float32) for t in pks]
    # one host-to-device copy: per sequence its pool keys' address, pool count and cache length; per row its sequence
    meta = torch.tensor(
        [t.data_ptr() for t in pks] + npools + list(kv_lens) + [b for b, n in enumerate(lengths) for _ in range(n)],
        dtype=torch.int64,
    ).to(dev)
    table, npool, lens, seq = meta[:B], meta[B : 2 * B], meta[2 * B : 3 * B], meta[3 * B :]
    pos = pos.to(dev, torch.int32).contiguous()
    iq, iw = iq.contiguous(), iw.contiguous()
    keys = torch.empty(R, max(p_max, 1), dtype=torch.int32, device=dev)
    ids = torch.full((R, k_pools), -1, dtype=torch.int64, device=dev)
    mask = torch.zeros(R, max(max(kv_lens, default=0), 1), dtype=torch.int8, device=dev)
    if R == 0:
        return ids, mask[:, : max(kv_lens, default=0)].bool()
    bp = 32
    if p_max:
        _scores[(R, triton.cdiv(p_max, bp))](
            iq,
            iw,
            table,
            npool,
            seq,
            pos,
            keys,
            keys.stride(0),
            HI,
            DI,
            DI**-0.5,
            HI**-0.5,
            KP=kp,
            BLOCK_H=max(16, triton.next_power_of_2(HI)),
            BLOCK_D=max(16, triton.next_power_of_2(DI)),
            BLOCK_P=bp,
        )
    _select[(R,)](keys, keys.stride(0), npool, seq, pos, lens, ids, mask, mask.stride(0), k_pools, KP=kp, BLOCK_P=128)
    return ids, mask[:, : max(kv_lens, default=0)].view(torch.bool)


def mask(
    iq: torch.Tensor, iw: torch.Tensor, pk: torch.Tensor, q_pos: torch.Tensor, kv_len: int, kp: int, k_pools: int
) -> torch.Tensor:
    """Same arguments and result as ``select_pools(pool_scores(iq, iw, pk), q_pos, kv_len, kp, k_pools)``
    (:mod:`tandem.model.mla`): ``iq [B, T, Hi, di]``, ``iw [B, T, Hi]``, ``pk [B, P, di]``, ``q_pos [T]``
    -> visibility mask ``[B, T, kv_len]`` bool. Raises ``ValueError`` as :func:`select_rows`."""
    B, T, HI, DI = iq.shape
    if q_pos.shape != (T,) or pk.shape[0] != B:
        raise ValueError(f"mask: iq {tuple(iq.shape)}, pk {tuple(pk.shape)}, q_pos {tuple(q_pos.shape)} disagree")
    _, m = select_rows(
        iq.reshape(B * T, HI, DI),
        iw.reshape(B * T, HI),
        list(pk.unbind(0)),
        [T] * B,
        q_pos.to(iq.device).repeat(B),
        [kv_len] * B,
        kp,
        k_pools,
    )
    return m.view(B, T, kv_len)
