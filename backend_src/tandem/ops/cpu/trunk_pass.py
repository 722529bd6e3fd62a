"""The trunk's greedy pass in one numba call on the CPU serving path (row-invariant mode, fp32).

A pass through :meth:`Trunk.verify_many <tandem.model.trunk.Trunk.verify_many>` runs one numba call per decoder
block, with Python between them (plans, cache views, buffers, the LM head, the targets) that costs about as much
as the kernels on the shipped miniature. Here one compiled function (:func:`_forward`) runs a whole pass of the
rows of several sequences: embed every row, every block (:func:`~tandem.ops.cpu.block._kda_attn` /
:func:`~tandem.ops.cpu.mla_block._mla_attn`, then :func:`~tandem.ops.cpu.block._ffn` /
:func:`~tandem.ops.cpu.block._dense_ffn`, exactly what the fused blocks run), the final mean over the mHC streams
and norm, the LM head (:func:`~tandem.ops.cpu.gemm._mmp`) on every row and the greedy target with its top-2 gap
(:func:`~tandem.ops.cpu.kernels._top2`). :func:`verify_rows` is a verify round's pass (the anchor and the drafts of
each sequence, every row's KDA state kept for the commit of the accepted prefix);
:mod:`tandem.ops.cpu.decode` runs many one-row passes in one call.

Every kernel is the one the verify pass runs, in the same order on the same rows, so each row's target, gap,
hidden row and features, and the caches after, are bit-identical to the verify pass
(``tests/test_cpu_decode.py``); with the row-invariant kernels that is also what a batch of sessions computes
for the row.
"""

from __future__ import annotations

import typing
import weakref

import numpy as np
import torch
from numba import njit

from . import block, mla_block
from ..state import KDARows
from .attention import cache_args
from .block import _dense_ffn, _ffn, _kda_attn
from .gemm import _mmp, cols, kernel_weight
from .groups import run_groups
from .kernels import _F, _rms, _top2, compiled_call, np_param, typed_list
from .mla_block import _mla_attn

_KDA, _MLA = 0, 1  # attention kinds
_MOE, _DENSE = 0, 1  # FFN kinds


@njit(cache=True, nogil=True)
def _stream_mean(s, out):  # pragma: no cover - numba
    # out [N, D] = the mean of streams s [N, n, D] over n: summed in stream order, then divided by n
    N, n, D = s.shape
    for r in range(N):
        for d in range(D):
            a = s[r, 0, d]
            for c in range(1, n):
                a += s[r, c, d]
            out[r, d] = a / _F(n)


def stream_mean(s: torch.Tensor) -> torch.Tensor:
    """The mean of fp32 streams ``[1, T, n, D]`` over the streams: ``[1, T, D]``, each element summed in
    stream order and divided by ``n`` (what the trunk's final norm and the DFlash features take in the
    row-invariant mode, and what :func:`decode_steps` computes)."""
    x = s[0].contiguous().numpy()
    out = np.empty((x.shape[0], x.shape[2]), _F)
    _stream_mean(x, out)
    return torch.from_numpy(out)[None]


@njit(cache=True, nogil=True)
def _forward(w, feat_slot, tok, offs, s_idx, kda_in, kda_out, keep, mla, outs):  # pragma: no cover - numba
    # one trunk pass of the rows tok [N] (int64) of S sequences, sequence j's rows offs[j]:offs[j+1]; w the model's
    # arguments (_Plan.args). KDA layer a (in order): kda_in = (tails [La, 3C, W], t_col [S], S0 [La, S, H, dk, dk]),
    # sequence j's tail at columns t_col[j] .. t_col[j]+km1 of tails[a] and its state S0[a, s_idx[j]]; kda_out =
    # (full [La, 3C, N+S*km1], states [La, N or S, H, dk, dk]) the states after (every row's with keep, else each
    # sequence's last), as _kda_many fills them. MLA layer m: mla = (ptrs, used, pools) [Lm, S, ...] as cache_args
    # makes them (room reserved; used / pools advance here). outs = (out_tok [N] the greedy targets, out_gap [N]
    # their top-2 gaps, out_h [N, D] the final hidden rows, out_f [N, F] the stream means of the layers with
    # feat_slot >= 0).
    embed, hcs_a, hcs_f, kind, a_idx, f_kind, f_idx, kdas, mlas, moes, denses, kps, norm_w, norm_eps, lm_w, hc_n = w
    tails, t_col, S0 = kda_in
    full, states = kda_out
    ptrs, used, pools = mla
    out_tok, out_gap, out_h, out_f = outs
    N, D, S = tok.shape[0], embed.shape[1], offs.shape[0] - 1
    s = np.empty((N, hc_n, D), _F)
    for r in range(N):
        for c in range(hc_n):
            s[r, c] = embed[tok[r]]
    mean = np.empty((N, D), _F)
    for i in range(kind.shape[0]):
        a = a_idx[i]
        if kind[i] == 0:
            s = _kda_attn(s, hcs_a[i], kdas[a], tails[a], t_col, S0[a], s_idx, offs, full[a], states[a], keep)
        else:
            s = _mla_attn(s, hcs_a[i], mlas[a], offs, ptrs[a], used[a], pools[a])
            for j in range(S):
                used[a, j] += offs[j + 1] - offs[j]
                pools[a, j] = used[a, j] // kps[a]
        if f_kind[i] == 0:
            s = _ffn(s, hcs_f[i], moes[f_idx[i]])
        else:
            s = _dense_ffn(s, hcs_f[i], denses[f_idx[i]])
        if feat_slot[i] >= 0:
            _stream_mean(s, mean)
            out_f[:, feat_slot[i] * D : (feat_slot[i] + 1) * D] = mean
    _stream_mean(s, mean)
    _rms(mean, norm_w, norm_eps, out_h)
    logits = np.empty((N, cols(lm_w)), _F)
    _mmp(out_h, lm_w, 0, cols(lm_w), logits)
    _top2(logits, out_tok, out_gap)


class _Plan:
    """The compiled loop's per-layer arguments for one model (remade when a layer's plan is)."""

    __slots__ = ("key", "args", "kda_layers", "mla_layers", "like", "kda_idx", "mla_idx", "tensors", "wkey", "entry")


#: model -> its loop arguments; an entry goes with its model
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, _Plan]" = weakref.WeakKeyDictionary()


def _layer_plans(model, sources: list) -> tuple | None:
    """Per trunk layer ``(attention kind, attention args, FFN kind, FFN args, layer)`` from the fused
    blocks' plans, or None when a layer does not run fused (:func:`~tandem.ops.cpu.block.kda_fits`,
    :func:`~tandem.ops.cpu.mla_block.fits`, :func:`~tandem.ops.cpu.block.ffn_fits`); the plans' tensors go
    to ``sources``."""
    out = []
    for layer in list(model.layers)[: model.cfg.num_hidden_layers]:
        if block.kda_fits(layer):
            a = block._kda_plan(layer)
            attn = (_KDA, a.args)
        elif mla_block.fits(layer):
            a = mla_block._mla_plan(layer)
            attn = (_MLA, a.args)
        else:
            return None
        f = block._ffn_plan(layer)
        if f.fits:
            ffn = (_MOE, f.args)
        elif (f := block._dense_plan(layer)).fits and layer.kernels.fused:
            ffn = (_DENSE, f.args)
        else:
            return None
        sources += a.sources + f.sources
        out.append((*attn, *ffn, layer))
    return tuple(out)


def _weights_key(p: _Plan, model) -> tuple:
    """What an in-place change, a replaced tensor or new kernel settings would change: checked at every call."""
    return (model.kernels, tuple((t.data_ptr(), t._version) for t in p.tensors))


def _plan(model) -> _Plan | None:
    """The loop's arguments for ``model`` (cached while every tensor they come from stays: one look at their
    versions a call, :func:`_weights_key`; the layers' plans asked again otherwise), or None when the loop does
    not apply: a layer not fused, an empty kind (the typed lists need an element), the LM head not
    strip-packed."""
    p = _PLANS.get(model)
    if p is not None and _weights_key(p, model) == p.wkey:
        return p
    block.new_pass()
    sources: list = []
    layers = _layer_plans(model, sources)
    lm = kernel_weight(model.lm_head.weight, model.kernels)
    if layers is None or not isinstance(lm, tuple):
        return None
    key = tuple(x[1] for x in layers) + tuple(x[3] for x in layers) + (lm,)  # the plans' own argument tuples
    tensors = [*sources, model.lm_head.weight, model.embed_tokens.weight, model.norm.weight]
    if p is not None and len(p.key) == len(key) and all(a is b for a, b in zip(p.key, key)):
        p.tensors = tensors
        p.wkey = _weights_key(p, model)
        return p
    kinds = {k: [x for x in layers if x[0] == k] for k in (_KDA, _MLA)}
    ffns = {k: [x for x in layers if x[2] == k] for k in (_MOE, _DENSE)}
    if any(not v for v in (*kinds.values(), *ffns.values())):
        return None
    a_idx = [[id(y) for y in kinds[x[0]]].index(id(x)) for x in layers]  # its place among its kind
    f_idx = [[id(y) for y in ffns[x[2]]].index(id(x)) for x in layers]
    p = _Plan()
    p.key = key
    p.kda_layers = [x[4] for x in kinds[_KDA]]
    p.mla_layers = [x[4] for x in kinds[_MLA]]
    p.like = [x[1][2] for x in kinds[_MLA]]
    p.kda_idx = [i for i, x in enumerate(layers) if x[0] == _KDA]
    p.mla_idx = [i for i, x in enumerate(layers) if x[0] == _MLA]
    norm = model.norm
    #: the compiled functions' first arguments, in order (see :func:`_forward`)
    p.args = (
        np_param(model.embed_tokens.weight),
        typed_list([x[1][0] for x in layers]),
        typed_list([x[3][0] for x in layers]),
        np.array([x[0] for x in layers], np.int64),
        np.array(a_idx, np.int64),
        np.array([x[2] for x in layers], np.int64),
        np.array(f_idx, np.int64),
        typed_list([x[1][1] for x in kinds[_KDA]]),
        typed_list([x[1][1] for x in kinds[_MLA]]),
        typed_list([x[3][1] for x in ffns[_MOE]]),
        typed_list([x[3][1] for x in ffns[_DENSE]]),
        np.array([x[1][1][12] for x in kinds[_MLA]], np.int64),
        np_param(norm.weight),
        _F(norm.variance_epsilon),
        lm,
        model.cfg.hc_mult,
    )
    p.tensors = tensors
    p.wkey = _weights_key(p, model)
    p.entry = {}
    _PLANS[model] = p
    return p


def relayout() -> None:
    """Forget every model's loop arguments (the serving layout's fused weights were rebound)."""
    _PLANS.clear()


class _Shapes(typing.NamedTuple):
    """The KDA layers' sizes: conv taps - 1, channels ``3 C``, heads, head dim; and the layer counts."""

    km1: int
    C3: int
    H: int
    dk: int
    La: int
    Lm: int


def _shapes(p: _Plan) -> _Shapes:
    a0 = p.kda_layers[0].self_attn
    return _Shapes(a0.kernel - 1, 3 * a0.qkv, a0.h, a0.dk, len(p.kda_layers), len(p.mla_layers))


def _starts(caches: list, p: _Plan, z: _Shapes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tails [La, 3C, S*km1], S0 [La, S, H, dk, dk], columns [S])``: a copy of every sequence's committed KDA
    tail and state (zeros for an empty cache), sequence ``j``'s tail at columns ``j*km1 ..``."""
    S, km1 = len(caches), z.km1
    tails, S0 = np.zeros((z.La, z.C3, S * km1), _F), np.zeros((z.La, S, z.H, z.dk, z.dk), _F)
    for a, i in enumerate(p.kda_idx):
        for j, c in enumerate(caches):
            st = c.layers[i]
            if st is not None:
                tails[a, :, j * km1 : (j + 1) * km1] = st.tail[0].numpy()
                S0[a, j] = st.S[0].numpy()
    return tails, S0, np.arange(S, dtype=np.int64) * km1


#: the buffers of the verify passes whose rows caches may still hold: id of layer 0's ``full`` view -> (a weak
#: reference to it, ``full [La, 3C, W]``, ``states [La, N, H, dk, dk]``)
_PASSES: dict[int, tuple] = {}


def _keep_pass(view: torch.Tensor, full: np.ndarray, states: np.ndarray) -> None:
    def gone(ref, key=id(view)):  # (any thread: a newer entry under the same id stays)
        if _PASSES.get(key, (None,))[0] is ref:
            _PASSES.pop(key, None)

    _PASSES[id(view)] = (weakref.ref(view, gone), full, states)


def _starts_in_place(caches: list, p: _Plan) -> tuple | None:
    """``(tails [La, 3C, W], S0 [La, N, H, dk, dk], columns [S], rows [S])`` read where one earlier verify pass
    wrote them, without a copy: when every KDA state of ``caches`` is a committed row of that one pass (the
    usual case of a speculative round after the last); sequence ``j``'s tail at ``columns[j]``, its state
    ``S0[a, rows[j]]``. Else None (:func:`_starts` copies)."""
    from ..state import KDAState

    st = caches[0].layers[p.kda_idx[0]]
    rec = _PASSES.get(id(st.rows.full)) if type(st) is KDAState and st.rows is not None else None
    if rec is None or rec[0]() is not st.rows.full:
        return None
    _, full, states = rec
    cols, rows = np.empty(len(caches), np.int64), np.empty(len(caches), np.int64)
    for j, c in enumerate(caches):
        first = c.layers[p.kda_idx[0]]
        if type(first) is not KDAState or first.rows is None:
            return None
        col, row, n = first.rows.col, first.rows.row, first.n_rows
        cols[j], rows[j] = col + n, row + n - 1
        for a, i in enumerate(p.kda_idx):
            st = c.layers[i]
            if (
                type(st) is not KDAState
                or st.rows is None
                or (st.rows.col, st.rows.row, st.n_rows) != (col, row, n)
                or st.rows.full.data_ptr() != full[a].ctypes.data
                or st.rows.states.data_ptr() != states[a].ctypes.data
            ):
                return None
    return full, states, cols, rows


def kda_starts(caches: list, p: _Plan, z: _Shapes) -> tuple[tuple, bool]:
    """``((tails, S0, columns, rows), in_place)``: every sequence's committed KDA tails and states where a pass can
    read them, read in place where one earlier verify pass wrote them all (:func:`_starts_in_place`), else a copy
    (:func:`_starts`, ``rows`` then ``0 .. S-1``)."""
    kept = _starts_in_place(caches, p)
    if kept is not None:
        return kept, True
    tails, S0, t_col = _starts(caches, p, z)
    return (tails, S0, t_col, np.arange(len(caches), dtype=np.int64)), False


def _mla_args(caches: list, p: _Plan, lengths: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per MLA layer ``m`` the :func:`~tandem.ops.cpu.attention.cache_args` arrays ``ptrs [Lm, S, 10]``,
    ``used [Lm, S]``, ``pools [Lm, S]`` of the caches, with room for ``lengths[j]`` more rows reserved."""
    Lm, S = len(p.mla_idx), len(caches)
    ptrs, used, pools = np.empty((Lm, S, 10), np.int64), np.empty((Lm, S), np.int64), np.empty((Lm, S), np.int64)
    for m, i in enumerate(p.mla_idx):
        _, ptrs[m], used[m], pools[m] = cache_args([c.layers[i] for c in caches], lengths, p.like[m])
    return ptrs, used, pools


def _slots(model, features: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """Per trunk layer its place among the sorted ``features`` layers (-1: not one), and how many (a layer past the
    trunk's last exports nothing, as in the verify pass)."""
    n = model.cfg.num_hidden_layers
    feats = sorted(i for i in set(features) if i < n)
    return np.array([feats.index(i) if i in feats else -1 for i in range(n)], np.int64), len(feats)


def verify_rows(
    model,
    caches: list,
    rows: list[list[int]],
    features: tuple[int, ...] = (),
    groups: list[range] | None = None,
    split: int = 1,
) -> list[dict] | None:
    """One greedy verify pass of every sequence's ``rows[j]`` (``R_j`` tokens: the anchor, then the drafts)
    after the committed rows of ``caches[j]`` (no verify pending), in one compiled call per group of
    ``groups`` (consecutive sequences; default one group), the groups side by side on threads of their own
    (:func:`~tandem.ops.cpu.groups.run_groups`; one group splits its GEMMs across ``split`` threads):
    each row's target, gap, hidden row and features, and the caches after, are bit-identical to
    :meth:`~tandem.model.trunk.Trunk.verify_many` followed by the LM head and the greedy top-2
    (``tests/test_cpu_decode.py``). Every sequence's rows stay pending (``cache.pending``, ``R_j`` rows;
    ``commit(n)`` keeps the first ``n``).

    Returns per sequence ``{"tokens": [R] int64, "gaps": [R] fp32, "hidden": [R, D] fp32, "features": [R, F]
    fp32}``, or None (nothing changed) when the compiled pass does not apply (:func:`_plan`). Requires the
    row-invariant mode (:meth:`~tandem.model.trunk.Trunk._invariant_rows`)."""
    p = _plan(model)
    if p is None:
        return None
    for c, r in zip(caches, rows):
        assert c.pending is None and r and c.pos + len(r) <= c.max_ctx, (c.pending is None, c.pos, len(r), c.max_ctx)
    parts = [([caches[j] for j in g], [rows[j] for j in g]) for g in (groups or [range(len(caches))])]
    return run_groups(lambda part: _verify_group(model, p, *part, features), parts, split)


def _verify_group(model, p: _Plan, caches: list, rows: list[list[int]], features: tuple[int, ...]) -> list[dict]:
    """:func:`verify_rows` of one group of sequences: their arrays, one :func:`_forward` call, their caches."""
    S, D, z = len(caches), model.cfg.hidden_size, _shapes(p)
    lengths = [len(r) for r in rows]
    N = sum(lengths)
    offs = np.zeros(S + 1, np.int64)
    np.cumsum(lengths, out=offs[1:])
    tails, S0, t_col, s_idx = kda_starts(caches, p, z)[0]
    ptrs, used, pools = _mla_args(caches, p, lengths)
    slot, nf = _slots(model, features)
    full = np.empty((z.La, z.C3, N + S * z.km1), _F)
    states = np.empty((z.La, N, z.H, z.dk, z.dk), _F)
    outs = (np.empty(N, np.int64), np.empty(N, _F), np.empty((N, D), _F), np.zeros((N, nf * D), _F))
    tok = np.array([t for r in rows for t in r], np.int64)
    args = (p.args, slot, tok, offs, s_idx, (tails, t_col, S0), (full, states), True, (ptrs, used, pools), outs)
    compiled_call(_forward, p.entry, "verify", args)
    for c, n in zip(caches, lengths):
        c.pending, c.pending_rows = {}, n
        for i in p.mla_idx:
            c.layers[i].extend(n)
    o = offs.tolist()
    for a, i in enumerate(p.kda_idx):
        ft, st = torch.from_numpy(full[a])[None], torch.from_numpy(states[a])[None]
        for j, c in enumerate(caches):
            c.pending[i] = KDARows(ft, st, z.km1, o[j] + j * z.km1, o[j])
        if a == 0:  # the next pass over these caches reads their kept rows here (_starts_in_place)
            _keep_pass(ft, full, states)
    tok_t, gap_t, h_t, f_t = (torch.from_numpy(x) for x in outs)
    return [
        {"tokens": tok_t[a:b], "gaps": gap_t[a:b], "hidden": h_t[a:b], "features": f_t[a:b]} for a, b in zip(o, o[1:])
    ]
