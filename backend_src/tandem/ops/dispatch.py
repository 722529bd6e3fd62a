"""The one place the model reaches its kernels: each op here runs the CPU numba kernel
(:mod:`tandem.ops.cpu`) or the Triton kernel (:mod:`tandem.ops.triton`) that a model's
:class:`~tandem.ops.settings.KernelSettings` and the op's tensors select, and returns ``None`` where the
model's own pure-torch code (the reference each kernel is tested against) is the implementation.

A model gets its settings once, at load (:func:`install`; a trunk's and a drafter's ``use_kernels``). The
ops take them as their first argument; nothing here is switched at run time. Importing this module imports
numba (the CPU kernels) but not triton: a Triton kernel module is imported when its op first takes it.
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu import (
    attention as _attention,
    block as _block,
    decode as _decode,
    dflash as _dflash,
    groups as _groups,
    gemm as _gemm,
    kda as _kda,
    kernels as _k,
    mla_block as _mla_block,
    moe as _moe,
    spec_burst as _spec_burst,
    trunk_pass as _trunk_pass,
)
from .cpu.amx import HW_AMX, gemm_tiles
from .settings import AUTO, DEFAULT, REFERENCE, TORCH, TRITON, KernelSettings
from .triton import ENV, KernelUnavailable, available, interpreted

__all__ = [
    "AUTO",
    "DEFAULT",
    "ENV",
    "HW_AMX",
    "REFERENCE",
    "TORCH",
    "TRITON",
    "KernelSettings",
    "KernelUnavailable",
    "ServingLinear",
    "available",
    "gemm_tiles",
    "install",
    "interpreted",
    "numba",
    "use_triton",
]

_F32 = torch.float32

# -- selection ----------------------------------------------------------------------------------------------


#: ``numba(k, t=None)``: whether the CPU numba kernels serve a call under settings ``k`` (on ``t``, when given):
#: :meth:`KernelSettings.numba_on` itself (no wrapper on the layers' hot path)
numba = KernelSettings.numba_on
#: ``use_triton(k, t)``: whether the call whose main input is ``t`` takes its Triton kernel under settings ``k``:
#: :meth:`KernelSettings.triton_on` (raises :class:`KernelUnavailable` where ``triton`` cannot run)
use_triton = KernelSettings.triton_on


def _triton(k: KernelSettings, t: torch.Tensor) -> bool:
    """:func:`use_triton` without autograd (the Triton kernels have no backward)."""
    return not torch.is_grad_enabled() and k.triton_on(t)


def install(module: nn.Module, k: KernelSettings) -> nn.Module:
    """Give ``module`` and every module in it the settings ``k`` (their ``kernels`` attribute, which their
    calls here pass). The CPU kernels pack weights for the settings a layer has
    (:func:`tandem.ops.cpu.gemm.kernel_weight`). Raises ``TypeError`` for another value. Returns ``module``."""
    if not isinstance(k, KernelSettings):
        raise TypeError(f"kernel settings must be a KernelSettings, got {type(k).__name__}")
    for m in module.modules():
        m.kernels = k
    return module


# -- linears ------------------------------------------------------------------------------------------------

#: an ``nn.Linear`` whose forward is :func:`linear` (the serving layout swaps the class in)
ServingLinear = _gemm.ServingLinear


def linear(k: KernelSettings, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x [..., D], w [O, D], b) -> [..., O]``; in the row-invariant mode (``k.rows``) on CPU float32
    rows, the row-invariant GEMM (:func:`tandem.ops.cpu.gemm.linear`)."""
    return _gemm.linear(x, w, b, k)


def fp8_kernel(k: KernelSettings, x: torch.Tensor) -> bool:
    """Whether a block-scaled FP8 weight's GEMM on rows ``x`` takes the Triton kernel (:func:`fp8_linear`)."""
    return _triton(k, x)


def fp8_linear(
    k: KernelSettings, x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor | None:
    """``x [..., K] @ W^T -> [..., N]`` for ``W [N, K]`` held in block-scaled FP8 (``scale_inv`` per ``block``) in
    the Triton kernel (:func:`tandem.ops.triton.fp8_gemm.fp8_linear`), or None (the model's reference:
    :class:`tandem.model.fp8.Fp8Linear`)."""
    if _triton(k, x):
        from .triton import fp8_gemm

        return fp8_gemm.fp8_linear(x, w, scale_inv, block)
    return None


def relayout() -> None:
    """The serving layout's fused weights were rebound: the fused blocks look their weights up again."""
    _block.relayout()
    _trunk_pass.relayout()


def new_pass() -> None:
    """A model forward begins: the fused blocks check their weights once in it."""
    _block.new_pass()


# -- row-wise ops (None: the model's torch code) ------------------------------------------------------------


def rms_norm(k: KernelSettings, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of fp32 rows ``x [..., d]`` (weight ``w [d]``) in one numba call, or None."""
    if k.numba_on(x) and x.dtype == _F32 == w.dtype:
        return _k.rms_norm(x, w, eps)
    return None


def layer_norm(k: KernelSettings, x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor | None:
    """``norm`` (a LayerNorm) of fp32 rows ``x [..., d]`` in one numba call, or None."""
    if k.numba_on(x) and x.dtype == _F32 == norm.weight.dtype:
        return _k.layer_norm(x, norm.weight, norm.bias, norm.eps)
    return None


def swiglu(k: KernelSettings, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor | None:
    """The clamped SwiGLU of fp32 rows ``[..., I]`` with the MoE kernels' arithmetic, or None."""
    if k.numba_on(gate) and gate.dtype == _F32:
        return _k.swiglu(gate, up, limit)
    return None


def hc_normed(k: KernelSettings, hc: nn.Module, streams: torch.Tensor, norm: nn.Module) -> tuple | None:
    """mHC weights of ``streams [B, T, N, D]`` and the block norm ``norm`` of the collapsed input, in one numba
    call (:func:`tandem.ops.cpu.kernels.hc_weights`; ``hc`` an mHC module: ``fn``, ``base``, ``scale``,
    ``iters``, ``eps``, ``norm_eps``), or None."""
    if not k.numba_on(streams):
        return None
    return _k.hc_weights(
        streams, hc.fn, hc.base, hc.scale, hc.iters, hc.eps, hc.norm_eps, norm.weight, norm.variance_epsilon
    )


def hc_merge(
    k: KernelSettings, post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor | None:
    """The mHC merge ``post ⊗ block_out + comb^T @ residual`` of fp32 rows in one numba call, or None."""
    if k.numba_on(residual) and residual.dtype == _F32:
        return _k.hc_merge(post, comb, block_out, residual)
    return None


def moe(k: KernelSettings, m: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The MoE ``m`` (serving layout: ``_w_up``, ``_w_down``, ``gate``, ``experts``, ``kernel_rows``) on fp32 rows
    ``x [..., D]`` in the numba kernels (:func:`tandem.ops.cpu.moe.moe_rows`): up to ``m.kernel_rows`` rows, any
    number in the row-invariant mode. Returns ``[..., D]`` or None."""
    w_up = getattr(m, "_w_up", None)
    if not (
        k.numba_on(x)
        and w_up is not None
        and x.dtype == _F32
        and w_up.dtype == _F32
        and (x.numel() <= x.shape[-1] * m.kernel_rows or k.rows)
    ):
        return None
    g = m.gate
    return _moe.moe_rows(
        x.reshape(-1, x.shape[-1]),
        g.weight,
        g.e_score_correction_bias,
        g.top_k,
        g.norm_topk_prob,
        g.scale,
        w_up,
        m._w_down,
        m.experts.limit,
        k.rows,
        k,
    ).view(x.shape)


def top2(k: KernelSettings, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Greedy targets ``[R]`` and top-2 gaps ``[R]`` of fp32 ``logits [R, V]`` (``V >= 2``) in one numba pass, or
    None (the reference: ``topk(2)``)."""
    if k.numba_on(logits) and logits.dtype == _F32 and logits.shape[-1] > 1:
        return _k.top2(logits)
    return None


# -- attention ----------------------------------------------------------------------------------------------


def pool_keys(k: KernelSettings, keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor | None:
    """DSA pool compression of one fp32 sequence ``keys, gates [1, P*kp, di]`` (``ape [kp, di]``) in one numba
    call, or None."""
    if k.numba_on(keys) and keys.shape[0] == 1 and keys.dtype == gates.dtype == _F32:
        return _attention.pool_keys(keys, gates, ape)
    return None


def dsa_mask(k: KernelSettings, ix: nn.Module, x, rows: dict, pk, q_pos, kv_len: int) -> torch.Tensor | None:
    """The DSA visibility mask ``[B, T, kv_len]`` of rows ``x [B, T, D]`` (``rows`` their projections) over pool
    keys ``pk [B, P, di]`` for the indexer ``ix``: one sequence in the numba kernel, or the Triton kernel; None
    otherwise."""
    if k.numba_on(x) and x.shape[0] == 1 and "iq" in rows:
        b, t = x.shape[:2]
        dots = torch.matmul(pk[0], rows["iq"].reshape(t * ix.h, ix.d).t()).t().reshape(b, t, ix.h, -1)
        return _k.dsa_mask(dots, rows["iw"], q_pos, kv_len, ix.kp, ix.k_pools, ix.d**-0.5, ix.h**-0.5)
    if _triton(k, x):
        from .triton import dsa_indexer

        return dsa_indexer.mask(*ix.queries(x, rows), pk, q_pos, kv_len, ix.kp, ix.k_pools)
    return None


def mla_attention(k: KernelSettings, x, q, k_all, v_all, mask, scaling: float) -> torch.Tensor | None:
    """DSA-masked attention ``[B, H, T, dv]`` of queries ``q`` over ``k_all, v_all`` in the Triton kernel
    (rows ``x`` decide), or None."""
    if _triton(k, x):
        from .triton import mla_attention as kernel

        return kernel.attention(q, k_all, v_all, mask, scaling)
    return None


def mla_rows_fit(k: KernelSettings, x: torch.Tensor, longest: int) -> bool:
    """Whether MLA rows ``x [1, T, D]`` (``longest`` rows a sequence) take :func:`mla_rows`' numba kernels: fp32,
    up to 16 rows a sequence (verify blocks), any number in the row-invariant mode (a prime's rows then do not
    depend on its chunks)."""
    return k.numba_on(x) and x.shape[0] == 1 and x.dtype == _F32 and (longest <= 16 or k.rows)


def mla_rows(attn: nn.Module, rows: dict, caches: list, lengths: list[int]) -> torch.Tensor:
    """Every sequence's rows appended to its MLA cache and the heads' outputs ``[1, sum R, H * dv]`` of all of
    them, in two numba calls (:func:`tandem.ops.cpu.attention.mla_many`); ``attn`` the MLA module."""
    ix = attn.indexer
    return torch.from_numpy(
        _attention.mla_many(
            rows, caches, lengths, ix.index_kpool_compress_ape, ix.kp, ix.k_pools, attn.scaling, ix.d**-0.5, ix.h**-0.5
        )
    )[None]


def mla_rows_triton(k: KernelSettings, x: torch.Tensor) -> bool:
    """Whether MLA rows ``x`` of several sequences take :func:`dsa_select_rows` and :func:`mla_attend_rows`."""
    return _triton(k, x) and x.shape[0] == 1


def dsa_select_rows(iq, iw, pks, lengths, q_pos, kv_lens, kp: int, k_pools: int):
    """The Triton DSA indexer over several sequences' rows (:func:`tandem.ops.triton.dsa_indexer.select_rows`)."""
    from .triton import dsa_indexer

    return dsa_indexer.select_rows(iq, iw, pks, lengths, q_pos, kv_lens, kp, k_pools)


def mla_attend_rows(q, ks, vs, mask, lengths, scaling: float) -> torch.Tensor:
    """The Triton MLA attention over several sequences' caches (:func:`tandem.ops.triton.mla_attention.attend_rows`)."""
    from .triton import mla_attention as kernel

    return kernel.attend_rows(q, ks, vs, mask, lengths, scaling)


def block_attention(k: KernelSettings, x, q, kb, vb, ctx_k: list, ctx_v: list) -> torch.Tensor | None:
    """The DFlash block attention with per-sequence context K/V in the Triton kernel (rows ``x`` decide), or
    None."""
    if k.triton_on(x):
        from .triton import block_attention as kernel

        return kernel.block_attention(q, kb, vb, ctx_k, ctx_v)
    return None


def sampler_targets(k: KernelSettings, logits: torch.Tensor, lengths: list[int], samplers: list | None):
    """Every verify row's target and top-2 gap in the fused Triton sampler
    (:func:`tandem.ops.triton.sampler.targets_and_gaps`; ``logits`` decide), or None."""
    if k.triton_on(logits):
        from .triton import sampler

        return sampler.targets_and_gaps(logits, lengths, samplers)
    return None


# -- KDA ----------------------------------------------------------------------------------------------------


def kda_rows_triton(k: KernelSettings, x: torch.Tensor, q, kk, v, g, beta, S, needs_grad: bool) -> tuple | None:
    """The KDA verify recurrence ``(o, every row's state)`` in the Triton kernel (rows ``x`` decide; not where
    autograd needs a backward), or None."""
    if k.triton_on(x) and not needs_grad:
        from .triton import kda_verify

        return kda_verify.kda_rows(q, kk, v, g, beta, S)
    return None


#: the KDA rows of several sequences in one numba call (conv, gates, recurrence, output norm)
kda_rows_fused = _kda.kda_rows_fused

# -- whole blocks and the compiled decode loop (the row-invariant CPU path) -----------------------------------


def ffn_block(k: KernelSettings, layer: nn.Module, streams: torch.Tensor) -> torch.Tensor | None:
    """The FFN half of decoder block ``layer`` on streams ``[1, T, n, D]`` in one numba call (row-invariant mode,
    fp32, a block that fits), or None."""
    if k.rows and streams.dtype == _F32 and streams.shape[0] == 1 and k.numba_on(streams) and _block.ffn_fits(layer):
        return _block.ffn_block(layer, streams)
    return None


#: whether a KDA block runs whole in one call (:func:`kda_block`); an MLA block (:func:`mla_block`)
kda_fits, mla_fits = _block.kda_fits, _mla_block.fits
#: a KDA / an MLA decoder block on several sequences' rows in one numba call
kda_block, mla_block = _block.kda_block, _mla_block.mla_block


def stream_mean(k: KernelSettings, streams: torch.Tensor) -> torch.Tensor | None:
    """The mean of streams ``[1, T, N, D]`` over ``N`` as the compiled decode steps compute it (row-invariant
    mode, fp32), or None."""
    if k.rows and streams.shape[0] == 1 and streams.dtype == _F32 and k.numba_on(streams):
        return _trunk_pass.stream_mean(streams)
    return None


#: plain decode steps of several sequences compiled (:func:`tandem.ops.cpu.decode.decode_steps`)
decode_steps = _decode.decode_steps
#: a greedy verify pass of several sequences compiled (:func:`tandem.ops.cpu.trunk_pass.verify_rows`)
verify_rows = _trunk_pass.verify_rows
#: a function over groups of sequences on the decode threads (:func:`tandem.ops.cpu.groups.run_groups`)
run_groups = _groups.run_groups
#: the decode threads' start-up (:func:`tandem.ops.cpu.groups.set_pool_initializer`)
set_pool_initializer = _groups.set_pool_initializer


def compiled_pass_fits(trunk: nn.Module) -> bool:
    """Whether the trunk's compiled pass (:mod:`tandem.ops.cpu.trunk_pass`) serves ``trunk``: every layer fused."""
    return _trunk_pass._plan(trunk) is not None


def dflash_burst_fits(model: nn.Module, head: nn.Module) -> bool:
    """Whether the compiled drafter round serves the DFlash drafter ``model`` with the trunk's LM ``head`` inside a
    compiled speculative burst (:func:`spec_burst`): fp32 weights on the CPU with its numba kernels on, a
    :class:`ServingLinear` head."""
    return _dflash.fits(model, model.fc.weight) and isinstance(head, ServingLinear)


def spec_burst(trunk: nn.Module, drafter: nn.Module, head: nn.Module, *args) -> list[dict] | None:
    """Up to ``rounds`` greedy speculative rounds of a DFlash ``drafter`` with the trunk's LM ``head`` (a
    :class:`ServingLinear`) and the ``trunk`` in one compiled call per group of sequences:
    :func:`tandem.ops.cpu.spec_burst.spec_burst` with ``args`` from ``caches`` on (it names them); or None (nothing
    changed) when the compiled passes do not serve them (:func:`dflash_burst_fits`, :func:`compiled_pass_fits`)."""
    if not dflash_burst_fits(drafter, head) or not compiled_pass_fits(trunk):
        return None
    return _spec_burst.spec_burst(trunk, drafter, head.weight, head.kernels.replace(rows=True), *args)


def dflash_round(
    model: nn.Module,
    embed: torch.Tensor,
    head: nn.Module,
    ctx,
    features: torch.Tensor,
    anchor: int,
    k: int,
    threads: int = 1,
) -> list[int] | None:
    """A DFlash drafter's round of one sequence (ingest ``features [n, F]`` into its
    :class:`~tandem.ops.state.ContextKV` ``ctx``, draft ``k`` tokens after ``anchor``) in one compiled call
    (:func:`tandem.ops.cpu.dflash.draft_round`) with the trunk's ``embed`` weight and LM ``head`` (a
    :class:`ServingLinear`, row-invariant), its large GEMMs split across ``threads``
    (:func:`~tandem.ops.cpu.groups.kernel_threads`), or None when the CPU kernels do not serve ``model`` (nothing
    changed)."""
    if not _dflash.fits(model, features) or not isinstance(head, ServingLinear):
        return None
    with _groups.kernel_threads(threads):
        return _dflash.draft_round(
            model, embed, head.weight, head.kernels.replace(rows=True), ctx, features, anchor, k
        )[0]
