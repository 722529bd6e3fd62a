"""Fused speculative sampler and accept walk for a ragged batch of verify / decode rows (Triton).

Two kernels, each beside the engine's pure-torch / numpy reference:

* :func:`targets_and_gaps` — every row's target token and top-2 logit gap, one program per row over
  the vocabulary in ``BLOCK_V`` tiles. Reference: :func:`tandem.engine.sampling.targets_and_gaps`
  (greedy: ``logits.topk(2)``; sampled: :func:`~tandem.engine.sampling.row_targets`). Greedy rows
  take the argmax (first index of the maximum). Sampled rows apply the request's transform
  (temperature, top-k with ties at the k-th value kept, top-p) and then, per the mode of
  :mod:`tandem.engine.sampling`: rejection sampling with one-hot drafts (Leviathan et al. 2023,
  Alg. 1: accept draft ``x`` when ``u_accept < p(x)``, else draw from ``p`` with ``x`` removed;
  the bonus row draws from ``p``) or coupled Gumbel-max (``argmax log p + G``). The sampling
  arithmetic is float64, as the reference's.
* :func:`accept_walk` — per walk the accepted draft count, tokens emitted and finish code, one
  program per walk. Reference: :func:`tandem.engine.accept.accept_walk` (stop ids, budget).

Noise is bit-identical to the reference: numpy's Philox4x64-10 (Salmon et al. 2011; constants of
Random123) with key ``(seed, purpose)`` and counter ``(1 + j // 4, position, 0, 0)`` for the
stream's ``j``-th uniform (numpy increments the counter before each 4-word block), the uniform
being ``(word >> 11) * 2**-53`` (``Generator.random``). The 64x64 -> 128-bit products are built
from 32-bit halves, so the kernel needs no wide-multiply intrinsic.

Top-k and top-p thresholds are found by bisection over the orderable integer keys of the float32
logits (32 steps each), so the kept set is exact, not approximated: top-k keeps keys >= the k-th
largest; top-p keeps the smallest most-likely set of mass >= ``top_p``. Tokens whose logits tie
exactly at the top-p boundary are all kept (the reference's stable sort keeps the earlier ones) —
a measure-zero event for real logits. Limits: vocabulary < 2**31, walks of <= ``MAX_WALK`` rows.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ... import schema
from ..noise import ACCEPT, BONUS, GUMBEL, RESIDUAL

GREEDY_ROW, REJECTION_ROW, COUPLED_ROW, SKIP_ROW = 0, 1, 2, 3  # per-row modes of the row kernel
FINISH_CODES = (None, "stop", "length")  # accept kernel's finish codes 0, 1, 2
MAX_WALK = 32  # rows per walk (k + 1) the accept kernel takes
BLOCK_V = 1024
_ACCEPT, _RESIDUAL, _BONUS, _GUMBEL = (tl.constexpr(c) for c in (ACCEPT, RESIDUAL, BONUS, GUMBEL))


@triton.jit
def _mulhilo(a, b):
    """High and low 64 bits of the 128-bit product of uint64 ``a`` and ``b``."""
    al = a & 0xFFFFFFFF
    ah = a >> 32
    bl = b & 0xFFFFFFFF
    bh = b >> 32
    hl = ah * bl
    lh = al * bh
    cross = ((al * bl) >> 32) + (hl & 0xFFFFFFFF) + (lh & 0xFFFFFFFF)
    return ah * bh + (hl >> 32) + (lh >> 32) + (cross >> 32), a * b


@triton.jit
def _uniform(seed, position, purpose: tl.constexpr, j):
    """float64 uniforms in [0, 1): element ``j`` (uint64 tensor) of the (seed, position, purpose) stream."""
    z = j * 0
    c0 = j // 4 + 1
    c1 = z + position.to(tl.uint64)
    c2 = z
    c3 = z
    k0 = z + seed.to(tl.uint64)
    k1 = z + purpose
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + 0x9E3779B97F4A7C15
            k1 = k1 + 0xBB67AE8584CAA73B
        h0, l0 = _mulhilo(z + 0xD2E7470EE14C6C93, c0)
        h1, l1 = _mulhilo(z + 0xCA5A826395121157, c2)
        c0, c1, c2, c3 = h1 ^ c1 ^ k0, l1, h0 ^ c3 ^ k1, l0
    w = tl.where(j % 4 == 0, c0, tl.where(j % 4 == 1, c1, tl.where(j % 4 == 2, c2, c3)))
    return (w >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)


@triton.jit(do_not_specialize=["seed", "position"])  # an int argument equal to 1 would become a constant
def _uniforms_kernel(out, seed, position, n, PURPOSE: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + j, _uniform(seed, position, PURPOSE, j.to(tl.uint64)), mask=j < n)


def uniforms(seed: int, position: int, purpose: int, n: int = 1, device: str | torch.device = "cpu") -> torch.Tensor:
    """``n`` float64 uniforms of the (``seed``, ``position``, ``purpose``) stream computed by the kernels'
    Philox, ``[n]`` on ``device``: bit-identical to :func:`tandem.engine.sampling.uniforms`."""
    out = torch.empty(n, dtype=torch.float64, device=device)
    if n:
        _uniforms_kernel[(triton.cdiv(n, 256),)](out, seed, position, n, PURPOSE=purpose, BLOCK=256)
    return out


@triton.jit
def _key(x):
    """Orderable int64 keys of float32 ``x`` (a < b as floats iff key(a) < key(b); -0.0 is +0.0,
    equal as floats)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def _count_at_least(base, V, t, offs, BLOCK: tl.constexpr):
    n = tl.zeros((), tl.int64)
    for s in range(0, V, BLOCK):
        ok = s + offs < V
        x = tl.load(base + s + offs, mask=ok, other=0.0)
        n += tl.sum((ok & (_key(x) >= t)).to(tl.int64), 0)
    return n


@triton.jit
def _mass_at_least(base, V, t, zmax, temp, offs, BLOCK: tl.constexpr):
    m = tl.zeros((), tl.float64)
    for s in range(0, V, BLOCK):
        ok = s + offs < V
        x = tl.load(base + s + offs, mask=ok, other=0.0)
        e = tl.exp((x.to(tl.float64) - zmax) / temp)
        m += tl.sum(tl.where(ok & (_key(x) >= t), e, 0.0), 0)
    return m


@triton.jit
def _rows_kernel(
    logits, stride, V, temp_p, topk_p, topp_p, seed_p, mode_p, pos_p, draft_p, tgt_p, gap_p, BLOCK: tl.constexpr
):
    r = tl.program_id(0)
    base = logits + r.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    m1 = tl.full((), float("-inf"), tl.float32)
    m2 = tl.full((), float("-inf"), tl.float32)
    i1 = tl.zeros((), tl.int64)
    for s in range(0, V, BLOCK):  # top-2 of the row
        x = tl.load(base + s + offs, mask=s + offs < V, other=float("-inf"))
        b1 = tl.max(x, 0)
        bi = tl.argmax(x, 0)
        b2 = tl.max(tl.where(offs == bi, float("-inf"), x), 0)
        up = b1 > m1
        m2 = tl.where(up, tl.maximum(m1, b2), tl.maximum(m2, b1))
        i1 = tl.where(up, s + bi.to(tl.int64), i1)
        m1 = tl.where(up, b1, m1)
    tl.store(gap_p + r, m1 - m2)
    mode = tl.load(mode_p + r)
    target = tl.where(mode == 3, 0, i1)  # SKIP_ROW: a prime row not sampled
    if (mode == 1) | (mode == 2):
        temp = tl.load(temp_p + r)
        kk = tl.load(topk_p + r).to(tl.int64)
        pp = tl.load(topp_p + r)
        seed = tl.load(seed_p + r)
        pos = tl.load(pos_p + r)
        zmax = m1.to(tl.float64)
        lo = tl.full((), -2147483648, tl.int64)  # kept: key >= lo
        if (kk > 0) & (kk < V):  # the largest key t with count(key >= t) >= k: the k-th largest logit
            hi = tl.full((), 2147483647, tl.int64)
            for _ in range(33):
                mid = lo + (hi - lo + 1) // 2
                ok = _count_at_least(base, V, mid, offs, BLOCK) >= kk
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
        if pp < 1.0:  # the largest key t whose kept mass reaches top_p: the smallest top set of mass >= top_p
            need = pp * _mass_at_least(base, V, lo, zmax, temp, offs, BLOCK)
            hi = tl.full((), 2147483647, tl.int64)
            for _ in range(33):
                mid = lo + (hi - lo + 1) // 2
                ok = _mass_at_least(base, V, mid, zmax, temp, offs, BLOCK) >= need
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
        if mode == 2:  # coupled: argmax over kept tokens of z - log(-log g)
            best = tl.full((), float("-inf"), tl.float64)
            for s in range(0, V, BLOCK):
                ok = s + offs < V
                x = tl.load(base + s + offs, mask=ok, other=0.0)
                g = _uniform(seed, pos, _GUMBEL, (s + offs).to(tl.uint64))
                sc = tl.where(
                    ok & (_key(x) >= lo), (x.to(tl.float64) - zmax) / temp - tl.log(-tl.log(g)), float("-inf")
                )
                bb = tl.max(sc, 0)
                bj = tl.argmax(sc, 0)
                target = tl.where(bb > best, s + bj.to(tl.int64), target)
                best = tl.maximum(best, bb)
        else:  # rejection with a one-hot draft (draft >= 0) or the bonus draw from p (draft < 0)
            draft = tl.load(draft_p + r)
            j0 = tl.zeros((), tl.uint64)
            total = _mass_at_least(base, V, lo, zmax, temp, offs, BLOCK)
            excl = tl.full((), -1, tl.int64)
            u = _uniform(seed, pos, _BONUS, j0)
            accepted = tl.zeros((), tl.int1)
            if draft >= 0:
                xd = tl.load(base + draft)
                pd = tl.where(_key(xd) >= lo, tl.exp((xd.to(tl.float64) - zmax) / temp), 0.0)
                accepted = _uniform(seed, pos, _ACCEPT, j0) < pd / total
                target = tl.where(accepted, draft, target)
                excl = draft
                total = total - pd
                u = _uniform(seed, pos, _RESIDUAL, j0)
            if accepted == 0:  # inverse CDF: the first token whose cumulative weight exceeds u * total
                want = u * total
                carry = tl.zeros((), tl.float64)
                cnt = tl.zeros((), tl.int64)
                for s in range(0, V, BLOCK):
                    ok = s + offs < V
                    x = tl.load(base + s + offs, mask=ok, other=0.0)
                    keep = ok & (_key(x) >= lo) & (s + offs != excl)
                    w = tl.where(keep, tl.exp((x.to(tl.float64) - zmax) / temp), 0.0)
                    cdf = carry + tl.cumsum(w, 0)
                    cnt += tl.sum((ok & (cdf <= want)).to(tl.int64), 0)
                    carry += tl.sum(w, 0)
                target = tl.minimum(cnt, V - 1)
    tl.store(tgt_p + r, target)


def _row_params(lengths: list[int], samplers: list | None, device) -> list[torch.Tensor]:
    """Per-row kernel parameters (temperature, top_k, top_p, seed, mode, position, draft) of
    :func:`targets_and_gaps`'s ``samplers`` (greedy rows: mode 0, the rest unused)."""
    R = sum(lengths)
    if not samplers or not any(samplers):  # all greedy: only the modes (0) are read, made on the device
        z = torch.zeros(R, dtype=torch.int32, device=device)
        return [z.double(), z, z.double(), z.long(), z, z.long(), z.long()]
    temp, topp = np.ones(R), np.ones(R)
    topk, mode = np.zeros(R, np.int32), np.zeros(R, np.int32)
    seed, pos, draft = np.zeros(R, np.int64), np.zeros(R, np.int64), np.full(R, -1, np.int64)
    off = 0
    for n, smp in zip(lengths, samplers):
        if smp is not None:
            p, tokens, pos0, last_only = smp
            assert not p.greedy
            sl = slice(off, off + n)
            temp[sl], topk[sl], topp[sl], seed[sl] = p.temperature, p.top_k, p.top_p, p.seed
            pos[sl] = pos0 + 1 + np.arange(n)
            if p.mode == schema.COUPLED:
                mode[sl] = COUPLED_ROW
            else:
                mode[sl] = REJECTION_ROW
                if not last_only:
                    draft[off : off + n - 1] = np.asarray(tokens[1:n], np.int64)
            if last_only:
                mode[off : off + n - 1] = SKIP_ROW
        off += n
    cuda = torch.device(device).type == "cuda"
    return [torch.from_numpy(a).to(device, non_blocking=cuda) for a in (temp, topk, topp, seed, mode, pos, draft)]


def targets_and_gaps(
    logits: torch.Tensor, lengths: list[int], samplers: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets ``[R]`` int64 and top-2 gaps ``[R]`` float32 of ``logits [R, V]`` (float32), whose rows
    are the walks' rows in turn (``lengths``); ``samplers`` as for
    :func:`tandem.engine.sampling.targets_and_gaps` (per walk None = greedy, or ``(params, row
    tokens, position of row 0, last row only)``). Raises ``ValueError`` for mismatched shapes."""
    if logits.dim() != 2 or sum(lengths) != logits.shape[0]:
        raise ValueError(f"logits must be [sum(lengths)={sum(lengths)}, V], got {tuple(logits.shape)}")
    if samplers is not None and len(samplers) != len(lengths):
        raise ValueError(f"samplers: one per walk ({len(lengths)}), got {len(samplers)}")
    R, V = logits.shape
    logits = logits.float().contiguous()
    params = _row_params(lengths, samplers, logits.device)
    target = torch.empty(R, dtype=torch.int64, device=logits.device)
    gap = torch.empty(R, dtype=torch.float32, device=logits.device)
    if R:
        _rows_kernel[(R,)](
            logits, logits.stride(0), V, *params, target, gap, BLOCK=min(BLOCK_V, triton.next_power_of_2(V))
        )
    return target, gap


@triton.jit
def _walk_kernel(tgt_p, off_p, len_p, draft_p, stop_p, n_stop, budget_p, acc_p, emit_p, fin_p, W: tl.constexpr):
    b = tl.program_id(0)
    off = tl.load(off_p + b)
    n = tl.load(len_p + b)  # k + 1 rows
    i = tl.arange(0, W)
    row = i < n
    tgt = tl.load(tgt_p + off + i, mask=row, other=-1)
    dr = tl.load(draft_p + off + i, mask=i < n - 1, other=-2)  # draft i is tested at row i
    a = tl.min(tl.where((i < n - 1) & (dr == tgt), W, i), 0)  # the first row whose draft fails (or the bonus row)
    a = tl.minimum(a, n - 1)
    is_stop = tl.zeros((W,), tl.int1)
    for s in range(0, n_stop):
        is_stop = is_stop | (tgt == tl.load(stop_p + b * n_stop + s))
    first_stop = tl.min(tl.where(is_stop & (i <= a), i, W), 0)
    m = tl.minimum(first_stop + 1, a + 1)
    budget = tl.load(budget_p + b)
    m = tl.where(budget >= 1, tl.minimum(m, budget), m)
    last_stop = tl.max(tl.where(i == m - 1, is_stop.to(tl.int32), 0), 0)
    fin = tl.where(last_stop > 0, 1, tl.where((budget >= 1) & (m == budget), 2, 0))
    tl.store(acc_p + b, tl.minimum(a, m))
    tl.store(emit_p + b, m)
    tl.store(fin_p + b, fin)


def accept_walk(
    targets: torch.Tensor,
    lengths: list[int],
    drafts: list[list[int]],
    stop_ids: list[tuple[int, ...]],
    budgets: list[int | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched accept walks over ``targets [R]`` (the walks' rows in turn, ``lengths[b] = k_b + 1``):
    walk ``b`` tests ``drafts[b]`` (``k_b`` tokens) against its targets, with its ``stop_ids`` and
    ``budgets`` (tokens it may still emit; None: unlimited) as :func:`tandem.engine.accept.accept_walk`.
    Returns ``accepted [B]``, ``emitted [B]`` (the walk emits ``targets[off : off + emitted]``) and
    ``finish [B]`` (index into :data:`FINISH_CODES`), int64 / int64 / int32. Raises ``ValueError`` for
    a walk longer than :data:`MAX_WALK` rows, drafts that do not match ``lengths`` or a budget < 1."""
    B = len(lengths)
    if any(len(d) != n - 1 for d, n in zip(drafts, lengths)) or len(drafts) != B:
        raise ValueError("drafts: walk b needs lengths[b] - 1 tokens")
    if any(not 1 <= n <= MAX_WALK for n in lengths):
        raise ValueError(f"each walk must have 1..{MAX_WALK} rows, got {max(lengths)}")
    if any(x is not None and x < 1 for x in budgets):
        raise ValueError("budgets must be >= 1 or None")
    dev = targets.device
    offs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    flat = np.full(int(sum(lengths)), -2, np.int64)
    for o, d in zip(offs, drafts):
        flat[o : o + len(d)] = d
    ns = max([len(s) for s in stop_ids] + [1])
    stops = np.full((B, ns), -3, np.int64)
    for b, s in enumerate(stop_ids):
        stops[b, : len(s)] = s
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    acc = torch.empty(B, dtype=torch.int64, device=dev)
    emit = torch.empty(B, dtype=torch.int64, device=dev)
    fin = torch.empty(B, dtype=torch.int32, device=dev)
    if B:
        _walk_kernel[(B,)](
            targets.to(torch.int64).contiguous(),
            t(offs),
            t(np.asarray(lengths, np.int64)),
            t(flat),
            t(stops),
            ns,
            t(np.asarray([0 if x is None else x for x in budgets], np.int64)),
            acc,
            emit,
            fin,
            W=MAX_WALK,
        )
    return acc, emit, fin


#: the launchers the engine's hooks call (tests count their calls)
ENGINE_LAUNCHERS = ("targets_and_gaps",)
