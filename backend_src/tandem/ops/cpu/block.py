"""A decoder block in one numba call on the CPU serving path (row-invariant mode, fp32).

Between the kernels of :mod:`~tandem.ops.cpu.kernels`, :mod:`~tandem.ops.cpu.kda`,
:mod:`~tandem.ops.cpu.moe` and :mod:`~tandem.ops.cpu.gemm` a block of the tiny trunk spent more
time in Python (torch views, numpy conversions, weight lookups, one dispatch per kernel) than in the
kernels: a KDA + MoE block of one decode row cost ~330 us through :meth:`DecoderLayer.run
<tandem.model.block.DecoderLayer.run>` and ~95 us in its kernels. Here the same kernels run in the
same order on the same arrays, called from one compiled function: the mHC weights and block norm,
the fused input GEMM, the forget-gate and output-gate GEMMs, the KDA rows, ``o_proj``, the mHC merge,
then the FFN half (mHC weights and norm, the router GEMM, routing, the sparse experts, the merge).
A row's output, its KDA rows and states are bit-identical to the unfused path's
(``tests/test_cpu_block.py``), so every exactness property of that path holds here.

Blocks with MLA/DSA attention run the attention as before and their FFN half here
(:func:`ffn_block`); a KDA block with a dense MLP in one call too (:func:`_dense_ffn`, the clamped SwiGLU
of :func:`~tandem.ops.cpu.kernels.swiglu`, as the MLP runs it op by op); MLA blocks in
:mod:`~tandem.ops.cpu.mla_block`; the MTP layer is unchanged.

numba's on-disk cache keys these functions on this file alone, but their compiled code holds the
kernels they call: after editing a kernel in another file of this folder, clear this folder's
``__pycache__`` (a fresh clone has none; ``make setup`` compiles them, :mod:`tandem.model.warm`).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from numba import njit

from ..settings import KernelSettings
from .gemm import _mmp, cols, kernel_weight
from .kda import _kda_many, conv_taps, kda_buffers, kda_results
from .kernels import _F, _hc_merge, _hc_weights, _swiglu, np_param, np_param_t, np_rows
from .moe import _moe_route, _moe_sparse

#: calls so far of the whole block, a KDA attention half and a MoE FFN half; an MLA block and an MLA
#: attention half (:mod:`~tandem.ops.cpu.mla_block`) (tests, benches)
CALLS = {"block": 0, "attn": 0, "ffn": 0, "mla_block": 0, "mla_attn": 0}


@njit(cache=True, nogil=True)
def _hc_in(s, hc):  # pragma: no cover - numba
    # s [N, n, D] streams -> mHC post [N, n], comb [N, n, n] and the normed block input [N, D]
    fn_t, base, scale, iters, eps, norm_eps, nw, nw_eps = hc
    N, n, D = s.shape
    post, comb, col = np.empty((N, n), _F), np.empty((N, n, n), _F), np.empty((N, D), _F)
    _hc_weights(s.reshape(N, n * D), fn_t, base, scale, n, iters, eps, norm_eps, nw, nw_eps, post, comb, col)
    return post, comb, col


@njit(cache=True, nogil=True)
def _gemm(x, w):  # pragma: no cover - numba
    # x [N, D] @ the strip-packed weight w (kernel_weight) -> [N, O]
    out = np.empty((x.shape[0], cols(w)), _F)
    _mmp(np.ascontiguousarray(x), w, 0, cols(w), out)
    return out


@njit(cache=True, nogil=True)
def _ffn(s, hc, moe):  # pragma: no cover - numba
    # the FFN half of a block with a MoE: s [N, n, D] -> [N, n, D]
    w_r, r_bias, top_k, norm, mscale, w_up, w_down, limit = moe
    N, n, D = s.shape
    post, comb, x = _hc_in(s, hc)
    w = np.empty((N, w_down[0].shape[0]), _F)
    _moe_route(_gemm(x, w_r), r_bias, top_k, norm, mscale, w)
    mo = np.zeros((N, D), _F)
    _moe_sparse(x, w, w_up, w_down, limit, mo)
    out = np.empty((N, n, D), _F)
    _hc_merge(post, comb, mo, s, out)
    return out


@njit(cache=True, nogil=True)
def _dense_ffn(s, hc, dense):  # pragma: no cover - numba
    # the FFN half of a block with a dense MLP: s [N, n, D] -> [N, n, D] (the clamped SwiGLU as the experts')
    w_g, w_u, w_d, limit = dense
    N, n, D = s.shape
    post, comb, x = _hc_in(s, hc)
    g = _gemm(x, w_g)
    act = np.empty_like(g)
    _swiglu(g, _gemm(x, w_u), limit, act)
    out = np.empty((N, n, D), _F)
    _hc_merge(post, comb, _gemm(act, w_d), s, out)
    return out


@njit(cache=True, nogil=True)
def _kda_attn(s, hc, kda, tails, t_col, S0, s_idx, offs, full, states, keep):  # pragma: no cover - numba
    # the attention half of a KDA block: s [N, n, D] -> [N, n, D]; full / states filled as _kda_many fills them
    w_x, w_fb, w_gb, w_o, convw, a_log, dt_bias, lower, onw, o_eps, qscale, H, dk = kda
    N, n, D = s.shape
    C = H * dk
    post, comb, x = _hc_in(s, hc)
    ox = _gemm(x, w_x)  # q | k | v | f_a | b | g_a
    mixed = np.ascontiguousarray(ox[:, : 3 * C])
    blog = np.ascontiguousarray(ox[:, 3 * C + dk : 3 * C + dk + H])
    fb, gb = _gemm(ox[:, 3 * C : 3 * C + dk], w_fb), _gemm(ox[:, 3 * C + dk + H : 3 * C + 2 * dk + H], w_gb)
    y = np.empty((N, C), _F)
    _kda_many(
        mixed,
        tails,
        t_col,
        convw,
        fb,
        a_log,
        dt_bias,
        lower,
        blog,
        gb,
        onw,
        o_eps,
        S0,
        s_idx,
        qscale,
        H,
        dk,
        offs,
        full,
        states,
        keep,
        y,
    )
    out = np.empty((N, n, D), _F)
    _hc_merge(post, comb, _gemm(y, w_o), s, out)
    return out


@njit(cache=True, nogil=True)
def _kda_block(s, hc_a, hc_f, moe, kda, tails, t_col, S0, s_idx, offs, full, states, keep):  # pragma: no cover - numba
    # a KDA + MoE block: s [N, n, D] -> [N, n, D]
    return _ffn(_kda_attn(s, hc_a, kda, tails, t_col, S0, s_idx, offs, full, states, keep), hc_f, moe)


@njit(cache=True, nogil=True)
def _kda_dense_block(
    s, hc_a, hc_f, dense, kda, tails, t_col, S0, s_idx, offs, full, states, keep
):  # pragma: no cover - numba
    # a KDA + dense MLP block: s [N, n, D] -> [N, n, D]
    return _dense_ffn(_kda_attn(s, hc_a, kda, tails, t_col, S0, s_idx, offs, full, states, keep), hc_f, dense)


class _Plan:
    """A layer's weight arguments for the kernels, with the tensors they come from."""

    __slots__ = ("sources", "key", "fits", "args", "epoch")


#: layer -> {what: plan}; an entry goes with its layer (a plan holds no reference to it)
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, _Plan]]" = weakref.WeakKeyDictionary()
_EPOCH = [0]


def new_pass() -> None:
    """A model forward begins: each plan checks its tensors again once in it (:func:`_plan`)."""
    _EPOCH[0] += 1


def _plan(layer, what: str, sources, fits, make) -> _Plan:
    """The plan ``what`` of ``layer``: ``fits()`` and ``make()``'s arguments, made again only when a
    tensor of ``sources()`` is replaced or changed in place (its data pointer, version or dtype;
    checked once a model forward, :func:`new_pass`); the tensors themselves are looked up again when
    the layer's serving layout is redone (:func:`relayout`) or a cast changes whether it fits.
    A plan is kept per kernel settings of the layer (``layer.kernels``: the weights are packed for them).
    Threads may ask at once (prime groups): a plan is published whole, and marked checked last."""
    what = (what, layer.kernels)
    epoch = _EPOCH[0]
    plans = _PLANS.get(layer)
    if plans is None:
        plans = _PLANS.setdefault(layer, {})
    p = plans.get(what)
    if p is not None and p.epoch == epoch:
        return p
    if p is None:
        q = _Plan()
        q.sources = q.key = q.fits = q.args = None
        q.epoch = -1
        p = plans.setdefault(what, q)
    key = p.sources and tuple((t.data_ptr(), t._version, t.dtype) for t in p.sources)
    if key is None or key != p.key:
        fit = fits()
        if p.sources is None or fit != p.fits:  # the first look, or a cast: look the sources up
            p.fits, p.sources = fit, sources() if fit else list(layer.parameters())[:1]
            key = tuple((t.data_ptr(), t._version, t.dtype) for t in p.sources)
        p.args, p.key = (make() if p.fits else None), key
    p.epoch = epoch
    return p


def relayout() -> None:
    """Forget every plan (:func:`~tandem.model.layers.input_major_linears` calls it: it rebinds the
    fused weights)."""
    _PLANS.clear()


def _hc_args(hc, norm) -> tuple:
    return (
        np_param_t(hc.fn),
        np_param(hc.base),
        np_param(hc.scale),
        hc.iters,
        _F(hc.eps),
        _F(hc.norm_eps),
        np_param(norm.weight),
        _F(norm.variance_epsilon),
    )


def _moe_args(mo, k: KernelSettings) -> tuple:
    g = mo.gate
    return (
        kernel_weight(g.weight, k),
        np_param(g.e_score_correction_bias),
        g.top_k,
        g.norm_topk_prob,
        _F(g.scale),
        kernel_weight(mo._w_up, k, experts=mo._w_down.shape[0]),
        kernel_weight(mo._w_down, k, transpose=False),
        _F(mo.experts.limit),
    )


def _f32(*ts) -> bool:
    return all(t is not None and t.dtype == torch.float32 for t in ts)


def _ffn_fits(layer) -> bool:
    mo = layer.mlp
    return getattr(mo, "_w_up", None) is not None and _f32(mo._w_up, mo._w_down, mo.gate.weight, layer.ffn_hc.fn)


def _kda_fits(layer) -> bool:
    a = layer.self_attn
    return layer.layer_type == "linear_attention" and _f32(
        getattr(a, "_fused_x", (None,))[0], a.o_proj.weight, a.g_b_proj.weight, layer.attn_hc.fn
    )


def _ffn_sources(layer) -> list[torch.Tensor]:
    mo, hc = layer.mlp, layer.ffn_hc
    return [
        mo._w_up,
        mo._w_down,
        mo.gate.weight,
        mo.gate.e_score_correction_bias,
        hc.fn,
        hc.base,
        hc.scale,
        layer.post_attention_layernorm.weight,
    ]


def _kda_sources(layer) -> list[torch.Tensor]:
    a, hc = layer.self_attn, layer.attn_hc
    return [
        hc.fn,
        hc.base,
        hc.scale,
        layer.input_layernorm.weight,
        a._fused_x[0],
        a.forget_gate.f_b_proj.weight,
        a.g_b_proj.weight,
        a.o_proj.weight,
        a.conv1d.weight,
        a.forget_gate.A_log,
        a.forget_gate.dt_bias,
        a.o_norm.weight,
    ]


def _dense_fits(layer) -> bool:
    mo = layer.mlp
    return hasattr(mo, "gate_proj") and _f32(
        mo.gate_proj.weight, mo.up_proj.weight, mo.down_proj.weight, layer.ffn_hc.fn
    )


def _dense_plan(layer) -> _Plan:
    mo, hc, k = layer.mlp, layer.ffn_hc, layer.kernels
    return _plan(
        layer,
        "dense",
        lambda: [
            mo.gate_proj.weight,
            mo.up_proj.weight,
            mo.down_proj.weight,
            hc.fn,
            hc.base,
            hc.scale,
            layer.post_attention_layernorm.weight,
        ],
        lambda: _dense_fits(layer),
        lambda: (
            _hc_args(hc, layer.post_attention_layernorm),
            (
                kernel_weight(mo.gate_proj.weight, k),
                kernel_weight(mo.up_proj.weight, k),
                kernel_weight(mo.down_proj.weight, k),
                _F(mo.limit),
            ),
        ),
    )


def _ffn_plan(layer) -> _Plan:
    return _plan(
        layer,
        "ffn",
        lambda: _ffn_sources(layer),
        lambda: _ffn_fits(layer),
        lambda: (_hc_args(layer.ffn_hc, layer.post_attention_layernorm), _moe_args(layer.mlp, layer.kernels)),
    )


def _kda_plan(layer) -> _Plan:
    def make():
        a, k = layer.self_attn, layer.kernels
        g = a.forget_gate
        kda = (
            kernel_weight(a._fused_x[0], k),
            kernel_weight(g.f_b_proj.weight, k),
            kernel_weight(a.g_b_proj.weight, k),
            kernel_weight(a.o_proj.weight, k),
            conv_taps(a.conv1d.weight),
            np_param(g.A_log),
            np_param(g.dt_bias),
            _F(g.lower),
            np_param(a.o_norm.weight),
            _F(a.o_norm.variance_epsilon),
            _F(a.dk**-0.5),
            a.h,
            a.dk,
        )
        return _hc_args(layer.attn_hc, layer.input_layernorm), kda

    return _plan(layer, "kda", lambda: _kda_sources(layer), lambda: _kda_fits(layer), make)


def ffn_fits(layer) -> bool:
    """Whether ``layer``'s FFN half runs here (:func:`ffn_block`): a MoE in the serving layout or a dense
    MLP, fp32."""
    return layer.kernels.fused and (_ffn_plan(layer).fits or _dense_plan(layer).fits)


def kda_fits(layer) -> bool:
    """Whether ``layer``'s attention half runs here (:func:`kda_block`): KDA attention with its fused
    input projections, fp32."""
    return layer.kernels.fused and _kda_plan(layer).fits


def ffn_block(layer, streams: torch.Tensor) -> torch.Tensor:
    """The FFN half of ``layer`` (mHC weights and the post-attention norm, the MoE, the mHC merge) on
    streams ``[1, T, n, D]`` fp32 in the row-invariant mode; :func:`ffn_fits` must hold. Returns
    ``[1, T, n, D]``, bit-identical to :meth:`~tandem.model.block.DecoderLayer.run`'s second half."""
    CALLS["ffn"] += 1
    p = _ffn_plan(layer)
    if p.fits:
        return torch.from_numpy(_ffn(np_rows(streams[0]), *p.args))[None]
    return torch.from_numpy(_dense_ffn(np_rows(streams[0]), *_dense_plan(layer).args))[None]


def kda_block(
    layer, streams: torch.Tensor, starts: list, lengths: list[int], keep_states: bool = True
) -> tuple[torch.Tensor, list]:
    """``layer`` (KDA attention; :func:`kda_fits` must hold) on several sequences' rows: streams ``[1,
    sum T, n, D]`` fp32, sequence ``j``'s ``lengths[j]`` rows in turn, starting from ``starts[j]`` (as
    :func:`~tandem.ops.cpu.kda.kda_rows_fused` takes them, read only), in the row-invariant mode:
    the whole block in one call when its FFN half fits too (:func:`ffn_fits`), else the attention
    half here and the FFN half as :meth:`~tandem.model.block.DecoderLayer.run` runs it. Returns the
    streams out ``[1, sum T, n, D]`` and per sequence what
    :meth:`~tandem.model.kda.LinearAttention.forward_rows_many` returns (``keep_states``: every row's
    state, for a verify; else the state after the last row, for a prime), all bit-identical to
    :meth:`~tandem.model.block.DecoderLayer.run` around it."""
    a = layer.self_attn
    hc_a, kda = _kda_plan(layer).args
    K = a.kernel
    offs, full, states, (tails, t_col, S0, s_idx) = kda_buffers(starts, lengths, 3 * a.qkv, K, a.h, keep_states)
    s = np_rows(streams[0])
    ffn = _ffn_plan(layer)
    dense = ffn if ffn.fits else _dense_plan(layer)
    CALLS["block" if dense.fits else "attn"] += 1
    if ffn.fits:
        out = torch.from_numpy(
            _kda_block(s, hc_a, *ffn.args, kda, tails, t_col, S0, s_idx, offs, full, states, keep_states)
        )[None]
    elif dense.fits:
        out = torch.from_numpy(
            _kda_dense_block(s, hc_a, *dense.args, kda, tails, t_col, S0, s_idx, offs, full, states, keep_states)
        )[None]
    else:
        out = layer.ffn(
            torch.from_numpy(_kda_attn(s, hc_a, kda, tails, t_col, S0, s_idx, offs, full, states, keep_states))[None]
        )
    return out, kda_results(offs, full, states, K, keep_states)
