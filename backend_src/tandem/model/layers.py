"""Building blocks of the glm5_next trunk: norms, SwiGLU MLP, sigmoid-routed MoE, mHC hyper-connections.

Parameter names equal the Hugging Face checkpoint names so ``state_dict()`` is the checkpoint.
Math follows transformers' ``modeling_glm5_next`` (read for facts, written anew here).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import dispatch
from ..ops.settings import DEFAULT, KernelSettings
from .config import TrunkConfig


def input_major_linears(module: nn.Module) -> nn.Module:
    """Serving layout of every ``nn.Linear`` weight ``[out, in]``: stored input-major (an ``[in, out]``
    contiguous buffer viewed as ``[out, in]``), values and names unchanged, so ``F.linear`` calls a
    non-transposed GEMM, which the CPU runs faster for the few rows of decode and verify.

    Linears (or ``[out, in]`` parameters) that read the same input are fused: a module's
    ``FUSED = {attr: (names...)}`` gets
    ``attr = (W [sum out, in], [out...])`` with the listed linears' weights views of ``W`` (one GEMM
    instead of several; a later in-place load updates both). Returns ``module``."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.data = m.weight.data.t().contiguous().t()
            if type(m) is nn.Linear:  # same parameters; its forward can take the row-invariant kernel
                m.__class__ = dispatch.ServingLinear
    for m in module.modules():
        for attr, names in getattr(type(m), "FUSED", {}).items():
            ps = [_weight(m, n) for n in names]
            if len({p.dtype for p in ps}) > 1 or ps[0].dtype == torch.float8_e4m3fn:
                continue  # an fp32-kept weight among them, or FP8 ones (tandem.model.fp8): left unfused
            w = torch.cat([p.data.t() for p in ps], 1).contiguous()  # [in, sum out]
            outs, a = [p.shape[0] for p in ps], 0
            for p, o in zip(ps, outs):
                p.data, a = w[:, a : a + o].t(), a + o
            setattr(m, attr, (w.t(), outs))
        if hasattr(m, "serving_layout"):
            m.serving_layout()
    dispatch.relayout()
    return module


def _weight(m: nn.Module, name: str) -> nn.Parameter:
    """The ``[out, in]`` weight named ``name`` in ``m``: a parameter path, or a linear's path."""
    try:
        return m.get_parameter(name)
    except AttributeError:
        return m.get_submodule(name).weight


def fused_linear(module: nn.Module, attr: str, x: torch.Tensor) -> torch.Tensor | None:
    """``module``'s fused group ``attr`` on ``x [..., in]``: the listed linears' outputs side by side
    ``[..., sum out]`` (one GEMM), or None when the group is not fused (training layout) or autograd is on."""
    fused = getattr(module, attr, None)
    if fused is None or torch.is_grad_enabled() or fused[0].dtype != x.dtype:
        return None
    return dispatch.linear(module.kernels, x, fused[0])


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``w * x / sqrt(mean(x^2) + eps)``, statistics in fp32.

    Input ``[..., D]``; output same shape and dtype.
    """

    #: the kernel settings the model was loaded with (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dispatch.rms_norm(self.kernels, x, self.weight, self.variance_epsilon)  # one kernel call
        if y is not None:
            return y
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(dt)


class GatedRMSNorm(nn.Module):
    """KDA output norm: ``RMSNorm(x) * sigmoid(gate)``, all in fp32. ``x, gate: [..., Dh]``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        xf = self.weight.float() * xf
        return (xf * torch.sigmoid(gate.float())).to(dt)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """GLM's SwiGLU with clamps: ``silu(min(gate, L)) * clamp(up, -L, L)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class MLP(nn.Module):
    """Dense SwiGLU MLP. ``[..., D] -> [..., D]``."""

    #: the kernel settings the model was loaded with (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT

    def __init__(self, cfg: TrunkConfig, intermediate: int | None = None) -> None:
        super().__init__()
        inter = intermediate or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        h = dispatch.swiglu(self.kernels, g, u, self.limit)  # the experts' arithmetic (the fused dense FFN's)
        return self.down_proj(clamped_swiglu(g, u, self.limit) if h is None else h)


class Experts(nn.Module):
    """Routed experts stored as 3-D tensors (checkpoint layout ``experts.gate_up_proj [E, 2I, D]``,
    ``experts.down_proj [E, D, I]``)."""

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.limit = cfg.swiglu_limit
        self.num_experts = e

    #: at most this many rows run every expert densely (a fixed op count for decode and verify rows)
    dense_rows = 16
    #: expert parallelism (:mod:`tandem.model.parallel`): the global id of this rank's first expert (None: one
    #: rank holds them all); a token's slots routed to another rank's experts add nothing here
    first: int | None = None

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [N, D]``, ``idx [N, k]`` expert ids, ``w [N, k]`` weights -> ``[N, D]`` (:func:`routed_experts`)."""
        return routed_experts(
            x, idx, w, self.gate_up_proj, self.down_proj, self.limit, self.first, self.num_experts, self.dense_rows
        )


def local_slots(idx: torch.Tensor, w: torch.Tensor, first: int | None, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert parallelism: ``idx [N, k]`` global expert ids as this rank's (``first .. first + num - 1``), the
    slots routed to another rank's experts weighing 0 on expert 0; as they are when ``first`` is None."""
    if first is None:
        return idx, w
    local = idx - first
    mine = (local >= 0) & (local < num)
    return torch.where(mine, local, 0), torch.where(mine, w, torch.zeros_like(w))


def routed_experts(x, idx, w, gate_up, down, limit: float, first: int | None, num: int, dense_rows: int):
    """The routed experts ``gate_up [E, 2I, D]``, ``down [E, D, I]`` on ``x [N, D]`` for the slots ``idx [N, k]``
    (weights ``w [N, k]``) -> ``[N, D]``.

    Up to ``dense_rows`` rows, every expert runs on every row and the unselected outputs get
    weight 0 (``E / k`` times the FLOPs, a fixed ~10 ops instead of ~14 per expert hit: on CPU
    the op count, not the FLOPs, sets the speed of a few rows); more rows dispatch per expert."""
    idx, w = local_slots(idx, w, first, num)
    if x.shape[0] <= dense_rows:
        n, (e, i2, d) = x.shape[0], gate_up.shape
        gu = F.linear(x, gate_up.view(e * i2, d)).view(n, e, i2)  # [N, E, 2I], no weight copy
        g, u = gu.chunk(2, dim=-1)
        a = clamped_swiglu(g, u, limit).transpose(0, 1)  # [E, N, I]
        h = torch.bmm(a, down.transpose(1, 2))  # [E, N, D]
        wf = torch.zeros(n, e, dtype=h.dtype, device=h.device).scatter_add_(1, idx, w.to(h.dtype))
        return (h * wf.t().unsqueeze(-1)).sum(0).to(x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == e)
        gu = F.linear(x[tok], gate_up[e])
        g, u = gu.chunk(2, dim=-1)
        h = F.linear(clamped_swiglu(g, u, limit), down[e])
        out.index_add_(0, tok, (h * w[tok, slot, None].to(h.dtype)).to(out.dtype))
    return out


class Router(nn.Module):
    """Sigmoid top-k router with the aux-loss-free score-correction bias (DeepSeek-V3, §2.1.2).

    ``weight [E, D]`` and ``e_score_correction_bias [E]`` are fp32. Returns logits ``[N, E]``,
    weights ``[N, k]`` (normalised, times ``routed_scaling_factor``) and indices ``[N, k]``.
    """

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        if cfg.n_group != 1:
            raise ValueError("tandem supports n_group == 1 only")
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.scale = cfg.routed_scaling_factor
        self.norm_topk_prob = cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return logits, w * self.scale, idx


class MoE(nn.Module):
    """Routed experts + shared expert(s). ``[B, T, D] -> [B, T, D]``.

    After each forward, ``last_load [E]`` holds the fraction of (token, slot) pairs routed to each
    expert (used by training to update the correction bias).
    """

    #: the kernel settings the model was loaded with (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        self.experts = Experts(cfg)
        self.gate = Router(cfg)
        self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.last_load: torch.Tensor | None = None

    #: up to this many rows (decode and verify blocks of a batch of sessions) the serving path runs
    #: :func:`~tandem.ops.cpu.moe.moe_rows`: the same code for any row count (any number of rows
    #: in the row-invariant mode, :attr:`tandem.ops.settings.KernelSettings.rows`)
    kernel_rows = 256

    def serving_layout(self) -> None:
        """Fuse the routed and shared experts' weights for :func:`~tandem.ops.cpu.moe.moe_rows`:
        ``_w_up [(E+1) * 2I, D]`` (input-major) and ``_w_down [E+1, I, D]``, the parameters becoming
        views of them. Only with one shared expert of the routed experts' width."""
        ex, sh = self.experts, self.shared_experts
        self.gate.weight.data = self.gate.weight.data.t().contiguous().t()  # input-major like the linears
        e, i2, d = ex.gate_up_proj.shape
        fp8 = any(t.dtype == torch.float8_e4m3fn for t in (ex.gate_up_proj, sh.gate_proj.weight, sh.down_proj.weight))
        if sh.down_proj.weight.shape[1] != i2 // 2 or fp8:  # FP8-held weights (tandem.model.fp8) stay apart
            return
        up = torch.cat([ex.gate_up_proj.data.reshape(e * i2, d), sh.gate_proj.weight.data, sh.up_proj.weight.data])
        self._w_up = up.t().contiguous().t()
        ex.gate_up_proj.data = self._w_up[: e * i2].view(e, i2, d)
        sh.gate_proj.weight.data, sh.up_proj.weight.data = (
            self._w_up[e * i2 : e * i2 + i2 // 2],
            self._w_up[e * i2 + i2 // 2 :],
        )
        self._w_down = torch.cat([ex.down_proj.data.transpose(1, 2), sh.down_proj.weight.data.t()[None]]).contiguous()
        ex.down_proj.data, sh.down_proj.weight.data = self._w_down[:e].transpose(1, 2), self._w_down[e].t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = dispatch.moe(self.kernels, self, x)
        if y is not None:
            return y
        flat = x.reshape(-1, shape[-1])
        _, w, idx = self.gate(flat)
        if self.training:
            self.last_load = torch.bincount(idx.flatten(), minlength=self.experts.num_experts).float() / idx.numel()
        y = self.experts(flat, idx, w).view(shape)
        return y + self.shared_experts(x)


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection weights (mHC, Xie et al. 2026).

    From the ``hc_mult = N`` residual streams ``[B, T, N, D]`` computes ``pre [B,T,N]`` (consumed
    here to collapse the streams into the block input ``[B, T, D]``), ``post [B,T,N]`` and the
    Sinkhorn-normalised doubly-stochastic ``comb [B,T,N,N]``.
    """

    #: the kernel settings the model was loaded with (:func:`tandem.ops.dispatch.install`)
    kernels: KernelSettings = DEFAULT

    def __init__(self, cfg: TrunkConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.n = n
        self.iters = cfg.hc_sinkhorn_iters
        self.eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, n, _ = streams.shape
        flat = streams.reshape(b, t, -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb = torch.softmax(comb_w.view(b, t, n, n) * s_comb + comb_b.view(n, n), dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(2).to(streams.dtype)
        return post, comb, collapsed

    def normed(self, streams: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` with the block's ``norm`` applied to the collapsed input; in serving (no
        autograd) one :func:`~tandem.ops.cpu.kernels.hc_weights` call."""
        out = dispatch.hc_normed(self.kernels, self, streams, norm)
        if out is not None:
            return out
        post, comb, x = self(streams)
        return post, comb, norm(x)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp normalisation toward a doubly-stochastic matrix (mHC): one column step, then
    ``iters - 1`` row+column steps, each ``x / (sum + eps)``. ``comb [..., N, N]`` fp32. (Serving runs
    it inside :func:`~tandem.ops.cpu.kernels.hc_weights`.)"""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_merge(
    post: torch.Tensor,
    comb: torch.Tensor,
    block_out: torch.Tensor,
    residual: torch.Tensor,
    kernels: KernelSettings = DEFAULT,
) -> torch.Tensor:
    """mHC expand + mix: ``post ⊗ block_out + comb^T @ residual``. Shapes ``[B,T,N]``, ``[B,T,N,N]``,
    ``[B,T,D]``, ``[B,T,N,D]`` -> ``[B,T,N,D]``."""
    out = dispatch.hc_merge(kernels, post, comb, block_out, residual)
    if out is not None:
        return out
    dt = residual.dtype
    return post.to(dt).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), residual)
