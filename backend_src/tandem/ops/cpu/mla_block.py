"""An MLA / DSA decoder block in one numba call on the CPU serving path (row-invariant mode, fp32).

Through :meth:`DecoderLayer.run <tandem.model.block.DecoderLayer.run>` an indexed-attention block of
one decode row cost ~1 ms, ~0.5 ms of it in :meth:`MLAttention.project
<tandem.model.mla.MLAttention.project>`'s two dozen small torch ops (each ~10-25 us here) around
three GEMMs, against ~0.2 ms of kernels. Here one compiled function runs the whole block: the mHC
weights and block norm (:func:`~tandem.ops.cpu.block._hc_in`), the fused input GEMM (``q_a``,
``kv_a``, the indexer's key, head weights and pool gate), the ``q_a`` and ``kv_a`` RMSNorms and the
indexer key's LayerNorm, the fused query GEMM (``q_b`` and the indexer's queries), ``kv_b``, the
append of every sequence's rows to its cache in place with the DSA pools they complete and the
attention over the selected tokens (:func:`~tandem.ops.cpu.attention._append_many`,
:func:`~tandem.ops.cpu.attention._attend_many`), ``o_proj``, the mHC merge, then the MoE half
(:func:`~tandem.ops.cpu.block._ffn`).

The same kernels run in the same order as the block run op by op in the serving mode (the norms are
:func:`~tandem.ops.cpu.kernels.rms_norm` / :func:`~tandem.ops.cpu.kernels.layer_norm` there too),
so the streams out, the caches and the pools are bit-identical to that path (``tests/test_cpu_block.py``),
and every step works row by row in a fixed order: a row's output is bit-identical alone (plain
decoding), in a verify block or in a batch of sessions.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from .attention import _append_many, _attend_many, cache_args
from . import block
from .block import _f32, _ffn, _ffn_plan, _gemm, _hc_args, _hc_in, _plan
from .gemm import kernel_weight
from .kernels import _F, _hc_merge, _layer_norm, _rms, np_param, np_rows


@njit(cache=True, nogil=True)
def _mla_attn(s, hc, mla, offs, ptrs, used, pools):  # pragma: no cover - numba
    # the attention half of an MLA block: streams s [N, n, D] -> [N, n, D]; every sequence j's rows
    # offs[j]:offs[j+1] appended to its cache buffers (ptrs[j], used[j] rows and pools[j] pools before)
    (
        w_fx,
        w_fq,
        w_kvb,
        w_o,
        qa_w,
        qa_eps,
        kva_w,
        kva_eps,
        kn_w,
        kn_b,
        kn_eps,
        ape,
        kp,
        k_pools,
        scaling,
        q_scale,
        w_scale,
        H,
        dqk,
        dv,
        qr,
        kvr,
        di,
        Hi,
    ) = mla
    N = s.shape[0]
    post, comb, x = _hc_in(s, hc)
    fx = _gemm(x, w_fx)  # q_a | kv_a | indexer key | indexer head weights | pool gate
    c1, c2 = qr, qr + kvr
    c3, c4 = c2 + di, c2 + di + Hi
    q_resid, latent, ik = np.empty((N, qr), _F), np.empty((N, kvr), _F), np.empty((N, di), _F)
    _rms(fx[:, :c1], qa_w, qa_eps, q_resid)
    _rms(fx[:, c1:c2], kva_w, kva_eps, latent)
    _layer_norm(fx[:, c2:c3], kn_w, kn_b, kn_eps, ik)
    iw, ig = np.ascontiguousarray(fx[:, c3:c4]), np.ascontiguousarray(fx[:, c4 : c4 + di])
    fq = _gemm(q_resid, w_fq)  # q_b | indexer queries
    kv = _gemm(latent, w_kvb)  # per head: k | v
    q, k, v = np.empty((N, H, dqk), _F), np.empty((H, N, dqk), _F), np.empty((H, N, dv), _F)
    for r in range(N):
        for h in range(H):
            a = h * (dqk + dv)
            q[r, h] = fq[r, h * dqk : (h + 1) * dqk]
            k[h, r] = kv[r, a : a + dqk]
            v[h, r] = kv[r, a + dqk : a + dqk + dv]
    iq = np.ascontiguousarray(fq[:, H * dqk :])
    _append_many(latent, k, v, ik, ig, ape, offs, ptrs, used, pools)
    seen = used + (offs[1:] - offs[:-1])
    o = np.empty((N, H * dv), _F)
    _attend_many(q, iq, iw, offs, ptrs, seen, seen // kp, kp, k_pools, scaling, q_scale, w_scale, o)
    out = np.empty((N, s.shape[1], s.shape[2]), _F)
    _hc_merge(post, comb, _gemm(o, w_o), s, out)
    return out


@njit(cache=True, nogil=True)
def _mla_block(s, hc_a, hc_f, moe, mla, offs, ptrs, used, pools):  # pragma: no cover - numba
    # an MLA + MoE block: s [N, n, D] -> [N, n, D]
    return _ffn(_mla_attn(s, hc_a, mla, offs, ptrs, used, pools), hc_f, moe)


def _fits(layer) -> bool:
    a = layer.self_attn
    return (
        layer.layer_type == "indexed_attention"
        and getattr(a, "_fused_q", None) is not None
        and _f32(
            getattr(a, "_fused_x", (None,))[0],
            a._fused_q[0],
            a.kv_b_proj.weight,
            a.o_proj.weight,
            a.q_a_layernorm.weight,
            a.kv_a_layernorm.weight,
            a.indexer.k_norm.weight,
            layer.attn_hc.fn,
        )
    )


def _sources(layer) -> list[torch.Tensor]:
    a, hc = layer.self_attn, layer.attn_hc
    ix = a.indexer
    return [
        hc.fn,
        hc.base,
        hc.scale,
        layer.input_layernorm.weight,
        a._fused_x[0],
        a._fused_q[0],
        a.kv_b_proj.weight,
        a.o_proj.weight,
        a.q_a_layernorm.weight,
        a.kv_a_layernorm.weight,
        ix.k_norm.weight,
        ix.k_norm.bias,
        ix.index_kpool_compress_ape,
    ]


def _mla_plan(layer):
    def make():
        a, k = layer.self_attn, layer.kernels
        ix = a.indexer
        qr, kvr, di, Hi, dg = a._fused_x[1]
        assert dg == di == ix.d and Hi == ix.h, (
            a._fused_x[1],
            ix.d,
            ix.h,
        )  # the fused group's order (MLAttention.FUSED)
        mla = (
            kernel_weight(a._fused_x[0], k),
            kernel_weight(a._fused_q[0], k),
            kernel_weight(a.kv_b_proj.weight, k),
            kernel_weight(a.o_proj.weight, k),
            np_param(a.q_a_layernorm.weight),
            _F(a.q_a_layernorm.variance_epsilon),
            np_param(a.kv_a_layernorm.weight),
            _F(a.kv_a_layernorm.variance_epsilon),
            np_param(ix.k_norm.weight),
            np_param(ix.k_norm.bias),
            _F(ix.k_norm.eps),
            np_param(ix.index_kpool_compress_ape),
            ix.kp,
            ix.k_pools,
            _F(a.scaling),
            _F(ix.d**-0.5),
            _F(ix.h**-0.5),
            a.h,
            a.dqk,
            a.dv,
            qr,
            kvr,
            di,
            Hi,
        )
        like = {
            "latent": torch.empty(1, 0, kvr),
            "k": torch.empty(1, a.h, 0, a.dqk),
            "v": torch.empty(1, a.h, 0, a.dv),
            "ik": torch.empty(1, 0, di),
            "ig": torch.empty(1, 0, di),
        }
        return _hc_args(layer.attn_hc, layer.input_layernorm), mla, like

    return _plan(layer, "mla", lambda: _sources(layer), lambda: _fits(layer), make)


def fits(layer) -> bool:
    """Whether ``layer``'s attention half runs here (:func:`mla_block`): MLA / DSA attention with its
    fused input and query projections, fp32."""
    return layer.kernels.fused and _mla_plan(layer).fits


def mla_block(layer, streams: torch.Tensor, caches: list, lengths: list[int]) -> torch.Tensor:
    """``layer`` (MLA / DSA attention; :func:`fits` must hold) on several sequences' rows: streams
    ``[1, sum T, n, D]`` fp32, sequence ``j``'s ``lengths[j]`` rows in turn, appended to its
    :class:`~tandem.model.cache.MLACache` ``caches[j]`` (with the pools they complete) and attending
    over it, in the row-invariant mode: the whole block in one call when its FFN half is a MoE that
    fits (:func:`~tandem.ops.cpu.block.ffn_fits`), else the attention half here and the FFN half as
    :meth:`~tandem.model.block.DecoderLayer.ffn` runs it. Returns the streams out ``[1, sum T, n, D]``."""
    hc_a, mla, like = _mla_plan(layer).args
    offs, ptrs, used, pools = cache_args(caches, lengths, like)
    s = np_rows(streams[0])
    ffn = _ffn_plan(layer)
    block.CALLS["mla_block" if ffn.fits else "mla_attn"] += 1
    if ffn.fits:
        out = torch.from_numpy(_mla_block(s, hc_a, *ffn.args, mla, offs, ptrs, used, pools))[None]
    else:
        out = layer.ffn(torch.from_numpy(_mla_attn(s, hc_a, mla, offs, ptrs, used, pools))[None])
    for c, m in zip(caches, lengths):
        c.extend(m)
    return out
