"""Plain greedy decoding steps in one numba call on the CPU serving path (row-invariant mode, fp32).

A plain decode step through :meth:`Trunk.verify_many <tandem.model.trunk.Trunk.verify_many>` runs one
numba call per decoder block, but between them ~1 ms of Python (plans, cache views, buffers, the LM
head, the targets, the scheduler's bookkeeping) against ~0.7 ms of kernels on the shipped miniature.
Here one compiled function runs ``steps`` whole decode steps of several sequences: embed each
sequence's anchor, every block (:func:`~tandem.ops.cpu.block._kda_attn` /
:func:`~tandem.ops.cpu.mla_block._mla_attn`, then :func:`~tandem.ops.cpu.block._ffn` /
:func:`~tandem.ops.cpu.block._dense_ffn`, exactly what the fused blocks run), the final mean over
the mHC streams and norm, the LM head (:func:`~tandem.ops.cpu.gemm._mmp`) and the greedy target with
its top-2 gap (:func:`~tandem.ops.cpu.kernels._top2`); the target is the next step's anchor. This is
multi-step decoding (vLLM's ``num_scheduler_steps``) taken to one call: the Python around the kernels
is paid once per call, not once per token.

Every kernel is the one the verify pass runs, in the same order on the same rows, so each step's
target, gap, hidden row and features are bit-identical to a one-row verify followed by its commit,
and the caches end bit-identical too (``tests/test_cpu_decode.py``); with the row-invariant kernels
that is also what a verify block or a batch of sessions computes for the row.

A call stops after the step in which any sequence emits one of its stop tokens, or after ``steps``;
the caller limits ``steps`` to every sequence's budget and context room.
"""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit
from numba.typed import List

from . import block, mla_block
from ..state import KDARows, KDAState
from .attention import cache_args
from .block import _dense_ffn, _ffn, _kda_attn
from .gemm import _mmp, cols, kernel_weight
from .kernels import _F, _rms, _top2, np_param
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
def _decode(
    tok,
    steps,
    hc_n,
    embed,
    hcs_a,
    hcs_f,
    kind,
    a_idx,
    f_kind,
    f_idx,
    feat_slot,
    kdas,
    mlas,
    moes,
    denses,
    tails0,
    col0,
    S00,
    km1,
    full_buf,
    st_buf,
    ptrs,
    used,
    pools,
    kps,
    norm_w,
    norm_eps,
    lm_w,
    stops,
    stop_offs,
    out_tok,
    out_gap,
    out_h,
    out_f,
):  # pragma: no cover - numba
    # up to `steps` greedy decode steps of S sequences from anchors tok [S] (int64, updated in place);
    # returns the steps run; hc_n mHC streams. Per KDA layer a (in order): tails0[a] [3C, W] (sequence j's
    # tail at columns col0[j] .. col0[j]+km1) / S00[a] [S, H, dk, dk] the states before,
    # full_buf[p, a] [3C, S*(km1+1)] / st_buf[p, a] [S, H, dk, dk] the states after
    # a step of parity p. Per MLA layer m: ptrs[m], used[m], pools[m] as cache_args makes them (room
    # for `steps` rows reserved; used / pools advance here). Outputs per step t: out_tok[t] [S],
    # out_gap[t] [S], out_h[t] [S, D], out_f[t] [S, F].
    S, D = out_h.shape[1], embed.shape[1]
    offs = np.arange(S + 1).astype(np.int64)
    s_idx = np.arange(S).astype(np.int64)
    col = s_idx * (km1 + 1) + 1  # its tail in a step's full (its tail columns, then its row: the last km1)
    h = np.empty((S, D), _F)
    mean = np.empty((S, D), _F)
    logits = np.empty((S, cols(lm_w)), _F)
    done = 0
    for t in range(steps):
        s = np.empty((S, hc_n, D), _F)
        for j in range(S):
            for c in range(hc_n):
                s[j, c] = embed[tok[j]]
        p, q = t % 2, (t + 1) % 2
        for i in range(kind.shape[0]):
            a = a_idx[i]
            if kind[i] == 0:
                if t == 0:
                    s = _kda_attn(
                        s, hcs_a[i], kdas[a], tails0[a], col0, S00[a], s_idx, offs, full_buf[p, a], st_buf[p, a], False
                    )
                else:
                    s = _kda_attn(
                        s,
                        hcs_a[i],
                        kdas[a],
                        full_buf[q, a],
                        col,
                        st_buf[q, a],
                        s_idx,
                        offs,
                        full_buf[p, a],
                        st_buf[p, a],
                        False,
                    )
            else:
                s = _mla_attn(s, hcs_a[i], mlas[a], offs, ptrs[a], used[a], pools[a])
                for j in range(S):
                    used[a, j] += 1
                    pools[a, j] = used[a, j] // kps[a]
            if f_kind[i] == 0:
                s = _ffn(s, hcs_f[i], moes[f_idx[i]])
            else:
                s = _dense_ffn(s, hcs_f[i], denses[f_idx[i]])
            if feat_slot[i] >= 0:
                _stream_mean(s, mean)
                out_f[t, :, feat_slot[i] * D : (feat_slot[i] + 1) * D] = mean
        _stream_mean(s, mean)
        _rms(mean, norm_w, norm_eps, h)
        out_h[t] = h
        _mmp(h, lm_w, 0, cols(lm_w), logits)
        _top2(logits, out_tok[t], out_gap[t])
        done = t + 1
        stop = False
        for j in range(S):
            tok[j] = out_tok[t, j]
            for k in range(stop_offs[j], stop_offs[j + 1]):
                if stops[k] == tok[j]:
                    stop = True
        if stop:
            break
    return done


class _Plan:
    """The compiled loop's per-layer arguments for one model (remade when a layer's plan is)."""

    __slots__ = ("key", "args", "kda_layers", "mla_layers", "like", "kda_idx", "mla_idx")


#: model -> its loop arguments; an entry goes with its model
_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, _Plan]" = weakref.WeakKeyDictionary()


def _layer_plans(model) -> tuple | None:
    """Per trunk layer ``(attention kind, attention args, FFN kind, FFN args, layer)`` from the fused
    blocks' plans, or None when a layer does not run fused (:func:`~tandem.ops.cpu.block.kda_fits`,
    :func:`~tandem.ops.cpu.mla_block.fits`, :func:`~tandem.ops.cpu.block.ffn_fits`)."""
    out = []
    for layer in list(model.layers)[: model.cfg.num_hidden_layers]:
        if block.kda_fits(layer):
            attn = (_KDA, block._kda_plan(layer).args)
        elif mla_block.fits(layer):
            attn = (_MLA, mla_block._mla_plan(layer).args)
        else:
            return None
        f = block._ffn_plan(layer)
        if f.fits:
            ffn = (_MOE, f.args)
        elif (d := block._dense_plan(layer)).fits and layer.kernels.fused:
            ffn = (_DENSE, d.args)
        else:
            return None
        out.append((*attn, *ffn, layer))
    return tuple(out)


@njit(cache=True)
def _list_with(x):  # pragma: no cover - numba
    out = List()
    out.append(x)
    return out


@njit(cache=True)
def _append(out, x):  # pragma: no cover - numba
    out.append(x)


def _typed(items: list) -> List:
    """A numba typed list of ``items`` (one numba type, at least one), filled by cached compiled functions
    whose signatures depend on the element type only: a typed list filled from Python compiles its methods
    at run time, uncached (seconds at every process start)."""
    out = _list_with(items[0])
    for x in items[1:]:
        _append(out, x)
    return out


def _plan(model) -> _Plan | None:
    """The loop's arguments for ``model`` (cached while every layer's plan stays), or None when the
    loop does not apply: a layer not fused, an empty kind (the typed lists need an element), the LM
    head not strip-packed."""
    block.new_pass()
    layers = _layer_plans(model)
    lm = kernel_weight(model.lm_head.weight, model.kernels)
    if layers is None or not isinstance(lm, tuple):
        return None
    key = tuple(x[1] for x in layers) + tuple(x[3] for x in layers) + (lm,)  # the plans' own argument tuples
    p = _PLANS.get(model)
    if p is not None and len(p.key) == len(key) and all(a is b for a, b in zip(p.key, key)):
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
    p.args = dict(
        embed=np_param(model.embed_tokens.weight),
        hcs_a=_typed([x[1][0] for x in layers]),
        hcs_f=_typed([x[3][0] for x in layers]),
        kind=np.array([x[0] for x in layers], np.int64),
        a_idx=np.array(a_idx, np.int64),
        f_kind=np.array([x[2] for x in layers], np.int64),
        f_idx=np.array(f_idx, np.int64),
        kdas=_typed([x[1][1] for x in kinds[_KDA]]),
        mlas=_typed([x[1][1] for x in kinds[_MLA]]),
        moes=_typed([x[3][1] for x in ffns[_MOE]]),
        denses=_typed([x[3][1] for x in ffns[_DENSE]]),
        kps=np.array([x[1][1][12] for x in kinds[_MLA]], np.int64),
        norm_w=np_param(norm.weight),
        norm_eps=_F(norm.variance_epsilon),
        lm_w=lm,
    )
    _PLANS[model] = p
    return p


def decode_steps(
    model,
    caches: list,
    anchors: list[int],
    steps: int,
    stop_ids: list[tuple[int, ...]],
    features: tuple[int, ...] = (),
    threads: int = 1,
) -> list[dict] | None:
    """Up to ``steps`` plain greedy decode steps of every sequence in one call (see the module text):
    sequence ``j`` starts from ``anchors[j]`` after the committed rows of ``caches[j]`` (no verify
    pending; room for ``steps`` rows) and each step's target is its next anchor. The sequences go in
    ``min(threads, S)`` groups of consecutive ones, each group in one compiled call on a thread of its
    own (the rows of different sequences never meet: each row's arithmetic is the same in any group),
    and a group ends after the first step in which one of its sequences' target is in its
    ``stop_ids[j]``. Afterwards each cache is what a one-row verify per step leaves, each but the
    last committed: the last step's row is pending (``cache.pending``, one row; the next call commits
    it).

    Returns per sequence ``{"tokens": [n] int64, "gaps": [n] fp32, "hidden": [n, D] fp32, "features":
    [n, F] fp32}`` (per step: target, top-2 gap, final hidden row, the ``features`` layers' stream
    means; ``n`` steps of its group), or None (nothing changed) when the loop does not apply
    (:func:`_plan`); the caller then runs the verify passes. Requires the row-invariant mode
    (:meth:`~tandem.model.trunk.Trunk._invariant_rows`)."""
    p = _plan(model)
    if p is None:
        return None
    S = len(caches)
    assert steps >= 1 and len(anchors) == S == len(stop_ids) and threads >= 1
    for c in caches:
        assert c.pending is None and c.pos + steps <= c.max_ctx, (c.pending is None, c.pos, steps, c.max_ctx)
    g = min(threads, S)
    bounds = [S * k // g for k in range(g + 1)]
    parts = [(caches[a:b], anchors[a:b], stop_ids[a:b]) for a, b in zip(bounds, bounds[1:])]
    return run_groups(lambda part: _group(model, p, *part, steps, features), parts)


def run_groups(fn, groups: list) -> list:
    """``fn(group)`` for each group, the first on this thread and the others on :func:`thread_pool`'s
    threads at once; their lists of per-sequence results joined in group order. Raises what a call raised."""
    futures = [thread_pool(len(groups) - 1).submit(fn, g) for g in groups[1:]]
    out = list(fn(groups[0]))
    for f in futures:
        out += f.result()
    return out


_POOL: list = [None, 0, None]  # the pool, its threads, what each runs first


def thread_pool(n: int) -> ThreadPoolExecutor:
    """A pool of ``n`` threads at least, kept for the process (the decode groups' and the prime groups'
    threads, :meth:`~tandem.model.trunk.Trunk.prime_many`); each thread first runs :func:`set_pool_initializer`'s."""
    if _POOL[1] < n:
        if _POOL[0] is not None:
            _POOL[0].shutdown(wait=False)
        _POOL[0], _POOL[1] = ThreadPoolExecutor(max(n, 1), thread_name_prefix="tandem-decode", initializer=_POOL[2]), n
    return _POOL[0]


def set_pool_initializer(fn) -> None:
    """``fn()`` runs first on every thread of :func:`thread_pool` from now on (the served trunk sets its compute
    threads' priority: :func:`tandem.serving.process.set_thread_nice`); the threads made before go."""
    _POOL[2] = fn
    if _POOL[0] is not None:
        _POOL[0].shutdown(wait=False)
        _POOL[0], _POOL[1] = None, 0


def _group(
    model,
    p: _Plan,
    caches: list,
    anchors: list[int],
    stop_ids: list[tuple[int, ...]],
    steps: int,
    features: tuple[int, ...],
) -> list[dict]:
    """:func:`decode_steps` of one group of sequences: their arrays, one :func:`_decode` call, their caches."""
    S, D, cfg = len(caches), model.cfg.hidden_size, model.cfg
    a0 = p.kda_layers[0].self_attn
    km1, C3, H, dk = a0.kernel - 1, 3 * a0.qkv, a0.h, a0.dk
    La, Lm = len(p.kda_layers), len(p.mla_layers)
    idx, m_idx = p.kda_idx, p.mla_idx
    carried = _carried(caches, idx, km1)
    if carried is not None:  # the states a previous call left, read where it wrote them
        tails0, S00, col0 = carried
    else:
        tails0, S00 = np.zeros((La, C3, S * km1), _F), np.zeros((La, S, H, dk, dk), _F)
        col0 = np.arange(S, dtype=np.int64) * km1
        for a, i in enumerate(idx):
            for j, c in enumerate(caches):
                st = c.layers[i]
                if st is not None:
                    tails0[a, :, j * km1 : (j + 1) * km1] = st.tail[0].numpy()
                    S00[a, j] = st.S[0].numpy()
    ptrs, used, pools = np.empty((Lm, S, 10), np.int64), np.empty((Lm, S), np.int64), np.empty((Lm, S), np.int64)
    for m, i in enumerate(m_idx):
        _, ptrs[m], used[m], pools[m] = cache_args([c.layers[i] for c in caches], [steps] * S, p.like[m])
    feats = sorted(set(features))
    slot = np.array([feats.index(i) if i in feats else -1 for i in range(cfg.num_hidden_layers)], np.int64)
    full_buf, st_buf = np.empty((2, La, C3, S * (km1 + 1)), _F), np.empty((2, La, S, H, dk, dk), _F)
    stops = np.array([t for ids in stop_ids for t in ids], np.int64)
    stop_offs = np.zeros(S + 1, np.int64)
    np.cumsum([len(ids) for ids in stop_ids], out=stop_offs[1:])
    out_tok, out_gap = np.empty((steps, S), np.int64), np.empty((steps, S), _F)
    out_h, out_f = np.empty((steps, S, D), _F), np.zeros((steps, S, len(feats) * D), _F)
    tok = np.array(anchors, np.int64)
    a = p.args
    n = _decode(
        tok,
        steps,
        cfg.hc_mult,
        a["embed"],
        a["hcs_a"],
        a["hcs_f"],
        a["kind"],
        a["a_idx"],
        a["f_kind"],
        a["f_idx"],
        slot,
        a["kdas"],
        a["mlas"],
        a["moes"],
        a["denses"],
        tails0,
        col0,
        S00,
        km1,
        full_buf,
        st_buf,
        ptrs,
        used,
        pools,
        a["kps"],
        a["norm_w"],
        a["norm_eps"],
        a["lm_w"],
        stops,
        stop_offs,
        out_tok,
        out_gap,
        out_h,
        out_f,
    )
    _leave(caches, idx, m_idx, n, km1, full_buf, st_buf)
    tok_t, gap_t, h_t, f_t = (torch.from_numpy(x[:n]) for x in (out_tok, out_gap, out_h, out_f))
    return [{"tokens": tok_t[:, j], "gaps": gap_t[:, j], "hidden": h_t[:, j], "features": f_t[:, j]} for j in range(S)]


#: id of the first KDA layer's last-step buffer view a :func:`_group` call left pending (a cache's state
#: once committed) -> ``(weak reference to that view, full_buf, st_buf, parity of the last step)``; an
#: entry goes with its view (a tensor cannot be a weak dictionary key: its ``==`` is elementwise)
_CARRY: dict[int, tuple] = {}


def _carry(view: torch.Tensor, full_buf: np.ndarray, st_buf: np.ndarray, last: int) -> None:
    def gone(ref, key=id(view)):  # (any thread: a newer entry under the same id stays)
        if _CARRY.get(key, (None,))[0] is ref:
            _CARRY.pop(key, None)

    _CARRY[id(view)] = (weakref.ref(view, gone), full_buf, st_buf, last)


def _carried(caches: list, kda_idx: list[int], km1: int) -> tuple | None:
    """``(tails0 [La, 3C, W], S00 [La, S, H, dk, dk], col0 [S])`` for :func:`_decode` without a copy, when
    every KDA state of ``caches`` is the one the last call over them (same sequences, same order) left
    after its last step, committed (:func:`_leave`, then ``commit(1)``): the buffers it wrote; else None."""
    st = caches[0].layers[kda_idx[0]]
    rec = _CARRY.get(id(st.rows.full)) if type(st) is KDAState and st.rows is not None else None
    if rec is None or rec[0]() is not st.rows.full or rec[2].shape[2] != len(caches):
        return None
    _, full_buf, st_buf, last = rec
    for a, i in enumerate(kda_idx):
        fp, sp = full_buf[last, a].ctypes.data, st_buf[last, a].ctypes.data
        for j, c in enumerate(caches):
            st = c.layers[i]
            if (
                type(st) is not KDAState
                or st.rows is None
                or st.n_rows != 1
                or st.rows.col != j * (km1 + 1)
                or st.rows.row != j
                or st.rows.full.data_ptr() != fp
                or st.rows.states.data_ptr() != sp
            ):
                return None
    return full_buf[last], st_buf[last], np.arange(len(caches), dtype=np.int64) * (km1 + 1) + 1


def _leave(
    caches: list,
    kda_idx: list[int],
    mla_idx: list[int],
    n: int,
    km1: int,
    full_buf: np.ndarray,
    st_buf: np.ndarray,
) -> None:
    """The caches after ``n`` steps as one-row verifies leave them: the first ``n - 1`` rows committed
    (each KDA layer's state after them: views of the step buffers), the last pending (recorded in
    :data:`_CARRY` for the next call)."""
    last, prev = (n - 1) % 2, n % 2
    for a, i in enumerate(kda_idx):
        ft_last, st_last = torch.from_numpy(full_buf[last, a, None]), torch.from_numpy(st_buf[last, a, None])
        ft_prev, st_prev = torch.from_numpy(full_buf[prev, a, None]), torch.from_numpy(st_buf[prev, a, None])
        for j, c in enumerate(caches):
            if n > 1:
                c.layers[i] = KDAState(rows=KDARows(ft_prev, st_prev, km1, j * (km1 + 1), j), n_rows=1)
            if c.pending is None:
                c.pending, c.pending_rows = {}, 1
            c.pending[i] = KDARows(ft_last, st_last, km1, j * (km1 + 1), j)
        if a == 0:
            _carry(ft_last, full_buf, st_buf, last)
    for c in caches:
        if c.pending is None:
            c.pending, c.pending_rows = {}, 1
        for i in mla_idx:
            layer = c.layers[i]
            layer.extend(n)
        c.pos += n - 1
