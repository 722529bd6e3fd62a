"""Kimi Delta Attention (KDA): gated delta rule with per-channel decay, plus its short causal conv.

Recurrence per head (Kimi Linear, arXiv:2510.26692, eq. 1-2), state ``S [dk, dv]``::

    S'_t = diag(exp(g_t)) S_{t-1}
    S_t  = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T
    o_t  = S_t^T q_t                       (q, k L2-normalised, q scaled by dk^-1/2)

``kda_recurrent`` runs it row by row and can return every row's state (the reference);
``kda_rows`` gives every row's state in one closed-form pass (verify rollback);
``kda_chunked`` is the chunk-parallel form (WY / UT transform with a unit-lower-triangular solve)
used for prime and training. Both are pure torch, fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from ..ops import dispatch

from ..ops.settings import DEFAULT, KernelSettings
from .config import TrunkConfig
from .layers import GatedRMSNorm, fused_linear


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (FLA's convention: eps inside the sqrt)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-by-row KDA.

    Args: ``q, k, g [B, T, H, dk]`` (q already scaled, q/k normalised, g = log decay <= 0),
    ``v [B, T, H, dv]``, ``beta [B, T, H]``, ``state [B, H, dk, dv]``; all fp32.
    Returns ``o [B, T, H, dv]`` and either the final state ``[B, H, dk, dv]`` or, with
    ``keep_states``, every row's state ``[B, T, H, dk, dv]``.
    """
    B, T, H, _ = k.shape
    outs, states = [], []
    S = state
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        mem = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        delta = (v[:, t] - mem) * beta[:, t].unsqueeze(-1)
        S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
        if keep_states:
            states.append(S)
    o = torch.stack(outs, 1)
    return o, (torch.stack(states, 1) if keep_states else S)


def kda_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's KDA output and state in one closed-form pass (verify: a few rows, fixed op count).

    Same arguments as :func:`kda_recurrent`; returns ``o [B, T, H, dv]`` and every row's state
    ``[B, T, H, dk, dv]`` (what ``kda_recurrent(..., keep_states=True)`` returns, to fp32 rounding).
    With ``G`` the inclusive cumulative log-decay and ``D_tj = exp(G_t - G_j)`` for ``j <= t`` (else 0;
    every entry in ``[0, 1]``, so no overflow), the WY form of the delta rule (Yang et al. 2024,
    "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", §3; per-channel
    decay as in Kimi Linear, arXiv:2510.26692) gives pseudo-values ``U`` from
    ``(I + diag(beta) A) U = diag(beta) (V - (exp(G) * K) S0)``, ``A_tj = sum_d k_t D_tj k_j`` (``j < t``),
    and ``S_t = exp(G_t) * S0 + sum_j (D_tj * k_j) u_j^T``, ``o_t = S_t^T q_t``.
    Cost: ``O(T^2 dk dv)`` per head; meant for ``T <= 16``.
    """
    B, T, H, dk = k.shape
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))  # [B, H, T, d]
    beta = beta.transpose(1, 2)  # [B, H, T]
    G = g.cumsum(-2)
    idx = torch.arange(T, device=k.device)
    incl = (idx[:, None] >= idx[None, :])[:, :, None]  # [T, T, 1]
    D = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~incl, float("-inf")).exp()  # [B, H, T, T, dk]
    KD = D * k.unsqueeze(-3)  # [B, H, T(t), T(j), dk]: D_tj * k_j
    A = torch.einsum("bhtd,bhtjd->bhtj", k, KD).masked_fill(
        ~incl[..., 0] | torch.eye(T, dtype=torch.bool, device=k.device), 0.0
    )
    eG = G.exp()
    rhs = beta.unsqueeze(-1) * (v - (eG * k) @ state)
    Tm = torch.eye(T, dtype=k.dtype, device=k.device) + beta.unsqueeze(-1) * A
    U = torch.linalg.solve_triangular(Tm, rhs, upper=False, unitriangular=True)  # [B, H, T, dv]
    states = eG.unsqueeze(-1) * state.unsqueeze(2) + torch.einsum("bhtjd,bhjv->bhtdv", KD, U)
    o = torch.einsum("bhtdv,bhtd->bhtv", states, q)
    return o.transpose(1, 2), states.transpose(1, 2)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel KDA; same contract as :func:`kda_recurrent` (final state only).

    Within a chunk with inclusive cumulative log-decay ``G``, pseudo-values ``U`` solve
    ``(I + diag(beta) A) U = diag(beta) (V - (exp(G) * K) S0)`` with
    ``A_tj = sum_d k_t k_j exp(G_t - G_j)`` strictly lower, and
    ``O = (exp(G) * Q) S0 + tril(Bqk) U``, ``S1 = exp(G_C) * S0 + (exp(G_C - G) * K)^T U``.
    Cost: two ``[C, dk] x [dk, C]`` products per chunk and head plus the sequential state pass.
    """
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // chunk
    # [B, H, N, C, d]
    q, k, v, g = (x.transpose(1, 2).reshape(B, H, N, chunk, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.transpose(1, 2).reshape(B, H, N, chunk)
    G = g.cumsum(-2)
    # exp(G_t - G_j) = exp(G_t - G_m) * exp(G_m - G_j) around the chunk midpoint m: each factor is
    # at most exp(|lower| * chunk / 2), finite in fp32 for chunk <= 16 and lower >= -5.
    Gm = G[..., chunk // 2 : chunk // 2 + 1, :]
    k_t = k * (G - Gm).exp()
    k_j = k * (Gm - G).exp()
    q_t = q * (G - Gm).exp()
    idx = torch.arange(chunk, device=k.device)
    strict = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    A = (k_t @ k_j.transpose(-1, -2)).masked_fill(~strict, 0.0)
    Bqk = (q_t @ k_j.transpose(-1, -2)).masked_fill(~incl, 0.0)
    Tm = torch.eye(chunk, device=k.device, dtype=k.dtype) + beta.unsqueeze(-1) * A
    eG = G.exp()
    rhs = torch.cat([beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * (eG * k)], dim=-1)
    sol = torch.linalg.solve_triangular(Tm, rhs, upper=False, unitriangular=True)
    Wv, Wk = sol.split([dv, dk], dim=-1)
    Qt = eG * q
    Kend = (G[..., -1:, :] - G).exp() * k  # [B,H,N,C,dk]
    gend = eG[..., -1, :]  # [B,H,N,dk]
    S = torch.zeros(B, H, dk, dv, dtype=k.dtype, device=k.device) if state is None else state
    outs = []
    for n in range(N):
        U = Wv[:, :, n] - Wk[:, :, n] @ S
        outs.append(Qt[:, :, n] @ S + Bqk[:, :, n] @ U)
        S = gend[:, :, n].unsqueeze(-1) * S + Kend[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, 2).reshape(B, H, N * chunk, dv)[:, :, :T].transpose(1, 2)
    return o, S


class ForgetGate(nn.Module):
    """KDA per-channel log-decay ``g = lower * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias))``.

    ``[B, T, D] -> [B, T, H, dk]`` fp32, each entry in ``(lower, 0)``.
    """

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.dk, self.h = cfg.linear_head_dim, cfg.linear_num_heads
        qkv = self.dk * self.h
        self.f_a_proj = nn.Linear(cfg.hidden_size, self.dk, bias=False)
        self.f_b_proj = nn.Linear(self.dk, qkv, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(qkv, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(self.h, dtype=torch.float32))
        if cfg.linear_lower_bound is None:
            raise ValueError("tandem needs linear_lower_bound (safe gate)")
        self.lower = cfg.linear_lower_bound

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(b, t, self.h, self.dk)
        return self.lower * torch.sigmoid(self.A_log.float().exp().view(1, 1, self.h, 1) * g)


class LinearAttention(nn.Module):
    """A KDA ``linear_attention`` layer. State per sequence: conv tail ``[B, 3*H*dk, K-1]`` (the
    last K-1 pre-conv inputs) and recurrent state ``[B, H, dk, dv]`` (fp32)."""

    #: the kernel settings the model was loaded with (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT

    #: linears reading the layer input, fused in the serving layout (q | k | v first: the conv input)
    FUSED = {"_fused_x": ("q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj", "b_proj", "g_a_proj")}

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.h, self.dk = cfg.linear_num_heads, cfg.linear_head_dim
        qkv = self.h * self.dk
        self.qkv = qkv
        self.kernel = cfg.linear_conv_kernel_dim
        D = cfg.hidden_size
        self.q_proj = nn.Linear(D, qkv, bias=False)
        self.k_proj = nn.Linear(D, qkv, bias=False)
        self.v_proj = nn.Linear(D, qkv, bias=False)
        self.conv1d = nn.Conv1d(
            3 * qkv, 3 * qkv, self.kernel, groups=3 * qkv, bias=False, padding=self.kernel - 1, dtype=torch.float32
        )
        self.forget_gate = ForgetGate(cfg)
        self.b_proj = nn.Linear(D, self.h, bias=False)
        self.g_a_proj = nn.Linear(D, self.dk, bias=False)
        self.g_b_proj = nn.Linear(self.dk, qkv, bias=False)
        self.o_norm = GatedRMSNorm(self.dk, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(qkv, D, bias=False)

    def init_state(self, batch: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero conv tail ``[B, 3*qkv, K-1]`` (fp32) and recurrent state ``[B, H, dk, dk]`` (fp32)."""
        return (
            torch.zeros(batch, 3 * self.qkv, self.kernel - 1, device=device),
            torch.zeros(batch, self.h, self.dk, self.dk, device=device),
        )

    def _qkv(self, x: torch.Tensor, tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Projections + causal conv. Returns activated ``[B, T, 3*qkv]`` and pre-conv
        inputs with the tail prepended ``[B, 3*qkv, K-1+T]`` (fp32)."""
        T = x.shape[1]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1).transpose(1, 2).float()
        if tail is None:
            tail = mixed.new_zeros(mixed.shape[0], mixed.shape[1], self.kernel - 1)
        full = torch.cat([tail, mixed], -1)
        if T <= 16:  # few rows (verify): K shifted multiply-adds beat a convolution call
            w = self.conv1d.weight.float()[:, 0]  # [C, K]
            K = self.kernel
            out = full[:, :, 0:T] * w[:, 0, None]
            for j in range(1, K):
                out = out + full[:, :, j : j + T] * w[:, j, None]
        else:
            out = F.conv1d(full, self.conv1d.weight.float(), groups=full.shape[1])[:, :, -T:]
        return F.silu(out).to(x.dtype).transpose(1, 2), full

    def _heads(self, x: torch.Tensor, act: torch.Tensor):
        b, t = x.shape[:2]
        q, k, v = act.split([self.qkv] * 3, -1)
        q = l2norm(q.float().view(b, t, self.h, self.dk)) * self.dk**-0.5
        k = l2norm(k.float().view(b, t, self.h, self.dk))
        v = v.float().view(b, t, self.h, self.dk)
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x)).float()
        return q, k, v, g, beta

    def _out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[:2]
        gate = self.g_b_proj(self.g_a_proj(x)).view(b, t, self.h, self.dk)
        y = self.o_norm(o.to(x.dtype), gate).reshape(b, t, -1)
        return self.o_proj(y)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None, chunk: int = 16
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Prime / training path (chunked). ``x [B, T, D]`` -> ``y [B, T, D]`` and the state after
        the last row ``(tail [B, 3qkv, K-1], S [B, H, dk, dv])``."""
        tail, S = state if state is not None else (None, None)
        act, full = self._qkv(x, tail)
        q, k, v, g, beta = self._heads(x, act)
        o, S = kda_chunked(q, k, v, g, beta, S, chunk=chunk)
        return self._out(x, o), (full[:, :, -(self.kernel - 1) :].contiguous(), S)

    def forward_rows(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Verify / decode path (row by row). ``x [B, T, D]`` -> ``y [B, T, D]``, pre-conv inputs with
        the old tail ``[B, 3qkv, K-1+T]`` (the tail after row r is ``[..., r+1 : r+K]``) and every
        row's recurrent state ``[B, T, H, dk, dv]``. Without autograd (serving) one sequence runs in
        :func:`~tandem.ops.cpu.kda.kda_rows_fused`; this torch path is its reference. On CUDA (or
        with the kernels forced) the rows run in :func:`tandem.ops.triton.kda_verify.kda_rows`."""
        tail, S = state
        if dispatch.numba(self.kernels, x) and x.shape[0] == 1:
            y, (rows,) = self.forward_rows_many(x, [state], [x.shape[1]])
            return y, rows.full, rows.states
        act, full = self._qkv(x, tail)
        q, k, v, g, beta = self._heads(x, act)
        needs_grad = torch.is_grad_enabled() and q.requires_grad  # the Triton kernel has no backward
        got = dispatch.kda_rows_triton(self.kernels, x, q, k, v, g, beta, S, needs_grad)
        o, states = kda_rows(q, k, v, g, beta, S) if got is None else got
        return self._out(x, o), full, states

    def forward_rows_many(
        self, x: torch.Tensor, states: list, lengths: list[int], keep_states: bool = True
    ) -> tuple[torch.Tensor, list]:
        """:meth:`forward_rows` for several sequences (serving): ``x [1, sum R, D]`` holds each
        sequence's rows in turn (``lengths``), ``states`` their ``(tail, S)`` or
        :class:`~tandem.model.cache.KDAState` (read in place). The projections run over
        all rows, the recurrences in one :func:`~tandem.ops.cpu.kda.kda_rows_fused` call. Returns
        ``y [1, sum R, D]`` and per sequence its :class:`~tandem.model.cache.KDARows` (pre-conv inputs
        with its tail, every row's state); without ``keep_states`` (a prime) its ``(tail, S)`` after
        its last row, as :meth:`forward` returns."""
        C, dk, H = self.qkv, self.dk, self.h
        out = fused_linear(self, "_fused_x", x)
        if out is None:
            out = torch.cat(
                [
                    self.q_proj(x),
                    self.k_proj(x),
                    self.v_proj(x),
                    self.forget_gate.f_a_proj(x),
                    self.b_proj(x),
                    self.g_a_proj(x),
                ],
                -1,
            )
        mixed, fa, b, ga = out.split([3 * C, dk, H, dk], -1)
        fg = self.forget_gate
        fb, gb = fg.f_b_proj(fa), self.g_b_proj(ga)
        y, per = dispatch.kda_rows_fused(
            mixed,
            states,
            self.conv1d.weight,
            fb,
            fg.A_log,
            fg.dt_bias,
            fg.lower,
            b,
            gb,
            self.o_norm.weight,
            self.o_norm.variance_epsilon,
            H,
            lengths,
            keep_states,
        )
        return self.o_proj(y.to(x.dtype)), per
