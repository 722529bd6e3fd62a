"""The engine core's speculative rounds in one trunk call: while every active session drafts with the same DFlash
spec on a drafter stage in this process, the others plain (greedy, no stop strings, no structured output), the rounds of a burst go to the trunk as one
:meth:`~tandem.engine.trunk_stage.TrunkStage.spec_burst` call (the drafter's round, the verify pass, the accept walk
and the commit of each round compiled together on the CPU, :mod:`tandem.ops.cpu.spec_burst`) instead of a drafter
call, a verify call and the Python between them each, and are then applied as the speculative round
(:class:`~tandem.engine.spec_round.SpecRound`) applies its rounds: the same tokens, receipts, caches, drafter rows
and draft-length counts as the rounds one at a time."""

from __future__ import annotations

import time

import torch

from .. import schema
from .accept import Walk
from .draft_length import DraftLength
from .plain_rounds import rounds_until
from .protocols import Rows, VerifyOut
from .session import Receipt, SpecSession, finish
from .spec_round import apply_walk
from .stage_set import StageSet
from .trunk_stage import TrunkStage


class CompiledRounds:
    """A burst's speculative rounds in one trunk call (:meth:`run`).

    Args: ``stages`` — the trunk (rounds in one call need its ``spec_burst``) and the drafters; ``policy`` — the
    drafts per session (planned once for the call's rounds; told each round's outcome, its costs each call's pace);
    ``stats`` and ``timing`` — the engine core's counters (``rounds``, ``accept_walks``, ``compiled_rounds``) and stage clocks
    (``draft_s``, ``verify_s``, ``accept_s``, ``rounds``), added to in place; ``enabled`` — the serving parameter
    ``compiled_spec_rounds`` (off: every speculative round is a :class:`~tandem.engine.spec_round.SpecRound`).
    """

    def __init__(self, stages: StageSet, policy: DraftLength, stats: dict, timing: dict, enabled: bool = True) -> None:
        self.stages, self.policy, self.stats, self.timing, self.enabled = stages, policy, stats, timing, enabled
        #: seconds a round of the last call took (0: none yet), to end a burst near ``burst_ms``
        self.round_s = 0.0

    def drafter(self, act: list[SpecSession]):
        """The DFlash drafter stage (in this process) of the sessions of ``act`` that may draft, when their rounds
        may run in one trunk call (one DFlash spec among them, the others plain: spec ``off`` or degraded; every
        session greedy, no stop strings or structured output; a trunk stage in this process, one rank), else None."""
        if not self.enabled or not act or not isinstance(self.stages.trunk, TrunkStage):
            return None
        specs = {s.spec for s in act if s.spec != schema.OFF and not s.degraded}
        if len(specs) != 1 or (spec := specs.pop()) not in schema.DFLASH_SPECS:
            return None
        stage = self.stages.drafters.get(spec)
        if getattr(stage, "contexts", None) is None or not self.stages.usable(stage):
            return None
        return stage if all(s.plain_greedy() for s in act) else None

    def run(
        self,
        act: list[SpecSession],
        receipts: dict[int, Receipt],
        ks: dict[int, int],
        most: int,
        deadline: float | None,
    ) -> tuple[int, bool]:
        """Run up to ``most`` rounds of the active sessions ``act`` in one trunk call, each session drafting ``ks``
        (the policy's plan for the coming round; 0: a plain row) every round, when :meth:`drafter` allows it (each
        session's budget and context room limit the rounds; a session's probe round runs alone, as the policy
        decides after it whether the session drafts on; with a ``deadline``, only the rounds that end at the first
        round boundary after it at the last call's pace, :func:`rounds_until`). Each session's receipt in
        ``receipts`` (made when missing) gets its rounds. Returns the rounds run (0: not applicable, nothing ran)
        and whether they were every round the deadline gave (the burst then ends)."""
        stage = self.drafter(act)
        if stage is None:
            return 0, False
        spec = next(s.spec for s in act if s.spec != schema.OFF and not s.degraded)
        block = stage.drafters[spec].cfg.block_size - 1
        ks = {s.sid: min(ks[s.sid], block) if s.spec == spec and not s.degraded else 0 for s in act}
        if any(ks[s.sid] and s.ingest is None for s in act):
            return 0, False
        paced = rounds_until(deadline, self.round_s)
        room = min((s.max_ctx - 2 - len(s.committed)) // (ks[s.sid] + 1) for s in act)
        n = min(most, paced, room)
        if any(ks[s.sid] and s.drafting.probed for s in act):  # a probe is one round: its outcome decides the next
            n = min(n, 1)
        if n < 1:
            return 0, False
        feats = [s.drafter_input()[0].features if ks[s.sid] else None for s in act]
        t0 = time.perf_counter()
        outs = self.stages.trunk.spec_burst(
            [Rows(s.sid, [s.anchor], commit=s.trunk_commit) for s in act],
            stage,
            spec,
            [ks[s.sid] for s in act],
            feats,
            [tuple(s.stop_ids) for s in act],
            [s.turn_remaining for s in act],
            n,
        )
        if outs is None:
            return 0, False
        t1 = time.perf_counter()
        ran = max(len(o["emitted"]) for o in outs)
        self._saw(act, ks, outs, ran, t1 - t0)
        for s, o in zip(act, outs):
            r = receipts.setdefault(s.sid, Receipt(tokens=[], accepted_at=[0] * len(s.accepted_at)))
            s.trunk_commit = self._apply(s, o, r, ks[s.sid] > 0)
        self.stats["rounds"] += sum(len(o["emitted"]) for o in outs)
        self.stats["accept_walks"] += sum(len(o["emitted"]) for o in outs)
        self.stats["compiled_rounds"] += sum(len(o["emitted"]) for o in outs)
        tm = self.timing
        draft, walk = (max(o["seconds"][i] for o in outs) for i in (0, 2))
        tm["draft_s"] += draft
        tm["verify_s"] += t1 - t0 - draft - walk
        tm["accept_s"] += walk + time.perf_counter() - t1
        tm["rounds"] += ran
        return ran, ran == n == paced

    def _saw(self, act: list[SpecSession], ks: dict[int, int], outs: list[dict], ran: int, seconds: float) -> None:
        """Tell the policy's costs a round's pace: ``seconds`` over ``ran`` rounds, split into the drafters' share and
        the verify line's (rows: every session's anchor and drafts) as the call's cycle counts split it."""
        self.round_s = seconds / ran
        tot = sum(sum(o["seconds"]) for o in outs)
        share = sum(o["seconds"][0] for o in outs) / tot if tot > 0 else 0.0
        drafting = [s for s in act if ks[s.sid]]
        costs = self.policy.costs
        if drafting and tot > 0:  # (no cycle counter: the drafts' share stays in the verify line's)
            k = sum(ks[s.sid] for s in drafting)
            costs.saw_draft(drafting[0].spec, len(drafting), k, self.round_s * share, compiled=True)
        costs.saw_verify(sum(ks[s.sid] + 1 for s in act), self.round_s * (1.0 - share), compiled=True)

    def _apply(self, s: SpecSession, o: dict, r: Receipt, drafting: bool) -> int:
        """Session ``s``'s rounds ``o`` (one trunk call's; ``drafting``: it drafted in them, else a plain row each)
        applied as :class:`~tandem.engine.spec_round.SpecRound` applies them one at a time: each round's walk, then
        the committed rows its drafter has yet to take in (a drafting session's last round's; a resting one's every
        row, queued; a session without a drafter keeps the newest). Returns the rows the next call commits (the
        last round's emitted count)."""
        for drafts, emitted, a, gaps in zip(o["drafts"], o["emitted"], o["accepted"], o["gaps"]):
            m, budget = len(emitted), s.turn_remaining
            if drafting:
                s.drafter_rows = len(s.committed)
            reason = "stop" if emitted[-1] in s.stop_ids else ("length" if m == budget else None)
            apply_walk(s, r, drafts, Walk(a, emitted, reason), gaps, self.policy if drafting else None)
            finish(s, r, reason)
        n = len(o["emitted"])
        if drafting:
            gaps = torch.tensor(o["gaps"][-1], dtype=torch.float32)
            s.ingest = (VerifyOut(torch.tensor(emitted), o["hidden"], gaps, o["features"]), emitted)
            return m
        tokens = [e[0] for e in o["emitted"]]
        rows = VerifyOut(torch.tensor(tokens), o["hidden"], torch.tensor([g[0] for g in o["gaps"]]), o["features"])
        if s.drafts_later:  # a resting session: its rows wait for the drafter's next (probe) round
            s.queue_for_drafter(rows, tokens)
        else:
            s.ingest = (rows.rows_at(n - 1), tokens[-1:])
        self.policy.ran_plain(s, n - 1)  # (the plan moved its clocks for the first round)
        return m
