"""Plain greedy decoding steps in one numba call on the CPU serving path (row-invariant mode, fp32).

A plain decode step through :meth:`Trunk.verify_many <tandem.model.trunk.Trunk.verify_many>` runs one
numba call per decoder block, but between them ~1 ms of Python (plans, cache views, buffers, the LM
head, the targets, the scheduler's bookkeeping) against ~0.7 ms of kernels on the shipped miniature.
Here one compiled function runs ``steps`` whole decode steps of several sequences, each a one-row
trunk pass (:func:`~tandem.ops.cpu.trunk_pass._forward`: every block, the final norm, the LM head and
the greedy target with its top-2 gap); the target is the next step's anchor. This is
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

import numpy as np
import torch
from numba import njit

from ..state import KDARows, KDAState
from .groups import run_groups
from .kernels import _F, compiled_call
from .trunk_pass import _forward, _mla_args, _Plan, _plan, _shapes, _slots, _starts


@njit(cache=True, nogil=True)
def _decode(w, feat_slot, tok, steps, kda0, km1, full_buf, st_buf, mla, stops, stop_offs, outs):  # pragma: no cover
    # up to `steps` greedy decode steps of S sequences from anchors tok [S] (int64, updated in place), each a
    # one-row _forward (w, feat_slot, mla as there); returns the steps run. KDA states: kda0 = (tails0 [La, 3C, W],
    # col0 [S], S00 [La, S, H, dk, dk]) before the first step, full_buf[p] [La, 3C, S*(km1+1)] / st_buf[p] [La, S,
    # H, dk, dk] after a step of parity p. outs per step t: (out_tok[t] [S], out_gap[t] [S], out_h[t] [S, D],
    # out_f[t] [S, F]).
    out_tok, out_gap, out_h, out_f = outs
    S = out_h.shape[1]
    offs = np.arange(S + 1).astype(np.int64)
    s_idx = np.arange(S).astype(np.int64)
    col = s_idx * (km1 + 1) + 1  # its tail in a step's full (its tail columns, then its row: the last km1)
    done = 0
    for t in range(steps):
        p, q = t % 2, (t + 1) % 2
        kda_in = kda0 if t == 0 else (full_buf[q], col, st_buf[q])
        step_outs = (out_tok[t], out_gap[t], out_h[t], out_f[t])
        _forward(w, feat_slot, tok, offs, s_idx, kda_in, (full_buf[p], st_buf[p]), False, mla, step_outs)
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


def decode_steps(
    model,
    caches: list,
    anchors: list[int],
    steps: int,
    stop_ids: list[tuple[int, ...]],
    features: tuple[int, ...] = (),
    threads: int = 1,
    split: int = 1,
) -> list[dict] | None:
    """Up to ``steps`` plain greedy decode steps of every sequence in one call (see the module text):
    sequence ``j`` starts from ``anchors[j]`` after the committed rows of ``caches[j]`` (no verify
    pending; room for ``steps`` rows) and each step's target is its next anchor. The sequences go in
    ``min(threads, S)`` groups of consecutive ones, each group in one compiled call on a thread of its
    own (the rows of different sequences never meet: each row's arithmetic is the same in any group; one group
    splits its GEMMs across ``split`` threads, :func:`~tandem.ops.cpu.groups.run_groups`),
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
    return run_groups(lambda part: _group(model, p, *part, steps, features), parts, split)


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
    S, D, z = len(caches), model.cfg.hidden_size, _shapes(p)
    km1 = z.km1
    carried = _carried(caches, p.kda_idx, km1)
    # the states a previous call left, read where it wrote them, else a copy
    tails0, S00, col0 = carried if carried is not None else _starts(caches, p, z)
    ptrs, used, pools = _mla_args(caches, p, [steps] * S)
    slot, nf = _slots(model, features)
    full_buf = np.empty((2, z.La, z.C3, S * (km1 + 1)), _F)
    st_buf = np.empty((2, z.La, S, z.H, z.dk, z.dk), _F)
    stops = np.array([t for ids in stop_ids for t in ids], np.int64)
    stop_offs = np.zeros(S + 1, np.int64)
    np.cumsum([len(ids) for ids in stop_ids], out=stop_offs[1:])
    out_tok, out_gap = np.empty((steps, S), np.int64), np.empty((steps, S), _F)
    out_h, out_f = np.empty((steps, S, D), _F), np.zeros((steps, S, nf * D), _F)
    tok = np.array(anchors, np.int64)
    outs = (out_tok, out_gap, out_h, out_f)
    args = (p.args, slot, tok, steps, (tails0, col0, S00), km1, full_buf, st_buf, (ptrs, used, pools), stops, stop_offs)
    n = compiled_call(_decode, p.entry, ("decode", carried is not None), (*args, outs))
    _leave(caches, p.kda_idx, p.mla_idx, n, km1, full_buf, st_buf)
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
