"""The wire form of the co-located trunk's ``draft_verify`` and ``draft_verify_next`` requests
(:data:`tandem.schema.TRUNK`): parsing and the checks made before anything changes, mixed into
:class:`~tandem.engine.colocated.StageHost`. Raises :class:`~tandem.schema.WireError` naming the field.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import schema
from ..schema import WireError
from .protocols import RoundsPlan, Rows


class DraftVerifyWire:
    """Uses the host's ``trunk``, ``drafters``, ``ingest``, ``vocab_size``, ``last``, ``_run_rounds`` and ``_answer``."""

    @staticmethod
    def _burst_ms(arrays: schema.Arrays) -> float | None:
        """``BURST_MS`` (None: absent), range-checked."""
        ms = schema.get_scalar(arrays, ms_spec := schema.TRUNK.input("BURST_MS"))
        if ms is not None:
            schema.check_range(ms_spec, ms)
        return ms

    def _next(self, arrays: schema.Arrays, number: int | None) -> schema.Arrays:
        """A ``draft_verify_next`` (:mod:`tandem.engine.pipeline`): call ``number`` continues call
        ``number - 1`` over the same ``SIDS`` with ``ROUNDS`` rounds at most each, ``BURST_MS``. After a
        numbered ``prime`` it carries a ``draft_verify``'s plan but no ``TOKENS``: each anchor is the
        prime's first token, and a sequence whose first token ended its turn (a stop id) runs no round."""
        if number is None:
            raise WireError("CALL: draft_verify_next needs the number of the call it is (it continues CALL - 1)")
        sids = schema.get_sids(arrays)
        anchors = self.last.primed(number, sids)
        if anchors is not None:
            self.last.forget()
            arrays = {**arrays, "TOKENS": np.array(anchors, np.int64)}
            call = self._parse_draft_verify(arrays, sids)
            self._check_draft_verify(arrays, call)
            items, plans = self._call_of(call)
            plans = [
                dataclasses.replace(p, rounds=0) if it.tokens[0] in p.stop_ids else p for it, p in zip(items, plans)
            ]
            return self._answer(items, plans, *self._run_rounds(items, plans, ms=self._burst_ms(arrays)), number)
        rounds = [r for r, _, _, _ in self._rounds_program(arrays, len(sids))]
        ms = self._burst_ms(arrays)
        items, plans = self.last.next(number, sids, rounds)
        self.last.forget()  # (recorded again by _answer: a call failing halfway leaves nothing to continue)
        return self._answer(items, plans, *self._run_rounds(items, plans, ms=ms), number)

    def _record_prime(self, arrays: schema.Arrays, out: schema.Arrays, number: int) -> None:
        """After ``prime`` call ``number`` (``out``: its packed answer, ``ARGMAX`` over every prompt row):
        remember each sequence's first token, its last row's target, for a ``draft_verify_next``."""
        sids = schema.get_sids(arrays)
        ends = np.cumsum(schema.lengths_of(arrays, len(sids), out["ARGMAX"].size, "TOKENS")) - 1
        self.last.record_prime(number, sids, out["ARGMAX"][ends].tolist())

    def _parse_draft_verify(self, arrays: schema.Arrays, sids: list[int]) -> list[tuple]:
        """A ``draft_verify``'s per-sequence ``(sid, anchor, N_ROWS, k, arm, (rounds, budget, room, stop
        ids))`` with the checks that read no sequence state. Raises :class:`~tandem.schema.WireError`."""
        for s in sids:
            if s not in self.trunk.caches:
                raise WireError(f"SIDS: unknown sequence id {s} (not open in the trunk)")
        n_rows = self.trunk._n_rows(arrays, sids, required=False, check=False)  # checked with the states
        toks = schema.get_vector(arrays, schema.TRUNK.input("TOKENS"))  # LENGTHS: 1 each (not read)
        if toks.size != len(sids):
            raise WireError(f"TOKENS: draft_verify takes one anchor per sequence ({len(sids)}), got {toks.size}")
        schema.check_tokens("TOKENS", toks, self.vocab_size)
        k_spec = schema.TRUNK.input(schema.NUM_DRAFT_TOKENS)
        ks = [int(x) for x in schema.get_vector(arrays, k_spec)]
        arms = schema.get_strings(arrays, schema.TRUNK.input(schema.SPEC))
        if len(ks) != len(sids) or len(arms) != len(sids):
            raise WireError(
                f"{schema.NUM_DRAFT_TOKENS} and {schema.SPEC} need one entry per SIDS ({len(sids)}), "
                f"got {len(ks)} and {len(arms)}"
            )
        for k, arm in zip(ks, arms):
            if arm not in schema.SPECS:
                raise WireError(f"{schema.SPEC} must be one of {schema.SPECS}, got {arm!r}")
            stage = self.drafters.get(arm)
            schema.check_range(k_spec, k, hi=stage.max_num_draft_tokens if stage is not None else None)
            if arm != schema.OFF and arm not in self.drafters:
                raise WireError(f"{schema.SPEC}: {arm!r} is not hosted here (loaded: {sorted(self.drafters)})")
        return list(zip(sids, toks.tolist(), n_rows, ks, arms, self._rounds_program(arrays, len(sids))))

    @staticmethod
    def _call_of(call: list[tuple]) -> tuple[list[Rows], list[RoundsPlan]]:
        """The items and plans of a parsed ``draft_verify`` (:meth:`_parse_draft_verify`)."""
        items = [Rows(s, [int(t)], commit=n) for s, t, n, _, _, _ in call]
        plans = [
            RoundsPlan(None, 0, r, b, st, m) if arm == schema.OFF else RoundsPlan(arm, k, r, b, st, m)
            for _, _, _, k, arm, (r, b, m, st) in call
        ]
        return items, plans

    def _check_draft_verify(self, arrays: schema.Arrays, call: list[tuple]) -> None:
        """The checks of a parsed ``draft_verify`` against the sequences' states. Raises :class:`~tandem.schema.WireError`."""
        self.trunk._n_rows(arrays, [c[0] for c in call], required=False)
        for s, _, n, k, arm, (_, _, room, _) in call:
            c = self.trunk.caches[s]
            if c.pending is not None and not n:
                raise WireError(f"OP: draft_verify for sequence {s} while a verify is pending (N_ROWS)")
            if room > c.max_ctx - c.pos - n:
                raise WireError(
                    f"ROOM: {room} for sequence {s} exceeds the {c.max_ctx - c.pos - n} rows its trunk cache has left"
                )
            first = 1 + max(0, min(k, room - 2))  # the first round's rows (later rounds: ROOM bounds them)
            if c.pos + n + first > c.max_ctx:
                raise WireError(
                    f"TOKENS: context full for sequence {s}: {c.pos + n} + {first} rows > max_ctx {c.max_ctx}"
                )
            if arm == schema.OFF:
                continue
            stage = self.drafters[arm]
            if s not in self.ingest or s not in stage.states:
                raise WireError(f"SIDS: sequence {s} has no {arm} drafter state (drafter open first)")
            if getattr(stage.states[s], "arm", None) not in (None, arm):
                raise WireError(f"{schema.SPEC}: sequence {s} drafts with {stage.states[s].arm}, not {arm}")
            if not self.ingest[s].outs and not n:
                raise WireError(
                    f"SIDS: sequence {s} has no committed rows its {arm} drafter has not seen "
                    "(open the drafter before the prime)"
                )

    def _rounds_program(self, arrays: schema.Arrays, n: int) -> list[tuple[int, int, int, tuple[int, ...]]]:
        """Per sequence ``(rounds, budget, room, stop ids)`` of a ``draft_verify`` (absent: one round, no
        limit, no stop ids). Raises :class:`~tandem.schema.WireError` naming the field."""
        big = 1 << 30
        cols = []
        for name, default, lo in (("ROUNDS", 1, 1), ("BUDGET", big, 1), ("ROOM", big, 2)):
            if name not in arrays:
                cols.append([default] * n)
                continue
            v = [int(x) for x in schema.get_vector(arrays, schema.TRUNK.input(name))]
            if len(v) != n or min(v, default=lo) < lo:
                raise WireError(f"{name} needs one entry >= {lo} per SIDS ({n}), got {v}")
            cols.append(v)
        ids = schema.get_vector(arrays, schema.TRUNK.input("STOP_IDS")).tolist() if "STOP_IDS" in arrays else []
        lens = (
            [int(x) for x in schema.get_vector(arrays, schema.TRUNK.input("STOP_LENGTHS"))]
            if "STOP_LENGTHS" in arrays
            else [0] * n
        )
        if len(lens) != n or min(lens, default=0) < 0 or sum(lens) != len(ids):
            raise WireError(
                f"STOP_LENGTHS {lens} must hold one count >= 0 per SIDS ({n}) summing to the {len(ids)} STOP_IDS"
            )
        offs = np.cumsum([0] + lens).tolist()
        return [(r, b, m, tuple(ids[offs[j] : offs[j + 1]])) for j, (r, b, m) in enumerate(zip(*cols))]
