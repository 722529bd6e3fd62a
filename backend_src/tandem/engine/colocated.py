"""The co-located stage host (``colocate``, on by default): the trunk stage and the drafter stages in
one process, so a verify round is one call (:meth:`StageHost.draft_verify`: commit, draft, verify)
and no hidden row crosses a process boundary (with separate drafter models a round makes two BLS
calls and the rows travel twice). The drafters share the trunk's weights as in-process, and :class:`StageHost` keeps, per
sequence with an open drafter, the trunk outputs of its committed rows since its last draft (the rows
the scheduler's ``SpecSession.ingest`` names) for its next ``draft_verify``. The scheduler still
decides every round (which sessions draft, how many tokens, the accept walk); the wire carries tokens.
A session's admission (trunk and drafter state, prime) is one call, and so is its close.

:meth:`StageHost.handle` is the ``trunk`` model's wire form with ``colocate`` on
(:data:`tandem.schema.TRUNK`): the trunk's ops, ``draft_verify``, and the hosted drafter ops
``drafter_mtp.open`` / ``.close`` and ``drafter_dflash.open`` / ``.close`` / ``.publish`` / ``.evict``.
Every request is checked before anything changes. A drafter that raises inside a call fails that
call's turns, where a separate drafter model's failure degrades only its sessions to plain decoding
(:mod:`tandem.engine.lifecycle`); a crash of this process takes the trunk's caches too.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from .. import schema
from ..schema import WireError
from .accept import accept_walk
from .drafter_stage import DrafterStage, drafter_stages
from .protocols import Commit, DecodedRounds, DraftRequest, Rows, RoundsPlan, VerifyOut  # noqa: F401 - RoundsPlan: re-exported
from .draft_verify_wire import DraftVerifyWire
from .pipeline import NEXT_OP, LastCall
from .plain_rounds import plain_steps
from .run_ahead import RunAhead, call_key, next_call
from .trunk_stage import TrunkStage


@dataclasses.dataclass
class _Ingest:
    """A sequence's committed rows its drafter has not ingested: trunk outputs (pieces) and their tokens."""

    outs: list[VerifyOut] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)

    def add(self, out: VerifyOut, tokens: list[int]) -> None:
        assert out.argmax.shape[0] == len(tokens), (out.argmax.shape, len(tokens))
        self.outs.append(out), self.tokens.extend(tokens)


class StageHost(DraftVerifyWire):
    """Implements :class:`~tandem.engine.protocols.TrunkAPI` plus :meth:`draft_verify` over a
    :class:`~tandem.engine.trunk_stage.TrunkStage` and the drafter stages that share its weights.

    Args: ``trunk``; ``drafters`` — arm -> drafter stage (:class:`~tandem.engine.mtp_stage.MTPStage`
    for ``mtp``, one :class:`~tandem.engine.dflash_stage.DFlashStage` for the DFlash arms); the
    hosted drafter ops name a stage by its model (``drafter_mtp``, ``drafter_dflash``).
    Raises :class:`~tandem.engine.protocols.UnknownSequence` for sequences it does not hold.
    """

    spec = schema.TRUNK
    #: the scheduler makes one :meth:`draft_verify` call a round instead of a drafter call + verify
    hosts_drafters = True

    def __init__(self, trunk: TrunkStage, drafters: dict[str, DrafterStage], run_ahead: bool = False) -> None:
        self.trunk, self.drafters = trunk, dict(drafters)
        #: the speculative next call (``run_ahead``; :mod:`tandem.engine.run_ahead`), used by :meth:`handle`
        self.ahead = RunAhead(self, self._run_rounds) if run_ahead else None
        #: the last numbered call, which a pipelined ``draft_verify_next`` continues (:mod:`tandem.engine.pipeline`)
        self.last = LastCall()
        self.vocab_size = trunk.vocab_size
        #: drafter stages by model name (the prefix of a hosted op)
        self.by_model: dict[str, DrafterStage] = {st.spec.name: st for st in self.drafters.values()}
        #: per sequence whose drafter state is open: the committed rows it has not ingested
        self.ingest: dict[int, _Ingest] = {}
        #: per sequence, its pending verify's outputs and tokens (kept until the commit says how many rows stay)
        self.pending: dict[int, tuple[VerifyOut, list[int]]] = {}

    @classmethod
    def build(
        cls,
        trunk: TrunkStage,
        dflash: dict | None = None,
        max_num_draft_tokens: int = schema.DEFAULTS.max_num_draft_tokens,
        run_ahead: bool = False,
    ) -> "StageHost":
        """The host of ``trunk`` with :func:`drafter_stages` (the drafters an in-process engine builds)."""
        return cls(trunk, drafter_stages(trunk.model, dflash, max_num_draft_tokens), run_ahead)

    # -- the trunk's API, keeping the drafters' rows --------------------------------------------------
    @property
    def states(self) -> dict:
        """The trunk's caches by sequence id (the ``stage_sequences`` gauge counts them)."""
        return self.trunk.states

    @property
    def caches(self) -> dict:
        return self.trunk.caches

    def cache(self, sid: int):
        """The trunk cache of ``sid``. Raises :class:`~tandem.engine.protocols.UnknownSequence`."""
        return self.trunk.cache(sid)

    def open(self, sids: list[int]) -> None:
        self.trunk.open(sids)
        self._forget(sids)

    def close(self, sids: list[int]) -> None:
        """Drop the trunk caches of ``sids`` and their hosted drafters' state (one call ends a session)."""
        self.trunk.close(sids)
        for st in self.by_model.values():
            st.close(sids)
        self._forget(sids)

    def _forget(self, sids: list[int]) -> None:
        for s in sids:
            self.ingest.pop(s, None), self.pending.pop(s, None)

    def _open_for_prime(self, arrays: schema.Arrays) -> None:
        """A ``prime``'s ``SPEC`` (per sequence: the arm of a new one to open first, ``""``: open already): open its
        trunk state and hosted drafter (DFlash: from the prime's prefix blocks). Raises :class:`WireError`."""
        sids, arms = schema.get_sids(arrays), schema.get_strings(arrays, schema.TRUNK.input(schema.SPEC))
        if len(arms) != len(sids) or any(a and a not in schema.SPECS for a in arms):
            raise WireError(f"{schema.SPEC} on prime: one of {schema.SPECS} or '' per SIDS ({len(sids)}), got {arms}")
        if (bad := next((a for a in arms if a and a != schema.OFF and a not in self.drafters), None)) is not None:
            raise WireError(f"{schema.SPEC}: {bad!r} is not hosted here (loaded: {sorted(self.drafters)})")
        prefixes = schema.prefixes_from_wire(arrays, len(sids))
        self.open([s for s, a in zip(sids, arms) if a])
        for stage in {id(st): st for st in self.drafters.values()}.values():
            new = [
                (s, a, p) for s, a, p in zip(sids, arms, prefixes) if a in self.drafters and self.drafters[a] is stage
            ]
            warm = [(a, p) if p and a in schema.DFLASH_ARMS else None for _, a, p in new]
            try:
                stage.open([s for s, _, _ in new], warm) if any(warm) else stage.open([s for s, _, _ in new])
            except KeyError as e:
                raise WireError(f"PREFIX_KEYS: {e.args[0]}") from None
            self.ingest.update({s: _Ingest() for s, _, _ in new})

    def _committed(self, items) -> None:
        """Rows of each sequence's pending verify that a commit keeps join its drafter's rows."""
        for it in items:
            n = it.commit if isinstance(it, Rows) else it.n_rows
            pend = self.pending.pop(it.sid, None) if n else None
            if pend is not None and it.sid in self.ingest:
                self.ingest[it.sid].add(pend[0].rows(n), pend[1][:n])

    def prime(self, items: list[Rows]) -> list[VerifyOut]:
        self._committed(items)
        outs = self.trunk.prime(items)
        for it, out in zip(items, outs):
            if it.sid in self.ingest:
                self.ingest[it.sid].add(out, it.tokens)
        return outs

    def verify(self, items: list[Rows]) -> list[VerifyOut]:
        self._committed(items)
        outs = self.trunk.verify(items)
        for it, out in zip(items, outs):
            self.pending[it.sid] = (out, it.tokens)
        return outs

    def commit(self, items: list[Commit]) -> None:
        self._committed(items)
        self.trunk.commit(items)

    def decode_rows(self, items: list[Rows], steps: int, stop_ids: list[tuple[int, ...]]) -> list[VerifyOut]:
        """:meth:`TrunkStage.decode_rows <tandem.engine.trunk_stage.TrunkStage.decode_rows>` (per sequence one
        :class:`VerifyOut` of its ``n`` rounds' rows), keeping the drafters' rows as one :meth:`verify` a
        round would: every round's row but the last joins its drafter's rows, the last is pending."""
        self._committed(items)
        outs = self.trunk.decode_rows(items, steps, stop_ids)
        for it, o in zip(items, outs):
            n = o.argmax.shape[0]
            if it.sid in self.ingest and n > 1:  # (the tokens the rows were run on: the anchor, then the targets)
                self.ingest[it.sid].add(o.rows(n - 1), [it.tokens[0]] + o.argmax[: n - 2].tolist())
            self.pending[it.sid] = (o.rows_at(n - 1), [it.tokens[0] if n == 1 else int(o.argmax[n - 2])])
        return outs

    def publish(self, items: list[tuple[int, list[int]]]) -> list[int]:
        return self.trunk.publish(items)

    def evict(self, keys: list[int]) -> None:
        self.trunk.evict(keys)

    # -- the round ----------------------------------------------------------------------------------
    @torch.no_grad()
    def draft_verify(
        self, items: list[Rows], plans: list[tuple[str, int] | None]
    ) -> tuple[list[list[int]], list[VerifyOut]]:
        """One verify round in one call. ``items[j]``: sequence ``j``'s anchor (``tokens == [anchor]``)
        and the rows of its pending verify to commit first (``commit``); ``plans[j]``: ``(arm, k)`` —
        ingest its committed rows in the arm's drafter and draft ``k`` tokens (``k`` may be 0) — or
        None (a plain row). Returns the drafts per sequence and the verify output over
        ``[anchor, *drafts]`` per sequence (pending until the next call's ``commit``).

        Raises :class:`~tandem.engine.protocols.UnknownSequence`, ``ValueError`` for an arm not hosted,
        a sequence without drafter state, or rows that do not line up with the drafter's (an invariant)."""
        assert len(items) == len(plans)
        assert all(len(it.tokens) == 1 for it in items), "draft_verify takes the anchor row only"
        for it in items:
            self.trunk.cache(it.sid)
        self._committed(items)
        self.trunk.commit([Commit(it.sid, it.commit) for it in items if it.commit])
        groups: dict[int, tuple[DrafterStage, list[int]]] = {}
        for j, (it, plan) in enumerate(zip(items, plans)):
            if plan is None:
                continue
            if plan[0] not in self.drafters:
                raise ValueError(f"{schema.SPEC}: {plan[0]!r} is not hosted here (loaded: {sorted(self.drafters)})")
            if it.sid not in self.ingest:
                raise ValueError(f"sequence {it.sid} has no drafter state (open it first)")
            stage = self.drafters[plan[0]]
            groups.setdefault(id(stage), (stage, []))[1].append(j)
        drafts: list[list[int]] = [[] for _ in items]
        for stage, idx in groups.values():
            reqs = [self._request(items[j], *plans[j]) for j in idx]
            for j, d in zip(idx, stage.draft(reqs)):
                drafts[j] = d
        rows = [Rows(it.sid, it.tokens + d) for it, d in zip(items, drafts)]
        for r in rows:
            c = self.trunk.cache(r.sid)
            if c.pos + len(r.tokens) > c.max_ctx:
                raise ValueError(
                    f"context full for sequence {r.sid}: {c.pos} + {len(r.tokens)} rows > max_ctx {c.max_ctx}"
                )
        return drafts, self.verify(rows)

    def draft_verify_rounds(
        self, items: list[Rows], plans: list[RoundsPlan], ms: float | None = None
    ) -> list[list[tuple[int, list[int], VerifyOut]]]:
        """Up to ``max(plan.rounds)`` :meth:`draft_verify` rounds in one call: after each round this host
        runs the scheduler's accept walk (:func:`~tandem.engine.accept.accept_walk`, the same function on
        the same inputs) to find each sequence's commit and next anchor. ``items[j]``: the first
        round's anchor and pending commit. Returns per sequence ``(anchor, drafts, verify output)``
        per round it ran; its last round's rows stay pending (the next call's ``commit``). The
        scheduler replays the walks and checks the anchors (:meth:`Scheduler.burst`). ``ms``: end at the
        first round boundary after that many milliseconds (the burst's time left; None: no limit), or
        after a plain decode call that ran the rounds the clock gave it at the last call's pace."""
        return self._run_rounds(items, plans, ms=ms)[0]

    def _run_rounds(
        self, items: list[Rows], plans: list[RoundsPlan], should_stop=None, ms: float | None = None
    ) -> tuple[list, list]:
        """:meth:`draft_verify_rounds`, also returning per sequence ``(anchor, commit, used, alive)``
        after its last round (its next call's anchor and commit, the tokens this call committed, whether
        its turn goes on; None without a round); ``should_stop()`` true ends it at a round boundary, as
        does the clock ``ms`` milliseconds after the start (after one round at least)."""
        assert len(items) == len(plans)
        end = None if ms is None else time.perf_counter() + ms / 1e3
        res: list[list[tuple[int, list[int], VerifyOut]]] = [[] for _ in items]
        alive = [False] * len(items)
        anchor = [it.tokens[0] for it in items]
        commit = [it.commit for it in items]
        used = [0] * len(items)  # tokens committed in this call before the round (the pending one included)
        budget = [p.budget for p in plans]
        live = list(range(len(items)))
        r, rounds, paced = 0, max((p.rounds for p in plans), default=0), False
        while r < rounds and not paced:  # (a decode call that ran the rounds ``ms`` gave it ends the call)
            live = [j for j in live if r < plans[j].rounds]
            if (
                not live
                or (should_stop is not None and should_stop())
                or (r and end is not None and time.perf_counter() >= end)
            ):
                break
            steps, by_clock = self._plain_steps(items, plans, live, r, used, budget, end)
            if steps:  # every live sequence decodes plain greedy rows: the rounds in one compiled call
                t0 = time.perf_counter()
                outs = self.decode_rows(
                    [Rows(items[j].sid, [anchor[j]], commit=commit[j]) for j in live],
                    steps,
                    [tuple(plans[j].stop_ids) for j in live],
                )
                n = max(o.argmax.shape[0] for o in outs)  # (groups of sequences may stop at different rounds)
                self._decode_round_s = (time.perf_counter() - t0) / n
                paced = end is not None and n == steps == by_clock
                for j, o in zip(live, outs):  # the accept walks of rounds without drafts, at once
                    assert not res[j] or alive[j], "a plain decode call ran past a finished turn"
                    run = DecodedRounds([anchor[j]] + o.argmax[:-1].tolist(), o)
                    k, last, p = len(run), run.targets[-1], plans[j]
                    assert k <= budget[j] and not set(run.targets[:-1]) & set(p.stop_ids), (items[j].sid, k, budget[j])
                    res[j] = run if not res[j] else [*res[j], *run]
                    commit[j], anchor[j], used[j], budget[j] = 1, last, used[j] + k, budget[j] - k
                    alive[j] = last not in p.stop_ids and budget[j] > 0 and p.room - used[j] > 1
                live = [j for j in live if alive[j]]
                r += n
                continue
            else:
                pl = [
                    (plans[j].arm, max(0, min(plans[j].k, plans[j].room - used[j] - 2))) if plans[j].arm else None
                    for j in live
                ]
                drafts, outs = self.draft_verify([Rows(items[j].sid, [anchor[j]], commit=commit[j]) for j in live], pl)
                rounds_run = [list(zip(live, drafts, outs))]
            for one in rounds_run:
                for j, d, out in one:
                    if not isinstance(res[j], list):  # (after a decode call's rounds)
                        res[j] = list(res[j])
                    res[j].append((anchor[j], d, out))
                    p = plans[j]
                    w = accept_walk(d, out.argmax.tolist(), p.stop_ids, budget[j])
                    m = len(w.emitted)
                    commit[j], anchor[j], used[j], budget[j] = m, w.emitted[-1], used[j] + m, budget[j] - m
                    alive[j] = w.finish is None and p.room - used[j] > 1  # else the turn ended (or the context is full)
            live = [j for j in live if alive[j]]
            r += len(rounds_run)
        return res, [(anchor[j], commit[j], used[j], alive[j]) if res[j] else None for j in range(len(items))]

    #: seconds a round of the last :meth:`decode_rows` call took (0: none yet), to end a call near its ``ms``
    _decode_round_s = 0.0

    def _plain_steps(
        self,
        items: list[Rows],
        plans: list[RoundsPlan],
        live: list[int],
        r: int,
        used: list[int],
        budget: list[int],
        end: float | None,
    ) -> tuple[int, int]:
        """:func:`~tandem.engine.plain_rounds.plain_steps` at the last call's pace, when every live
        sequence is plain (no arm) and greedy; else ``(0, 0)``."""
        if any(plans[j].arm or items[j].sid in self.trunk.sampling for j in live):
            return 0, 0
        return plain_steps(plans, live, r, used, budget, end, self._decode_round_s)

    def _request(self, it: Rows, arm: str, k: int) -> DraftRequest:
        """The drafter request of a sequence: its kept rows (cleared), each followed by the next kept
        row's token and the last by the anchor."""
        ing = self.ingest[it.sid]
        self.ingest[it.sid] = _Ingest()
        if not ing.outs:
            raise ValueError(f"sequence {it.sid}: no committed rows for its drafter (each round commits at least one)")
        out = (
            ing.outs[0]
            if len(ing.outs) == 1
            else VerifyOut(*(torch.cat([getattr(o, f.name) for o in ing.outs]) for f in dataclasses.fields(VerifyOut)))
        )
        covered = getattr(self.drafters[arm], "covered_rows", None)
        if covered is not None and self.trunk.cache(it.sid).pos != covered(it.sid) + len(ing.tokens):
            raise ValueError(
                f"sequence {it.sid}: the drafter covers {covered(it.sid)} rows + {len(ing.tokens)} kept, "
                f"the trunk holds {self.trunk.cache(it.sid).pos}"
            )
        return DraftRequest(it.sid, out.hidden, ing.tokens[1:] + [it.tokens[0]], k, out.features, arm)

    # -- wire form ----------------------------------------------------------------------------------
    def handle(self, arrays: schema.Arrays) -> schema.Arrays:
        """One packed request of the ``trunk`` model (:data:`tandem.schema.TRUNK`) with ``colocate`` on.
        Outputs as :meth:`TrunkStage.handle`, but ``HIDDEN`` / ``FEATURES`` are ``[rows, 0]`` (the rows
        stay here), and ``DRAFTS`` / ``DRAFT_LENGTHS`` (a hosted drafter op: the drafter's);
        ``draft_verify`` answers :data:`tandem.schema.DRAFT_VERIFY_OUTPUTS` only. Raises :class:`~tandem.schema.WireError` naming the field."""
        op = schema.get_op(arrays, schema.TRUNK)
        if self.ahead is not None and op != "draft_verify":
            self.ahead.settle()  # any other op: the speculative call is not the next one
        number = schema.get_scalar(arrays, schema.TRUNK.input("CALL"))
        if op == NEXT_OP:  # pipelined: continue the last call (refused unless it is call CALL - 1)
            return self._next(arrays, number)
        if not (op == "close" and not len(arrays["SIDS"])):  # (a close of nothing: a health probe, changes nothing)
            self.last.forget()  # any other op moves the trunk on (a draft_verify that answers is remembered again)
        if "." in op:
            return self._hosted(op, arrays)
        if op != "draft_verify":  # the trunk's checks and packing; its ops run here (the drafters' rows kept)
            if op == "prime" and schema.SPEC in arrays:
                self._open_for_prime(arrays)
            out = self.trunk.handle(arrays, run=self, with_rows=False)
            if op == "prime" and number is not None:  # a draft_verify_next may continue it (pipeline.py)
                self._record_prime(arrays, out, number)
            return out
        sids = schema.get_sids(arrays)
        if not sids:
            return self._pack_rounds([])
        call = self._parse_draft_verify(arrays, sids)
        ms = self._burst_ms(arrays)
        if self.ahead is not None and self.ahead.busy:
            hit = self.ahead.take(call_key(*self._call_of(call)))
            if hit is not None:
                return self._answer(*self.ahead.call, *hit, number)
        self._check_draft_verify(arrays, call)
        items, plans = self._call_of(call)
        return self._answer(items, plans, *self._run_rounds(items, plans, ms=ms), number)

    def _answer(
        self, items: list[Rows], plans: list[RoundsPlan], res: list, cont: list, number: int | None
    ) -> schema.Arrays:
        """The packed answer of call ``number`` (remembered for a ``draft_verify_next``); first, with
        ``run_ahead``, the next call starts on its thread (not after a numbered call: the ``tandem``
        process pipelines, its next call is already queued)."""
        self.last.record(number, items, plans, cont)
        if self.ahead is not None and number is None and self.ahead.steady(items, plans):
            self.ahead.start(*next_call(items, plans, cont))
        return self._pack_rounds(res)

    def _pack_rounds(self, res: list) -> schema.Arrays:
        """:data:`tandem.schema.DRAFT_VERIFY_OUTPUTS` of :meth:`draft_verify_rounds`' result."""
        outs, drafts, lengths, anchors = [], [], [], []  # by sequence, then round
        for per in res:
            if isinstance(per, DecodedRounds):  # its rounds' rows whole
                outs.append(per.out)
                lengths += [0] * len(per)
                anchors += per.anchors
                continue
            for a, d, o in per:
                outs.append(o)
                drafts += d
                lengths.append(len(d))
                anchors.append(a)
        packed = self.trunk._pack(outs, with_rows=False)
        return {
            "ARGMAX": packed["ARGMAX"],
            "TOP2_GAP": packed["TOP2_GAP"],
            "DRAFTS": np.array(drafts, np.int64),
            "DRAFT_LENGTHS": np.array(lengths, np.int32),
            "ROUNDS_RUN": np.array([len(per) for per in res], np.int32),
            "ANCHORS": np.array(anchors, np.int64),
        }

    def _hosted(self, op: str, arrays: schema.Arrays) -> schema.Arrays:
        """A drafter model's op (``drafter_dflash.open``) on the stage hosted here."""
        model, inner = op.split(".", 1)
        stage = self.by_model.get(model)
        if stage is None:
            if inner == "close":  # nothing to close
                return self.trunk._pack([], with_rows=False)
            raise WireError(f"OP {op!r}: this trunk hosts no {model} (loaded: {sorted(self.by_model) or 'none'})")
        out = stage.handle({**arrays, "OP": schema.string_array(inner)})
        sids = schema.get_sids(arrays)
        if inner == "open":
            for s in sids:
                self.ingest[s] = _Ingest()
        elif inner == "close":
            for s in sids:
                self.ingest.pop(s, None)
        return {**self.trunk._pack([], with_rows=False), **out}
