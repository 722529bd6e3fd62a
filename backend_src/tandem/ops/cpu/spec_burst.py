"""Greedy speculative rounds with a DFlash drafter in one numba call on the CPU serving path (row-invariant, fp32).

A speculative round through the engine core (:class:`~tandem.engine.spec_round.SpecRound`) makes two compiled calls,
the drafter's round (:func:`~tandem.ops.cpu.dflash.draft_round`) and the trunk's verify pass
(:func:`~tandem.ops.cpu.trunk_pass.verify_rows`), with Python between and around them: the requests, the cache
views, the accept walk, the commit and the session's bookkeeping. Here one compiled function runs ``rounds`` whole
rounds of several sequences, as :mod:`tandem.ops.cpu.decode` runs plain steps: per round and sequence the drafter's
round (:func:`~tandem.ops.cpu.dflash._round`: ingest of the rows the trunk committed last round, then ``k`` drafts
after the anchor), one trunk pass over every sequence's ``[anchor, *drafts]``
(:func:`~tandem.ops.cpu.trunk_pass._forward`, every row's KDA state kept), then the greedy accept walk (Leviathan et
al. 2023, the greedy case: the longest draft prefix equal to the trunk's targets, then the trunk's token) with the
turn's stop ids and budget, and the commit of the walk's rows: the next round's KDA states are read where this
round's pass wrote them, the MLA caches' used rows and pools wound back to the committed ones.

Every kernel is the one the two calls run, on the same rows in the same order, so the drafts, targets, gaps and
features, and the caches after, are bit-identical to those rounds one call at a time (``tests/test_spec_burst.py``).

A call stops after the round in which any sequence's walk emits a stop id or reaches its budget, or after
``rounds``; the caller keeps ``rounds * (k + 1)`` rows of room in each sequence's context.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..state import KDARows, KDAState
from . import dflash as _dflash
from .groups import run_groups
from .kernels import _F, compiled_call, np_param, typed_list
from .trunk_pass import _forward, _keep_pass, _mla_args, _plan, _shapes, _slots, kda_starts


@intrinsic
def _cycles(typingctx):
    """The CPU's cycle counter (``llvm.readcyclecounter``: the TSC on x86), an int64 that a compiled loop reads to
    time its parts (:func:`cycle_seconds` converts)."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(64), []), "llvm.readcyclecounter"
        )
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(cache=True, nogil=True)
def _now():  # pragma: no cover - numba
    return _cycles()


_CYCLE_S: list[float] = []


def cycle_seconds() -> float:
    """Seconds a cycle of :func:`_cycles`' counter lasts, measured once a process against ``time.perf_counter`` over
    20 ms (0.0 where the counter does not run: then the compiled loop's parts are not timed)."""
    if not _CYCLE_S:
        c0, t0 = _now(), time.perf_counter()
        while time.perf_counter() - t0 < 0.02:
            pass
        c1, t1 = _now(), time.perf_counter()
        _CYCLE_S.append((t1 - t0) / (c1 - c0) if c1 > c0 else 0.0)
    return _CYCLE_S[0]


@njit(cache=True, nogil=True)
def _walk(drafts, targets, stops, budget):  # pragma: no cover - numba
    # the greedy accept walk of drafts [k] against targets [k+1]: (accepted, emitted count m, finished), the emitted
    # tokens being drafts[:a] then targets[a], cut after the first stop id and at the budget
    k = drafts.shape[0]
    a = 0
    while a < k and drafts[a] == targets[a]:
        a += 1
    m, stop = a + 1, False
    for i in range(a + 1):
        t = drafts[i] if i < a else targets[a]
        for s in stops:
            if s == t:
                stop = True
        if stop:
            m = i + 1
            break
    if m >= budget:
        m = budget
    return min(a, m), m, stop or m == budget


@njit(cache=True, nogil=True)
def _burst(
    w,
    feat_slot,
    dw,
    dlayers,
    embed,
    rope,
    kbufs,
    vbufs,
    c_rows,
    feats0,
    f_offs,
    tok0,
    ks,
    kda0,
    km1,
    bufs,
    mla,
    budgets,
    stops,
    stop_offs,
    rounds,
    outs,
):  # pragma: no cover - numba  # noqa: E501
    # up to `rounds` greedy rounds of S sequences; returns the rounds run. w, feat_slot, mla: as _forward takes them
    # (mla's used / pools wound back to the committed rows after each round). Drafter: dw / dlayers its plan's
    # arguments, embed the trunk's embedding, rope its tables, kbufs[j] / vbufs[j] sequence j's per-layer context
    # buffers with c_rows[j] rows filled (updated), feats0[f_offs[j]:f_offs[j+1]] the committed rows it ingests first.
    # tok0 [S] the anchors, ks [S] drafts a round (0: a plain row), budgets [S] tokens left (updated). KDA: kda0 = (tails, t_col,
    # S0, s_idx) before the first round; bufs = (full [2, La, 3C, N+S*km1], states [2, La, N, H, dk, dk], o_tok [2, N],
    # o_gap [2, N], o_h [2, N, D], o_f [2, N, F]) per round parity. outs per round t and sequence j: n_emit [R, S],
    # n_acc [R, S], emitted [R, S, kmax+1], gaps [R, S, kmax+1], drafts [R, S, kmax]; cycles [3] the cycles spent
    # drafting, verifying and walking (added to); q_h [R, S, D] / q_f [R, S, F] the row of a sequence drafting none
    # (ks[j] == 0: a plain row, no drafter round).
    full_b, st_b, o_tok, o_gap, o_h, o_f = bufs
    ptrs, used, pools = mla
    n_emit, n_acc, emitted, gaps, drafted, cycles, q_h, q_f = outs
    S = tok0.shape[0]
    offs = np.zeros(S + 1, np.int64)
    for j in range(S):
        offs[j + 1] = offs[j] + ks[j] + 1
    col = offs[:-1] + np.arange(S) * km1  # sequence j's tail columns in a pass's full, then its rows
    anchor = tok0.copy()
    base = used[:, :].copy()  # the MLA rows committed before the round
    m_prev = np.zeros(S, np.int64)
    tok = np.empty(offs[S], np.int64)
    out_hd = np.empty((ks.max() + 1, embed.shape[1]), _F)
    kps = w[11]
    done = 0
    for t in range(rounds):
        p, q = t % 2, (t + 1) % 2
        c0 = _cycles()
        for j in range(S):
            k = ks[j]
            if t == 0:
                feats = feats0[f_offs[j] : f_offs[j + 1]]
            else:
                feats = o_f[q, offs[j] : offs[j] + m_prev[j]]
            tok[offs[j]] = anchor[j]
            if k == 0:  # a plain row (spec off, or resting): no drafter round
                continue
            _dflash._round(
                dw,
                dlayers,
                feats,
                c_rows[j],
                anchor[j],
                k,
                embed,
                kbufs[j],
                vbufs[j],
                rope,
                tok[offs[j] + 1 : offs[j + 1]],
                out_hd[: k + 1],
            )  # noqa: E501
            c_rows[j] += feats.shape[0]
        c1 = _cycles()
        if t == 0:
            kda_in = kda0
        else:
            kda_in = (full_b[q], col + m_prev, st_b[q], offs[:-1] + m_prev - 1)
        _forward(
            w,
            feat_slot,
            tok,
            offs,
            kda_in[3],
            kda_in[:3],
            (full_b[p], st_b[p]),
            True,
            mla,
            (o_tok[p], o_gap[p], o_h[p], o_f[p]),
        )  # noqa: E501
        done = t + 1
        c2 = _cycles()
        end = False
        for j in range(S):
            k = ks[j]
            d = tok[offs[j] + 1 : offs[j + 1]]
            a, m, fin = _walk(d, o_tok[p, offs[j] : offs[j + 1]], stops[stop_offs[j] : stop_offs[j + 1]], budgets[j])
            n_emit[t, j], n_acc[t, j] = m, a
            drafted[t, j, :k] = d
            for i in range(m):
                emitted[t, j, i] = d[i] if i < a else o_tok[p, offs[j] + a]
                gaps[t, j, i] = o_gap[p, offs[j] + i]
            if k == 0:  # its row, for the drafter's later rounds (a resting session's)
                q_h[t, j] = o_h[p, offs[j]]
                q_f[t, j] = o_f[p, offs[j]]
            anchor[j] = emitted[t, j, m - 1]
            budgets[j] -= m
            m_prev[j] = m
            for a_ in range(used.shape[0]):
                base[a_, j] += m
                used[a_, j] = base[a_, j]
                pools[a_, j] = base[a_, j] // kps[a_]
            end = end or fin
        c3 = _cycles()
        cycles[0] += c1 - c0
        cycles[1] += c2 - c1
        cycles[2] += c3 - c2
        if end:
            break
    return done


def spec_burst(
    model,
    drafter,
    head: torch.Tensor,
    head_kernels,
    caches: list,
    ctxs: list,
    anchors: list[int],
    ks: list[int],
    feats0: list[torch.Tensor],
    stop_ids: list[tuple[int, ...]],
    budgets: list[int],
    rounds: int,
    features: tuple[int, ...],
    groups: list[range] | None = None,
    split: int = 1,
) -> list[dict] | None:
    """Up to ``rounds`` greedy speculative rounds of every sequence in one compiled call per group of ``groups``
    (consecutive sequences, default one group; the groups side by side on threads of their own, one group's GEMMs
    split across ``split`` threads, :func:`~tandem.ops.cpu.groups.run_groups`), see the module text. Sequence ``j``:
    trunk cache ``caches[j]`` (no verify pending; room for ``rounds * (ks[j] + 1)`` rows), the anchor ``anchors[j]``,
    ``ks[j]`` drafts a round from ``drafter`` (a :class:`~tandem.model.dflash.DFlashDrafter` over the trunk's
    embedding and LM ``head`` weight packed for ``head_kernels``) into its context ``ctxs[j]`` (a
    :class:`~tandem.ops.state.ContextKV`) that first takes in ``feats0[j] [n, F]`` (the committed rows it has not
    seen); ``ks[j] == 0``: a plain row a round, no drafter round (``ctxs[j]`` and ``feats0[j]`` may be None). The stop
    ids ``stop_ids[j]`` and ``budgets[j] >= 1`` tokens left end its turn; ``features`` the trunk layers the drafter
    reads.

    Afterwards each cache holds every round's walked rows committed but the last round's, whose ``ks[j] + 1`` rows
    stay pending (the caller commits the last round's emitted count), and each context every row the trunk committed
    but the last round's (those are the drafter's next ingest).

    Returns per sequence ``{"emitted": [n] lists of tokens, "accepted": [n], "drafts": [n] lists, "gaps": [n] lists,
    "hidden": [m, D], "features": [m, F], "seconds": [3]}`` (``n`` rounds of its group; the committed rows its
    drafter has yet to take in, their final hidden rows and features: the last round's ``m``, or with ``ks[j] == 0``
    every round's one; the seconds its group's call spent drafting, verifying and walking), or None (nothing
    changed) when the compiled passes do not apply (:func:`~tandem.ops.cpu.trunk_pass._plan`)."""
    p = _plan(model)
    if p is None:
        return None
    S = len(caches)
    assert rounds >= 1 and S == len(ctxs) == len(anchors) == len(ks) == len(feats0) == len(stop_ids) == len(budgets)
    for c, k, ctx in zip(caches, ks, ctxs):
        assert k >= 0 and (ctx is not None or k == 0) and c.pending is None and c.pos + rounds * (k + 1) <= c.max_ctx, (
            k,
            c.pos,
            rounds,
            c.max_ctx,
        )
    parts = [
        tuple([x[j] for j in g] for x in (caches, ctxs, anchors, ks, feats0, stop_ids, budgets))
        for g in (groups or [range(S)])
    ]
    return run_groups(lambda part: _group(model, p, drafter, head, head_kernels, *part, rounds, features), parts, split)


def _group(
    model, p, drafter, head, head_kernels, caches, ctxs, anchors, ks, feats0, stop_ids, budgets, rounds, features
):
    """:func:`spec_burst` of one group of sequences: their arrays, one :func:`_burst` call, their caches."""
    S, D, z = len(caches), model.cfg.hidden_size, _shapes(p)
    km1, kmax = z.km1, max(ks)
    lengths = [k + 1 for k in ks]
    N = sum(lengths)
    (tails, S0, t_col, s_idx), kept = kda_starts(caches, p, z)
    ptrs, used, pools = _mla_args(caches, p, [rounds * n for n in lengths])
    slot, nf = _slots(model, features)
    F = nf * D
    feats0 = [f if k else torch.zeros(0, F) for f, k in zip(feats0, ks)]
    n0 = [f.shape[0] for f in feats0]
    mine = [c for c in ctxs if c is not None]
    for ctx, n in zip(ctxs, n0):
        if ctx is not None:
            ctx.room(n + rounds * (kmax + 1))
    dp = _dflash._plan(
        drafter, head, head_kernels, max([c.rows for c in mine] + [0]) + max(n0) + rounds * (kmax + 1) + 1
    )
    a0 = drafter.layers[0].self_attn
    none = typed_list([np.zeros((a0.h, 0, a0.d), _F)] * len(drafter.layers))  # (a plain row's: never read)
    kbufs = typed_list([none if c is None else typed_list([b[0].numpy() for b in c.k]) for c in ctxs])
    vbufs = typed_list([none if c is None else typed_list([b[0].numpy() for b in c.v]) for c in ctxs])
    f_offs = np.zeros(S + 1, np.int64)
    np.cumsum(n0, out=f_offs[1:])
    feats = np.ascontiguousarray(torch.cat([f.reshape(-1, F) for f in feats0]).numpy(), _F).reshape(-1, F)
    c_rows = np.array([0 if c is None else c.rows for c in ctxs], np.int64)
    bufs = (
        np.empty((2, z.La, z.C3, N + S * km1), _F),
        np.empty((2, z.La, N, z.H, z.dk, z.dk), _F),
        np.empty((2, N), np.int64),
        np.empty((2, N), _F),
        np.empty((2, N, D), _F),
        np.zeros((2, N, F), _F),
    )
    outs = (
        np.zeros((rounds, S), np.int64),
        np.zeros((rounds, S), np.int64),
        np.zeros((rounds, S, kmax + 1), np.int64),
        np.zeros((rounds, S, kmax + 1), _F),
        np.zeros((rounds, S, kmax), np.int64),
        np.zeros(3, np.int64),
        np.zeros((rounds, S, D), _F),
        np.zeros((rounds, S, F), _F),
    )
    stops = np.array([t for ids in stop_ids for t in ids], np.int64)
    stop_offs = np.zeros(S + 1, np.int64)
    np.cumsum([len(ids) for ids in stop_ids], out=stop_offs[1:])
    args = (
        p.args,
        slot,
        dp.args,
        dp.layers,
        np_param(model.embed_tokens.weight),
        dp.rope,
        kbufs,
        vbufs,
        c_rows,
        feats,
        f_offs,
        np.array(anchors, np.int64),
        np.array(ks, np.int64),
        (tails, t_col, S0, s_idx),
        km1,
        bufs,
        (ptrs, used, pools),
        np.array(budgets, np.int64),
        stops,
        stop_offs,
        rounds,
        outs,
    )
    n = compiled_call(_burst, dp.entry, ("burst", kept), args)
    for ctx, r in zip(ctxs, c_rows.tolist()):
        if ctx is not None:
            ctx.rows = r
    n_emit, n_acc, emitted, gaps, drafts, cycles, q_h, q_f = outs
    _leave(caches, p, n, km1, lengths, n_emit, bufs)
    last = (n - 1) % 2
    offs = np.zeros(S + 1, np.int64)
    np.cumsum(lengths, out=offs[1:])
    res = []
    for j in range(S):
        m, a = int(n_emit[n - 1, j]), offs[j]
        if ks[j] == 0:  # every round's row: the drafter has taken in none of them
            hidden, feats_j = torch.from_numpy(q_h[:n, j]), torch.from_numpy(q_f[:n, j])
        else:  # the last round's committed rows (the earlier ones were its next rounds' ingest)
            hidden, feats_j = torch.from_numpy(bufs[4][last, a : a + m]), torch.from_numpy(bufs[5][last, a : a + m])
        res.append(
            {
                "emitted": [emitted[t, j, : n_emit[t, j]].tolist() for t in range(n)],
                "accepted": n_acc[:n, j].tolist(),
                "drafts": [drafts[t, j, : ks[j]].tolist() for t in range(n)],
                "gaps": [gaps[t, j, : n_emit[t, j]].tolist() for t in range(n)],
                "hidden": hidden,
                "features": feats_j,
                "seconds": (cycles * cycle_seconds()).tolist(),
            }
        )
    return res


def _leave(caches: list, p, n: int, km1: int, lengths: list[int], n_emit: np.ndarray, bufs: tuple) -> None:
    """The caches after ``n`` rounds as verify passes and commits leave them: every round's walked rows but the last
    round's committed (each KDA layer's state after them: views of the pass buffers), the last round's rows
    pending (recorded for the next pass to start in place, :func:`~tandem.ops.cpu.trunk_pass._starts_in_place`)."""
    full_b, st_b = bufs[0], bufs[1]
    last, prev = (n - 1) % 2, n % 2
    o = np.zeros(len(caches) + 1, np.int64)
    np.cumsum(lengths, out=o[1:])
    o = o.tolist()
    for a, i in enumerate(p.kda_idx):
        ft_last, st_last = torch.from_numpy(full_b[last, a])[None], torch.from_numpy(st_b[last, a])[None]
        ft_prev, st_prev = torch.from_numpy(full_b[prev, a])[None], torch.from_numpy(st_b[prev, a])[None]
        for j, c in enumerate(caches):
            if n > 1:
                rows = KDARows(ft_prev, st_prev, km1, o[j] + j * km1, o[j])
                c.layers[i] = KDAState(rows=rows, n_rows=int(n_emit[n - 2, j]))
            if c.pending is None:
                c.pending, c.pending_rows = {}, lengths[j]
            c.pending[i] = KDARows(ft_last, st_last, km1, o[j] + j * km1, o[j])
        if a == 0:
            _keep_pass(ft_last, full_b[last], st_b[last])
    for j, c in enumerate(caches):
        if c.pending is None:
            c.pending, c.pending_rows = {}, lengths[j]
        c.pos += int(n_emit[: n - 1, j].sum())
        for i in p.mla_idx:
            layer = c.layers[i]
            layer.extend(c.pos + lengths[j] - len(layer))
