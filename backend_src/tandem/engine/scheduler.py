"""The scheduler: admits turns, runs every active session in bursts of verify rounds (all sessions'
draft work batched into one drafter call per round, all verify work into one trunk call that also
carries the previous round's commits), and publishes one receipt per session per burst. Stage state
is opened and closed here, batched. Synchronous: in-process it is driven directly, behind Triton by the worker thread of
:mod:`tandem.serving.front`.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .. import schema
from ..schema import ServingConfig
from .accept import Walk, accept_walk
from .demotion import Demotion
from .lifecycle import Lifecycle
from .prefill import Prefill
from .prefix import PrefixIndex, publish_ready, reusable_blocks
from .hosted import HostedRounds
from .plain_rounds import PlainRounds
from .protocols import Commit, DrafterAPI, DraftRequest, Rows, TrunkAPI, VerifyOut
from .session import Receipt, SpecSession, Turn  # noqa: F401 - Turn: re-exported (the scheduler's API)
from .stops import StopText, validate_stops

class Scheduler(Lifecycle, Prefill, HostedRounds, PlainRounds):
    """Sessions by sequence id, and the round / burst loop over them.

    Args: ``trunk`` — a :class:`~tandem.engine.protocols.TrunkAPI`; ``drafters`` — arm ->
    :class:`~tandem.engine.protocols.DrafterAPI` (arms not listed are refused; one stage may serve
    several arms, and gets one call per round for all of them); ``config`` — defaults and limits;
    ``stop_ids`` — tokens that end a turn; ``decode`` — ``list[int] -> str`` for stop strings (None: refused).
    ``request_cancel`` may be called from any thread; everything else from one thread.
    """

    def __init__(self, trunk: TrunkAPI, drafters: dict[str, DrafterAPI] | None = None,
                 config: ServingConfig = schema.DEFAULTS, stop_ids: tuple[int, ...] = (),
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.trunk, self.drafters = trunk, dict(drafters or {})
        self.config, self.decode = config, decode
        self.stop_ids = tuple(stop_ids)
        self.sessions: dict[int, SpecSession] = {}
        self.turns: dict[int, Turn] = {}
        self._to_close: list[SpecSession] = []
        #: turns of new sequences waiting for a free session slot: (monotonic deadline, turn)
        self._waiting: list[tuple[float, Turn]] = []
        #: the turns whose admission calls are running (read by a watchdog thread)
        self.admitting: list[Turn] = []
        self._cancel_lock = threading.Lock()
        self._to_cancel: dict[int, tuple[Turn | None, str | None]] = {}
        self.stats = {"sessions_opened": 0, "sessions_expired": 0, "cancelled": 0, "rounds": 0, "drafted": 0,
                      "accepted": 0}
        #: the prefix cache's index (None when ``config.prefix_cache_mb`` is 0)
        self.prefix = PrefixIndex(config.prefix_cache_mb << 20) if config.prefix_cache_mb > 0 else None
        #: wall seconds per stage of :meth:`round` (summed; a batched round counts once)
        self.timing = {"draft_s": 0.0, "verify_s": 0.0, "accept_s": 0.0, "rounds": 0}
        #: moves sessions to plain decoding and back (counts ``demotions`` / ``promotions`` in stats)
        self.demotion = Demotion(config, self.stats)
        #: ``quiet()``: no turn is about to arrive (the front's queue is empty), so a pipelined call may be sent
        self.quiet: Callable[[], bool] = lambda: True
        #: ``failure_text(exception)``: the message for turns a failed stage call ends (None: the default)
        self.failure_text: Callable[[Exception], str | None] = lambda e: None

    # -- admission --------------------------------------------------------------------------------
    def validate(self, t: Turn) -> str | None:
        """The one validation of a turn: error text naming the wire field and its limit, or None."""
        cfg, s = self.config, self.sessions.get(t.sid)
        if not self._usable(self.trunk):
            return f"{self.stage_name(self.trunk)} is restarting (its process stopped); retry in a few seconds"
        if t.spec is not None and t.spec not in schema.SPECS:
            return f"{schema.SPEC} must be one of {schema.SPECS}, got {t.spec!r}"
        arm = self._arm(t)
        if arm != schema.OFF and arm not in self.drafters:
            model = schema.DRAFTER_MTP.name if arm == schema.MTP else schema.DRAFTER_DFLASH.name
            return (f"{schema.SPEC} {arm!r} needs the {model} model with a {arm} drafter, which is not loaded"
                    + (" (the checkpoint has none: `make drafter` trains it)" if arm in schema.DFLASH_ARMS else ""))
        if s is not None and not t.start and t.spec is not None and t.spec != s.arm:
            return f"{schema.SPEC}: sequence {t.sid} runs {s.arm!r}; a later turn cannot switch to {t.spec!r}"
        if t.num_draft_tokens is not None and arm == schema.OFF:  # never silently ignored
            return (f"{schema.NUM_DRAFT_TOKENS}: {schema.sequence_name(t.sid)} decodes plain ({schema.SPEC} 'off'), "
                    f"which takes no drafts")
        try:
            schema.check_range(schema.TANDEM.input(schema.MAX_TOKENS), t.max_tokens, hi=cfg.max_ctx)
        except schema.WireError as e:
            return str(e)
        try:
            if t.num_draft_tokens is not None:  # a DFlash block holds the anchor and block_size - 1 drafts
                schema.check_range(schema.TANDEM.input(schema.NUM_DRAFT_TOKENS), t.num_draft_tokens,
                                   hi=cfg.block_size - 1 if arm in schema.DFLASH_ARMS else cfg.max_num_draft_tokens)
        except schema.WireError as e:
            return str(e) + (f" (the {arm} block is {cfg.block_size} rows)" if arm in schema.DFLASH_ARMS else "")
        vocab = getattr(self.trunk, "vocab_size", None)
        bad = next((x for x in t.tokens if vocab is not None and not 0 <= x < vocab), None)
        if bad is not None:
            return f"{schema.INPUT_IDS}: token ids must be in [0, {vocab}), got {bad}"
        if len(t.stop_token_ids) > schema.MAX_STOP_TOKEN_IDS:
            return f"{schema.STOP_TOKEN_IDS}: at most {schema.MAX_STOP_TOKEN_IDS} ids, got {len(t.stop_token_ids)}"
        bad = next((x for x in t.stop_token_ids if not 0 <= x < (vocab if vocab is not None else 2**31)), None)
        if bad is not None:
            return f"{schema.STOP_TOKEN_IDS}: token ids must be in [0, {vocab}), got {bad}"
        if (err := validate_stops(t.stop, self.decode)) is not None:
            return err
        if len(salt := t.cache_salt.encode("utf-8")) > schema.MAX_CACHE_SALT_BYTES:
            return f"{schema.CACHE_SALT}: at most {schema.MAX_CACHE_SALT_BYTES} bytes, got {len(salt)}"
        if not t.start and s is None:
            return (f"{schema.SEQUENCE_ID}: unknown sequence id {t.sid} (set {schema.SEQUENCE_START} on the first turn) "
                    f"{schema.SESSION_LOST_MARKER}")
        if t.sid in self.turns:
            return f"{schema.SEQUENCE_ID}: sequence id {t.sid} already has a turn in progress"
        base = 0 if t.start or s is None else len(s.committed) + (s.anchor is not None and not self._drops_anchor(s))
        if base + len(t.tokens) >= cfg.max_ctx:
            return (f"{schema.INPUT_IDS}: {base} context + {len(t.tokens)} new tokens leaves no room to generate "
                    f"within the context capacity of {cfg.max_ctx} tokens (at most {cfg.max_ctx - 1 - base} new tokens)")
        if base == 0 and not t.tokens:
            return f"{schema.INPUT_IDS}: the first turn of a sequence needs at least 1 token"
        return None

    def admit(self, turns: list[Turn]) -> None:
        """Validate, open the new sessions' stage state (one call per stage), prime every admitted
        turn in one trunk call, and emit each turn's first token. A new sequence finding all
        ``max_sessions`` open waits (retried by each later call) until ``admission_wait_s`` has passed."""
        ok: list[tuple[Turn, SpecSession, list[int]]] = []
        seen: set[int] = set()
        now = time.monotonic()
        held, waiting = self._waiting, []
        free = self.config.max_sessions - len(self.sessions)
        for deadline, t in held + [(now + self.config.admission_wait_s, t) for t in turns]:
            err = self.validate(t)
            twice = t.sid in seen
            if err is None and twice:
                err = f"{schema.SEQUENCE_ID}: sequence id {t.sid} sent two turns at once; the first one runs"
            if err is None and t.sid not in self.sessions:  # a new session needs a free slot
                if free > 0:
                    free -= 1
                elif now < deadline:
                    waiting.append((deadline, t))
                    seen.add(t.sid)  # a later turn of the sequence is "two turns at once"
                    continue
                else:
                    err = self._no_free_session(t)
            if err is not None:
                t.emit(None, err, True)
                if t.end and not twice and t.sid in self.sessions:  # END ends the sequence, refused or not
                    self.cancel(t.sid, f"sequence {t.sid} ended by a refused final request: {err}")
                continue
            seen.add(t.sid)
            if t.start and t.sid in self.sessions:
                self.close(t.sid)
            s = self.sessions.get(t.sid)
            if s is None:
                arm = self._arm(t)
                s = SpecSession(t.sid, self._num_draft_tokens(t), self.config.max_ctx, trunk=self.trunk, arm=arm,
                                drafter=self.drafters.get(arm))
            elif t.num_draft_tokens is not None:  # a later turn may change the draft count
                s.num_draft_tokens = self._num_draft_tokens(t)
                s.accepted_at += [0] * (s.num_draft_tokens - len(s.accepted_at))
            drop = self._drops_anchor(s)
            rows = ([s.anchor] if s.anchor is not None and not drop else []) + list(t.tokens)
            if drop and s.ingest is not None:  # the last committed row is followed by this turn's first token
                s.ingest = (s.ingest[0], s.ingest[1][:-1] + rows[:1])
            item = self._prefix_rows(s, rows, t.cache_salt)
            item.commit, s.trunk_commit = s.trunk_commit, 0  # the last turn's final commit rides on this prime
            item.sampling = s.sampling = t.sampling
            s.stop_ids = self.stop_ids + tuple(x for x in t.stop_token_ids if x not in self.stop_ids)
            s.stop_text = StopText(self.decode, t.stop) if t.stop else None
            ok.append((t, s, self._chunked(s, item, t.max_tokens)))
        self._waiting = waiting
        self._flush_closes()
        if not ok:
            return
        new = [s for _, s, _ in ok if s.sid not in self.sessions]
        for s in new:
            self.sessions[s.sid] = s
        self.stats["sessions_opened"] += len(new)
        self.admitting = [t for t, _, _ in ok]  # a watchdog may answer them while a call hangs
        hosted, number = getattr(self.trunk, "hosts_drafters", False), None
        try:
            if new and not hosted:  # (a trunk that hosts the drafters opens both with the prime: one call)
                self.trunk.open([s.sid for s in new])
                warm = {s.sid: (s.arm, r.prefix) for _, s, r in ok if r.prefix and s.arm in schema.DFLASH_ARMS}
                self._open_drafters(new, warm)
            items = [rows for _, _, rows in ok]
            if hosted:  # each new session's arm: the prime opens its trunk and drafter state first
                opened, number = {s.sid for s in new}, self._chain_prime(ok)  # (the first burst's call sent after it)
                outs = self.trunk.prime(items, opens=[s.arm if s.sid in opened else "" for _, s, _ in ok], number=number)
            else:
                outs = self.trunk.prime(items)
        except Exception as e:  # noqa: BLE001 - the turns being admitted fail; running sessions go on
            if number is not None:
                self.trunk.pipeline.drop()  # (the call after the prime: its turn ends here)
            if getattr(e, "dead", False):  # the trunk's process died: every session's state is gone
                self.on_stage_dead(self.stage_name(self.trunk), str(e))
            reason = self.failure_text(e) or f"admission failed: {type(e).__name__}: {e}"
            for t, s, _ in ok:
                self.close(s.sid)
                t.emit(None, reason, True)
            self._flush_closes()
            return
        finally:
            self.admitting = []
        for (t, s, rows), out in zip(ok, outs):
            self.turns[s.sid] = t
            r = self._primed(s, rows, out)
            if r is not None:  # else the prime goes on in chunks, one per burst
                self._publish(s, r)
        self._flush_closes()
        self._pipeline_idle()  # (a turn that ended at its first token: the call sent after its prime ran no round)

    def _drops_anchor(self, s: SpecSession) -> bool:
        """A turn that ended at the template's stop token leaves that token as the anchor; it is not
        context: the next turn's own first token (``<|user|>`` in the chat template) is the boundary.
        (A turn's own ``stop_token_ids`` are ordinary text: such an anchor stays context.)"""
        return s.anchor is not None and s.finish_reason == "stop" and s.anchor in self.stop_ids

    def _prefix_rows(self, s: SpecSession, rows: list[int], salt: str = "") -> Rows:
        """The prime item of a turn: with the prefix cache on, a new session's prompt (plain or DFlash
        arm) is looked up block by block in the namespace of its turn's cache ``salt`` and captured; its
        published leading blocks are skipped."""
        if self.prefix is None or s.committed or s.arm == schema.MTP or reusable_blocks(len(rows)) == 0:
            return Rows(s.sid, rows)
        cap = self.prefix.capture(rows, salt)
        hit = self.prefix.lookup(cap, s.arm)
        s.prefix_capture, s.warm_rows = cap, hit * schema.PREFIX_BLOCK
        s.drafter_rows = s.warm_rows if s.arm in schema.DFLASH_ARMS else 0
        return Rows(s.sid, rows[s.warm_rows:], cap.keys[:hit])

    def _after_prime(self, s: SpecSession, item: Rows, out: VerifyOut, max_tokens: int) -> Receipt:
        rows = item.tokens
        if item.prefix:  # the restored rows are the first turn's leading tokens
            s.committed.extend(self.turns[s.sid].tokens[: s.warm_rows])
        s.committed.extend(rows)
        tok = int(out.argmax[-1])
        s.anchor, s.turn_remaining, s.finish_reason, s.turn_done = tok, max_tokens - 1, None, False
        ingest = (out, rows[1:] + [tok])
        if s.ingest is not None:  # the previous turn's last committed rows have not reached the drafter yet
            ingest = (s.ingest[0].then(out), s.ingest[1] + ingest[1])
        s.ingest = ingest
        s.last_active = time.monotonic()
        r = Receipt(tokens=[tok], top2_gaps=[float(out.top2_gap[-1])], accepted_at=[0] * len(s.accepted_at))
        hit = s.stop_text is not None and s.stop_text.scan([tok]) is not None  # always pushed: hold_back needs it
        stop = hit or tok in s.stop_ids
        self._finish(s, r, "stop" if stop else ("length" if s.turn_remaining <= 0 else None))
        return r

    def _finish(self, s: SpecSession, r: Receipt, finish: str | None) -> None:
        if finish is None and len(s.committed) + 1 >= s.max_ctx:
            finish = "context"
        if finish is not None:
            r.finish_reason = s.finish_reason = finish
            s.turn_done = True
            r.stop_string = (s.stop_text.matched or "") if s.stop_text is not None else ""

    def _arm(self, t: Turn) -> str:
        s = self.sessions.get(t.sid)
        return t.spec if t.spec is not None else (s.arm if s is not None and not t.start else self.default_arm())

    def default_arm(self) -> str:
        """The arm of a new sequence that names none: ``config.spec`` when its drafter is loaded, else
        ``mtp`` when that is, else ``off``."""
        return next(a for a in (self.config.spec, schema.MTP, schema.OFF) if a == schema.OFF or a in self.drafters)

    def _num_draft_tokens(self, t: Turn) -> int:
        """Drafts per round: 0 for plain decoding; the request's value (checked by :meth:`validate`) or
        the server default (the whole block, ``block_size - 1``, on the DFlash arms)."""
        arm = self._arm(t)
        if arm == schema.OFF:
            return 0
        return t.num_draft_tokens or (self.config.block_size - 1 if arm in schema.DFLASH_ARMS else self.config.num_draft_tokens)

    def _by_drafter(self, sessions: list[SpecSession]) -> list[tuple[DrafterAPI, list[SpecSession]]]:
        """Sessions that draft, grouped by drafter stage (one call per stage)."""
        groups: dict[int, tuple[DrafterAPI, list[SpecSession]]] = {}
        for s in sessions:
            if s.arm != schema.OFF:
                stage = self.drafters[s.arm]
                groups.setdefault(id(stage), (stage, []))[1].append(s)
        return list(groups.values())

    # -- rounds -----------------------------------------------------------------------------------
    def active(self) -> list[SpecSession]:
        """Sessions with a turn that still generates (primed: not :meth:`prefilling`)."""
        return [s for sid in self.turns if not (s := self.sessions[sid]).turn_done and s.prefill is None]

    def busy(self) -> bool:
        """Whether :meth:`burst` has work: a turn generating or being primed in chunks."""
        return bool(self.active() or self.prefilling())

    def round(self, receipts: dict[int, Receipt]) -> None:
        """One verify round over every active session: one drafter call and one trunk verify, which
        first commits each session's previous round (the walk's rows kept, see :meth:`settle`); with
        a trunk that hosts the drafters (``colocate``), one ``draft_verify`` call doing all three."""
        act = self.active()
        if not act:
            return
        if getattr(self.trunk, "hosts_drafters", False):  # colocate: draft + verify in one trunk call
            self._hosted_call(act, receipts, dict.fromkeys((s.sid for s in act), 1), len(act), lambda t: len(act), {})
            return
        clock = time.perf_counter
        t0 = clock()
        drafts: dict[int, list[int]] = {s.sid: [] for s in act}
        spec = [s for s in act if self.demotion.speculates(s)]  # demoted sessions decode plain rows
        for stage, group in self._by_drafter(spec):
            reqs = [DraftRequest(s.sid, s.ingest[0].hidden, s.ingest[1], s.draft_budget(), s.ingest[0].features, s.arm)
                    for s in group]
            for s, d in zip(group, self._draft(stage, group, reqs)):
                s.drafter_rows, s.ingest, drafts[s.sid] = len(s.committed), None, d
        t1 = clock()
        outs = self.trunk.verify([Rows(s.sid, [s.anchor] + drafts[s.sid], commit=s.trunk_commit) for s in act])
        t2 = clock()
        speculated = {s.sid for s in spec}
        for s, out in zip(act, outs):
            r = receipts.setdefault(s.sid, Receipt(tokens=[], accepted_at=[0] * len(s.accepted_at)))
            s.trunk_commit = self._after_verify(s, drafts[s.sid], out, r, len(act) if s.sid in speculated else None)
        t3 = clock()
        self.stats["rounds"] += len(act)
        tm = self.timing
        tm["draft_s"] += t1 - t0
        tm["verify_s"] += t2 - t1
        tm["accept_s"] += t3 - t2
        tm["rounds"] += 1

    def settle(self) -> None:
        """Apply every session's deferred commit now, in one trunk call: afterwards each trunk cache
        holds exactly ``committed`` (the session contract's state). Serving never needs it (the next
        prime / verify carries the commit); tests and in-process inspection do. Raises ``RuntimeError``
        while a pipelined call runs ahead of the sessions (:mod:`tandem.engine.pipeline`)."""
        if (pipe := getattr(self.trunk, "pipeline", None)) is not None and pipe.queued is not None:
            raise RuntimeError("settle() while a pipelined draft_verify_next runs ahead (its burst replays it)")
        pend = [s for s in self.sessions.values() if s.trunk_commit]
        if pend:
            self.trunk.commit([Commit(s.sid, s.trunk_commit) for s in pend])
            for s in pend:
                s.trunk_commit = 0

    def _after_verify(self, s: SpecSession, drafts: list[int], out: VerifyOut, r: Receipt, load: int | None) -> int:
        """Apply the accept walk to the session and the burst's receipt (and, after a speculative
        round with ``load`` active sessions, to the demotion policy); returns rows to commit."""
        w = accept_walk(drafts, out.argmax.tolist(), s.stop_ids, s.turn_remaining)
        if s.stop_text is not None and (n := s.stop_text.scan(w.emitted)) is not None:  # a stop string: cut there
            w = Walk(min(w.accepted, n), w.emitted[:n], "stop")
        m = len(w.emitted)
        s.rounds += 1
        s.drafted += len(drafts)
        s.accepted += w.accepted
        r.rounds += 1
        r.spec_rounds += bool(drafts)
        r.drafted += len(drafts)
        r.accepted += w.accepted
        for i in range(w.accepted):
            s.accepted_at[i] += 1
            r.accepted_at[i] += 1
        s.committed.extend([s.anchor] + w.emitted[:-1])
        s.anchor = w.emitted[-1]
        s.turn_remaining -= m
        r.tokens.extend(w.emitted)
        r.top2_gaps.extend(float(g) for g in out.top2_gap[:m])
        if load is not None:
            self.demotion.observe(s, w.accepted, len(drafts), load)
        if s.arm == schema.OFF or s.degraded or s.ingest is None:
            s.ingest = (out.rows(m), w.emitted)
        else:  # a demoted session: its rows wait for the drafter's next (probe) round
            s.ingest = (s.ingest[0].then(out.rows(m)), s.ingest[1] + w.emitted)
        s.last_active = time.monotonic()
        self._finish(s, r, w.finish)
        return m

    def burst(self) -> None:
        """Close the turns cancelled since the last burst, run up to ``burst_rounds`` rounds (ending at
        the first round boundary after ``burst_ms`` of rounds), then publish each session's receipt (a
        burst boundary)."""
        self._apply_cancels()
        self._prefill_step()
        receipts: dict[int, Receipt] = {}
        deadline = time.perf_counter() + self.config.burst_ms / 1e3 if self.config.burst_ms > 0 else None
        if getattr(self.trunk, "hosts_drafters", False):  # colocate: the rounds of a burst in as few calls as can be
            self._hosted_burst(receipts, deadline)
        else:
            self._rounds_burst(receipts, deadline)
        if self.prefix is not None:
            try:
                publish_ready(self.prefix, [self.sessions[sid] for sid in receipts], self.trunk, self.drafters)
            except Exception as e:  # noqa: BLE001 - a prefix the stores could not take is only a lost cache entry
                self.prefix.stats["last_error"] = f"{type(e).__name__}: {e}"  # counted in stats["errors"]
        for sid, r in receipts.items():
            self._publish(self.sessions[sid], r)
        self._flush_closes()
        self._pipeline_idle()

    def _publish(self, s: SpecSession, r: Receipt) -> None:
        t = self.turns[s.sid]
        if s.stop_text is not None:  # tokens that may begin a stop string wait for the next burst
            r.tokens, r.top2_gaps = s.stop_text.hold_back(r.tokens, r.top2_gaps, r.finish_reason is not None)
        self.stats["drafted"] += r.drafted
        self.stats["accepted"] += r.accepted
        if r.finish_reason is None:
            t.emit(r, None, False)
            return
        del self.turns[s.sid]
        t.emit(r, None, True)
        if t.end:
            self.close(s.sid)
