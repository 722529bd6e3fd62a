"""KDA verify step: a few rows per sequence on top of its recurrent state, with every row's state.

Computes, per sequence and head, the Kimi Delta Attention recurrence (Kimi Linear, arXiv:2510.26692,
eq. 1-2; the docstring of :mod:`tandem.model.kda`) row by row from the sequence's state ``S [dk, dv]``::

    S'_t = diag(exp(g_t)) S_{t-1};   S_t = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T;   o_t = S_t^T q_t

and stores ``o_t`` and ``S_t`` for every row ``t``: verify keeps the state after each row so that,
once the accepted prefix is known, the cache rolls back to it exactly (no recompute).

Shapes (all fp32), for a **ragged batch** of ``B`` sequences whose rows are packed one sequence after
another (``R = sum(lengths)``): ``q, k, g [R, H, dk]`` (q L2-normalised and scaled by ``dk^-1/2``, k
L2-normalised, g = log decay <= 0), ``v [R, H, dv]``, ``beta [R, H]``, initial states
``[B, H, dk, dv]``; results ``o [R, H, dv]`` and per-row states ``[R, H, dk, dv]``
(:func:`kda_rows_ragged`). :func:`kda_rows` is the equal-length form with exactly the arguments and
results of the engine's :func:`tandem.model.kda.kda_rows` (the reference, with
``kda_recurrent(..., keep_states=True)``; ``tests/test_kernels_kda.py``).

Grid ``(B, H, cdiv(dv, BLOCK_V))``: the delta rule updates each column of ``S`` independently (column
``j`` sees only ``v[j]``), so a program owns one sequence, one head and a ``[dk, BLOCK_V]`` block of
the state, kept in registers (``BLOCK_K = next_pow2(dk)``, the whole key dim, which the read-out
``S'^T k`` sums over), and loops over the sequence's rows: per row one decay, two reductions over dk,
one rank-1 update and one store of the state block. Masks cover non-power-of-two dk / dv / H.

Limits: fp32 only; contiguous row-major layouts (inputs are made contiguous); the row loop is
sequential, so the cost is linear in the rows and meant for verify (k+1 <= 16 rows), though any
length is correct. Each program writes ``T * dk * BLOCK_V`` state values: the kernel is bound by
that store, as the reference's output is.

Why not flash-linear-attention: the package is not a dependency of tandem (not installed here), its
public ``fused_recurrent_kda`` returns only the final state, and ``chunk_kda`` (prime/training) does
too; the per-token-state path of its internal ``fused_recurrent_kda_fwd`` (``ssm_state_indices`` /
``num_accepted_tokens``, from vLLM's decode kernel) is tied to a serving engine's state-pool layout
and private. The kernel here is a few dozen lines with the exact layout the engine's rollback uses,
tested under the interpreter against the torch reference.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import interpreted


@triton.jit
def _kda_verify_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    s0_ptr,
    starts_ptr,
    lens_ptr,
    o_ptr,
    st_ptr,
    H,
    DK,
    DV,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    start = tl.load(starts_ptr + seq).to(tl.int64)
    n = tl.load(lens_ptr + seq)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < DK
    mv = offs_v < DV
    m2 = mk[:, None] & mv[None, :]
    blk = offs_k[:, None] * DV + offs_v[None, :]  # [BLOCK_K, BLOCK_V] offsets in one [dk, dv] state
    hs = (seq.to(tl.int64) * H + h) * DK * DV
    S = tl.load(s0_ptr + hs + blk, mask=m2, other=0.0)
    for t in range(0, n):
        row = (start + t) * H + h  # (row, head) index into the packed [R, H, ...] tensors
        kt = tl.load(k_ptr + row * DK + offs_k, mask=mk, other=0.0)
        qt = tl.load(q_ptr + row * DK + offs_k, mask=mk, other=0.0)
        gt = tl.load(g_ptr + row * DK + offs_k, mask=mk, other=0.0)
        vt = tl.load(v_ptr + row * DV + offs_v, mask=mv, other=0.0)
        bt = tl.load(beta_ptr + row)
        S = S * tl.exp(gt)[:, None]
        delta = (vt - tl.sum(S * kt[:, None], axis=0)) * bt
        S = S + kt[:, None] * delta[None, :]
        tl.store(o_ptr + row * DV + offs_v, tl.sum(S * qt[:, None], axis=0), mask=mv)
        tl.store(st_ptr + row * DK * DV + blk, S, mask=m2)


def _check(q, k, v, g, beta, state, ndim: int) -> None:
    names = ("q", "k", "v", "g", "beta", "state")
    for name, x in zip(names, (q, k, v, g, beta, state)):
        if x.dtype != torch.float32:
            raise ValueError(f"kda_verify: {name} must be float32, got {x.dtype}")
        if x.device != k.device:
            raise ValueError(f"kda_verify: {name} is on {x.device}, k on {k.device}")
    if k.ndim != ndim or q.shape != k.shape or g.shape != k.shape:
        raise ValueError(
            f"kda_verify: q, k, g must share a {ndim}-d shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}"
        )
    if v.shape[:-1] != k.shape[:-1] or beta.shape != k.shape[:-1]:
        raise ValueError(f"kda_verify: v {tuple(v.shape)} / beta {tuple(beta.shape)} do not match k {tuple(k.shape)}")
    H, dk, dv = k.shape[-2], k.shape[-1], v.shape[-1]
    if state.ndim != 4 or state.shape[1:] != (H, dk, dv):
        raise ValueError(f"kda_verify: state must be [B, {H}, {dk}, {dv}], got {tuple(state.shape)}")


def kda_rows_ragged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lengths: Sequence[int] | torch.Tensor,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify rows of a ragged batch: sequence ``b`` owns packed rows ``sum(lengths[:b]) ..`` (+ ``lengths[b]``).

    Args: ``q, k, g [R, H, dk]``, ``v [R, H, dv]``, ``beta [R, H]``, ``state [B, H, dk, dv]`` (fp32,
    conventions of :func:`tandem.model.kda.kda_recurrent`), ``lengths`` ``B`` non-negative row counts
    summing to ``R``; ``block_v`` the dv block per program (default ``min(next_pow2(dv), 32)``; the
    whole ``next_pow2(dv)`` in Triton's interpreter).
    Returns ``o [R, H, dv]`` and every row's state ``[R, H, dk, dv]`` (fp32).

    Raises ``ValueError`` for a non-fp32 input, mismatched shapes or devices, or lengths that are
    negative, not ``B`` of them, or do not sum to ``R``.
    """
    _check(q, k, v, g, beta, state, 3)
    R, H, dk = k.shape
    dv, B = v.shape[-1], state.shape[0]
    lens = torch.as_tensor(lengths, dtype=torch.int64).flatten().cpu()
    if lens.numel() != B or bool((lens < 0).any()) or int(lens.sum()) != R:
        raise ValueError(f"kda_verify: lengths {lens.tolist()} must be {B} non-negative counts summing to {R} rows")
    starts = torch.cumsum(lens, 0) - lens
    # on the GPU a program per 32 state columns; in the interpreter, whose cost is per program and op,
    # one per head
    bv = block_v or (triton.next_power_of_2(dv) if interpreted() else min(triton.next_power_of_2(dv), 32))
    if bv <= 0 or bv & (bv - 1):
        raise ValueError(f"kda_verify: block_v must be a power of two, got {bv}")
    o = torch.empty(R, H, dv, dtype=torch.float32, device=k.device)
    states = torch.empty(R, H, dk, dv, dtype=torch.float32, device=k.device)
    if R == 0 or H == 0 or dv == 0:
        return o, states
    q, k, v, g, beta, state = (x.contiguous() for x in (q, k, v, g, beta, state))
    dev = k.device
    grid = (B, H, triton.cdiv(dv, bv))
    _kda_verify_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        starts.to(torch.int32).to(dev),
        lens.to(torch.int32).to(dev),
        o,
        states,
        H,
        dk,
        dv,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=bv,
    )
    return o, states


def kda_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tandem.model.kda.kda_rows` on the kernel: ``B`` sequences of ``T`` rows each.

    Args: ``q, k, g [B, T, H, dk]``, ``v [B, T, H, dv]``, ``beta [B, T, H]``, ``state [B, H, dk, dv]``
    (fp32). Returns ``o [B, T, H, dv]`` and every row's state ``[B, T, H, dk, dv]``.
    Raises ``ValueError`` as :func:`kda_rows_ragged`.
    """
    _check(q, k, v, g, beta, state, 4)
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    if state.shape[0] != B:
        raise ValueError(f"kda_verify: state has {state.shape[0]} sequences, the rows {B}")
    o, states = kda_rows_ragged(
        q.reshape(B * T, H, dk),
        k.reshape(B * T, H, dk),
        v.reshape(B * T, H, dv),
        g.reshape(B * T, H, dk),
        beta.reshape(B * T, H),
        state,
        [T] * B,
    )
    return o.view(B, T, H, dv), states.view(B, T, H, dk, dv)


def _case(B: int, T: int, H: int, dk: int, dv: int, device: str, seed: int = 0):
    """Random verify inputs ``[B, T, H, d]`` in the model's ranges (g in (-5, 0): the safe gate)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    def unit(x):
        return x / x.norm(dim=-1, keepdim=True)

    q = unit(rnd(B, T, H, dk)) * dk**-0.5
    k = unit(rnd(B, T, H, dk))
    g = -5.0 * torch.rand(B, T, H, dk, generator=gen)
    xs = (q, k, rnd(B, T, H, dv), g, torch.rand(B, T, H, generator=gen), 0.1 * rnd(B, H, dk, dv))
    return tuple(x.to(device) for x in xs)


#: the launchers the engine's hooks call (tests count their calls)
ENGINE_LAUNCHERS = ("kda_rows",)
