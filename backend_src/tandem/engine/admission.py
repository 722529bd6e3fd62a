"""Admission: each turn is validated (once, for every wire field), then admitted on its session (a new one,
or its sequence's), left waiting, or refused. A new sequence finding all ``max_sessions`` open, or a turn
whose state would not fit in ``max_state_mb`` (:meth:`Admission.state_need`), waits in arrival order
until ``admission_wait_s`` after it arrived (``Turn.arrived``), then is refused; a turn of a sequence
whose running turn is ending waits for it likewise."""

from __future__ import annotations

import threading
import time
from typing import Callable

from .. import schema
from ..schema import ServingConfig
from .session_table import SessionTable
from .protocols import Rows
from .publication import PrefixPublisher
from .session import SpecSession, Turn
from .stage_set import StageSet
from .state_size import StateSize
from .stops import StopText, validate_stops
from .structured import Grammars, ResponseFormat


class Admission:
    """Validation, the waiting turns, admission by count and by bytes, and a turn's session and prime.

    Args: ``config`` — limits and defaults; ``table`` — the sessions and running turns; ``stages`` —
    the trunk (its vocabulary, its availability) and the drafters by spec; ``publisher`` — a new
    prompt's prefix lookup; ``stats`` — the engine core's counters (this class counts
    ``sessions_refused_full`` and ``sessions_refused_memory``); ``stop_ids`` — tokens that end every
    turn; ``decode`` — ``list[int] -> str`` for stop strings (None: refused); ``state_size`` — the
    session state estimate admission by bytes uses (``max_state_mb``; None: none); ``grammars`` — the
    structured-output engine (:class:`~tandem.engine.structured.Grammars`; None: ``RESPONSE_FORMAT`` refused).
    :meth:`refuse_overdue` and :meth:`compile_format` may be called from any thread; everything else from the
    engine core's thread.
    """

    def __init__(
        self,
        config: ServingConfig,
        table: SessionTable,
        stages: StageSet,
        publisher: PrefixPublisher,
        stats: dict,
        stop_ids: tuple[int, ...] = (),
        decode: Callable[[list[int]], str] | None = None,
        state_size: StateSize | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.config, self.table, self.stages, self.publisher, self.stats = config, table, stages, publisher, stats
        self.stop_ids, self.decode, self.state_size = tuple(stop_ids), decode, state_size
        self.grammars = grammars
        #: sid -> bytes charged to a session while its turn runs (its state at the turn's largest context)
        self._reserved: dict[int, int] = {}
        #: held while :meth:`sort` sorts turns into admitted / waiting / refused (:meth:`refuse_overdue`)
        self._admit_lock = threading.Lock()
        #: turns waiting for a free session slot, room or their sequence's turn: (monotonic deadline, turn)
        self._waiting: list[tuple[float, Turn]] = []

    # -- the waiting turns ------------------------------------------------------------------------
    def waiting(self) -> int:
        """Turns waiting for a free session slot (or room, or their sequence's running turn to end)."""
        return len(self._waiting)

    def waiting_turns(self) -> list[Turn]:
        """The waiting turns (a copy)."""
        return [t for _, t in list(self._waiting)]

    def drop_waiting(self) -> list[Turn]:
        """Forget every waiting turn, unanswered; returns them."""
        held, self._waiting = self._waiting, []
        return [t for _, t in held]

    # -- validation -------------------------------------------------------------------------------
    def compile_format(self, t: Turn) -> str | None:
        """Compile ``t``'s ``response_format`` into ``t.grammar`` (nothing to do without one, or once compiled):
        error text naming the field, or None. Thread-safe: the front calls it on the request's thread, so a
        compile never holds up the engine core's rounds."""
        if not t.response_format or t.grammar is not None:
            return None
        try:
            fmt = ResponseFormat.parse(t.response_format)
            if fmt is None:
                return None
            if self.grammars is None:
                return f"{schema.RESPONSE_FORMAT}: this server has no grammar engine (structured output is off)"
            t.grammar = self.grammars.compile(fmt)
        except schema.WireError as e:
            return str(e)
        return None

    def validate(self, t: Turn) -> str | None:
        """The one validation of a turn: error text naming the wire field and its limit, or None."""
        cfg, s, trunk = self.config, self.table.sessions.get(t.sid), self.stages.trunk
        if not self.stages.usable(trunk):
            return f"{self.stages.name(trunk)} is restarting (its process stopped); retry in a few seconds"
        if t.spec is not None and t.spec not in schema.SPECS:
            return f"{schema.SPEC} must be one of {schema.SPECS}, got {t.spec!r}"
        spec = self.spec(t)
        if spec == schema.MTP and cfg.tensor_parallel > 1:
            return (
                f"{schema.SPEC} 'mtp' is not served with tensor_parallel {cfg.tensor_parallel} (the MTP layer is not "
                f"split across ranks): use off, dflash or dflash2"
            )
        if spec != schema.OFF and spec not in self.stages.drafters:
            model = schema.DRAFTER_MTP.name if spec == schema.MTP else schema.DRAFTER_DFLASH.name
            return f"{schema.SPEC} {spec!r} needs the {model} model with a {spec} drafter, which is not loaded" + (
                " (the checkpoint has none: `make drafter` trains it)" if spec in schema.DFLASH_SPECS else ""
            )
        if s is not None and not t.start and t.spec is not None and t.spec != s.spec:
            return f"{schema.SPEC}: sequence {t.sid} runs {s.spec!r}; a later turn cannot switch to {t.spec!r}"
        if t.num_draft_tokens is not None and spec == schema.OFF:  # never silently ignored
            return (
                f"{schema.NUM_DRAFT_TOKENS}: {schema.sequence_name(t.sid)} decodes plain ({schema.SPEC} 'off'), "
                f"which takes no drafts"
            )
        try:
            schema.check_range(schema.TANDEM.input(schema.MAX_TOKENS), t.max_tokens, hi=cfg.max_ctx)
        except schema.WireError as e:
            return str(e)
        try:
            if t.num_draft_tokens is not None:  # a DFlash block holds the anchor and block_size - 1 drafts
                schema.check_range(
                    schema.TANDEM.input(schema.NUM_DRAFT_TOKENS),
                    t.num_draft_tokens,
                    hi=cfg.block_size - 1 if spec in schema.DFLASH_SPECS else cfg.max_num_draft_tokens,
                )
        except schema.WireError as e:
            return str(e) + (f" (the {spec} block is {cfg.block_size} rows)" if spec in schema.DFLASH_SPECS else "")
        vocab = getattr(trunk, "vocab_size", None)
        bad = next((x for x in t.tokens if vocab is not None and not 0 <= x < vocab), None)
        if bad is not None:
            return f"{schema.INPUT_IDS}: token ids must be in [0, {vocab}), got {bad}"
        vision = set(getattr(trunk, "vision_token_ids", ()))
        bad = next((x for x in t.tokens if x in vision), None)
        if bad is not None:
            return (
                f"{schema.INPUT_IDS}: token {bad} is an image or video placeholder: this server serves the text "
                "model of the checkpoint (image and video inputs are not supported)"
            )
        if len(t.stop_token_ids) > schema.MAX_STOP_TOKEN_IDS:
            return f"{schema.STOP_TOKEN_IDS}: at most {schema.MAX_STOP_TOKEN_IDS} ids, got {len(t.stop_token_ids)}"
        bad = next((x for x in t.stop_token_ids if not 0 <= x < (vocab if vocab is not None else 2**31)), None)
        if bad is not None:
            return f"{schema.STOP_TOKEN_IDS}: token ids must be in [0, {vocab}), got {bad}"
        if (err := validate_stops(t.stop, self.decode)) is not None:
            return err
        if len(salt := t.cache_salt.encode("utf-8")) > schema.MAX_CACHE_SALT_BYTES:
            return f"{schema.CACHE_SALT}: at most {schema.MAX_CACHE_SALT_BYTES} bytes, got {len(salt)}"
        if (err := self.compile_format(t)) is not None:
            return err
        if not t.start and s is None:
            return (
                f"{schema.SEQUENCE_ID}: unknown sequence id {t.sid}: this server holds no such session (set "
                f"{schema.SEQUENCE_START} on the first turn; behind a proxy, send the {schema.ROUTING_HEADER} "
                f"header, the sequence id, with every turn so it reaches the server holding the session) "
                f"{schema.SESSION_LOST_MARKER}"
            )
        if t.sid in self.table.turns:
            return f"{schema.SEQUENCE_ID}: sequence id {t.sid} already has a turn in progress"
        base = 0 if t.start or s is None else len(s.committed) + (s.anchor is not None and not self.drops_anchor(s, t))
        if base + len(t.tokens) >= cfg.max_ctx:
            return (
                f"{schema.INPUT_IDS}: {base} context + {len(t.tokens)} new tokens leaves no room to generate "
                f"within the context capacity of {cfg.max_ctx} tokens (at most {cfg.max_ctx - 1 - base} new tokens)"
            )
        if base == 0 and not t.tokens:
            return f"{schema.INPUT_IDS}: the first turn of a sequence needs at least 1 token"
        return None

    def spec(self, t: Turn) -> str:
        """The spec turn ``t`` decodes with: its ``spec``, else its sequence's, else :meth:`default_spec`."""
        s = self.table.sessions.get(t.sid)
        return t.spec if t.spec is not None else (s.spec if s is not None and not t.start else self.default_spec())

    def default_spec(self) -> str:
        """The spec of a new sequence that names none: ``config.spec`` when its drafter is loaded, else
        ``mtp`` when that is, else ``off``."""
        drafters = self.stages.drafters
        return next(a for a in (self.config.spec, schema.MTP, schema.OFF) if a == schema.OFF or a in drafters)

    def num_draft_tokens(self, t: Turn) -> int:
        """Drafts per round: 0 for plain decoding; the request's value (checked by :meth:`validate`) or
        the server default (the whole block, ``block_size - 1``, on the DFlash specs)."""
        spec = self.spec(t)
        if spec == schema.OFF:
            return 0
        return t.num_draft_tokens or (
            self.config.block_size - 1 if spec in schema.DFLASH_SPECS else self.config.num_draft_tokens
        )

    def drops_anchor(self, s: SpecSession, t: Turn) -> bool:
        """Whether turn ``t`` replaces ``s``'s anchor instead of priming it. A turn that ended at the
        template's stop token leaves that token as the anchor; it is not context: the next turn's own
        first token (``<|user|>`` in the chat template) is the boundary. A turn without tokens has no
        boundary of its own, so the stop token stays: it is primed as the turn's one row and the turn
        generates after it, as after any other ending (the session contract's one anchor is always
        the next row). (A turn's own ``stop_token_ids`` are ordinary text: such an anchor stays context.)"""
        return bool(t.tokens) and s.anchor is not None and s.finish_reason == "stop" and s.anchor in self.stop_ids

    # -- admission --------------------------------------------------------------------------------
    def sort(self, turns: list[Turn]) -> list[tuple[Turn, SpecSession, Rows]]:
        """Sort the waiting turns (first, in arrival order) and ``turns`` into admitted, waiting and refused
        (answered here; a refused ``END`` closes its sequence). Returns each admitted turn with its
        session (a new one is not in the table yet) and its whole prime item. A first turn on a sequence
        id whose turn is running (a client that cancelled and reuses its id: its cancel may not be seen
        yet), or any turn of a sequence whose running turn is cancelled (:meth:`SessionTable.ending`),
        waits for it to end."""
        ok: list[tuple[Turn, SpecSession, Rows]] = []
        seen: set[int] = set()
        now = time.monotonic()
        for t in turns:
            t.arrived = t.arrived or now
        reserve: dict[int, int] = {}
        sessions, running = self.table.sessions, self.table.turns
        with self._admit_lock:  # (refuse_overdue leaves the waiting turns alone meanwhile)
            held, waiting = self._waiting, []
            free = self.config.max_sessions - len(sessions)
            room = self.state_room()
            for deadline, t in held + [(t.arrived + self.config.admission_wait_s, t) for t in turns]:
                if t.sid in running and (t.start or self.table.ending(t.sid)) and now < deadline and t.sid not in seen:
                    waiting.append((deadline, t))  # a new first turn, or its sequence's turn is cancelled: wait for it
                    seen.add(t.sid)
                    continue
                err = self.validate(t)
                twice = t.sid in seen
                if err is None and twice:
                    err = f"{schema.SEQUENCE_ID}: sequence id {t.sid} sent two turns at once; the first one runs"
                need = total = 0
                if err is None:
                    need, total, err = self.state_need(t)
                if err is None:
                    full = t.sid not in sessions and free <= 0  # a new session needs a free slot
                    if full or (room is not None and need > room):
                        if now < deadline:
                            waiting.append((deadline, t))
                            seen.add(t.sid)  # a later turn of the sequence is "two turns at once"
                            continue
                        err = self.no_free_session(t) if full else self._no_room(t, total, room)
                    else:
                        free -= t.sid not in sessions
                        room = None if room is None else room - need
                        reserve[t.sid] = total
                if err is not None:
                    self._refused(t, err, twice)
                    continue
                self._admitted(t, ok)
                seen.add(t.sid)
            self._waiting = waiting
        self._reserved = {sid: b for sid, b in self._reserved.items() if sid in sessions and sid in running}
        self._reserved.update(reserve)
        return ok

    def refuse_overdue(self, now: float | None = None) -> int:
        """Thread-safe: refuse every waiting turn whose ``admission_wait_s`` has passed, without waiting
        for :meth:`sort` (the engine core may be inside a long stage call). Does nothing while :meth:`sort`
        is sorting turns (it applies the same deadlines). Returns how many were refused."""
        if not self._admit_lock.acquire(blocking=False):
            return 0
        sessions = self.table.sessions
        try:
            now = time.monotonic() if now is None else now
            late = [(d, t) for d, t in self._waiting if d <= now and t.sid not in sessions]
            if late:  # (a later turn of an open sequence is left to sort: a refused END closes its session)
                self._waiting = [x for x in self._waiting if x not in late]
        finally:
            self._admit_lock.release()
        for _, t in late:
            full = len(sessions) >= self.config.max_sessions
            t.emit(
                None,
                self.no_free_session(t)
                if full or self.state_size is None
                else self._no_room(t, self.state_need(t)[1], self.state_room() or 0),
                True,
            )
        return len(late)

    def no_free_session(self, t: Turn) -> str:
        """The refusal of a new sequence that found every session slot taken (counted in
        ``stats["sessions_refused_full"]``)."""
        self.stats["sessions_refused_full"] = self.stats.get("sessions_refused_full", 0) + 1
        cfg = self.config
        return (
            f"{schema.SEQUENCE_ID}: no free session for {schema.sequence_name(t.sid)}: "
            f"all {cfg.max_sessions} sessions are open (max_sessions) and none closed within {cfg.admission_wait_s:g} s (admission_wait_s); end finished "
            f"sequences with {schema.SEQUENCE_END}, or retry later {schema.AT_CAPACITY_MARKER}"
        )

    def _refused(self, t: Turn, err: str, twice: bool) -> None:
        """Answer a turn :meth:`sort` refuses; a refused ``END`` still ends its sequence."""
        t.emit(None, err, True)
        if t.end and not twice and t.sid in self.table.sessions:
            self.table.cancel(t.sid, f"sequence {t.sid} ended by a refused final request: {err}")

    def _admitted(self, t: Turn, ok: list) -> None:
        """Make turn ``t``'s session (a new one, or its sequence's) and append its prime to ``ok``."""
        if t.start and t.sid in self.table.sessions:
            self.table.close(t.sid)
        s = self.table.sessions.get(t.sid)
        if s is None:
            spec = self.spec(t)
            s = SpecSession(
                t.sid,
                self.num_draft_tokens(t),
                self.config.max_ctx,
                trunk=self.stages.trunk,
                spec=spec,
                drafter=self.stages.drafters.get(spec),
            )
        elif t.num_draft_tokens is not None:  # a later turn may change the draft count
            s.num_draft_tokens = self.num_draft_tokens(t)
            s.accepted_at += [0] * (s.num_draft_tokens - len(s.accepted_at))
        drop = self.drops_anchor(s, t)
        rows = ([s.anchor] if s.anchor is not None and not drop else []) + list(t.tokens)
        if drop and s.ingest is not None:  # the last committed row is followed by this turn's first token
            s.ingest = (s.ingest[0], s.ingest[1][:-1] + rows[:1])
        item = self.publisher.prime_item(s, rows, t.cache_salt)
        item.commit, s.trunk_commit = s.trunk_commit, 0  # the last turn's final commit rides on this prime
        item.sampling = s.sampling = t.sampling
        s.constraint = None
        if t.grammar is not None:
            s.constraint = self.grammars.constraint(t.grammar, self.config.max_num_draft_tokens + 1)
        item.constraint = s.constraint
        s.stop_ids = self.stop_ids + tuple(x for x in t.stop_token_ids if x not in self.stop_ids)
        s.stop_text = StopText(self.decode, t.stop) if t.stop else None
        ok.append((t, s, item))  # (cut to this burst's piece by the prefill planner)

    # -- admission by bytes -----------------------------------------------------------------------
    def _session_bytes(self, s: SpecSession) -> int:
        """Bytes charged to ``s``: while its turn runs, its state at the turn's largest context (what
        :meth:`sort` reserved); else its state at its context now."""
        if s.sid in self.table.turns and s.sid in self._reserved:
            return self._reserved[s.sid]
        return self.state_size.session(s.spec, len(s.committed) + 1)

    def state_bytes(self) -> int:
        """Estimated bytes of state the open sessions hold at their contexts now (0 without ``state_size``)."""
        if self.state_size is None:
            return 0
        return sum(self.state_size.session(s.spec, len(s.committed) + 1) for s in list(self.table.sessions.values()))

    def _state_budget(self) -> int:
        """Bytes the sessions may hold: ``max_state_mb`` less the prefix cache's bound ``prefix_cache_mb``."""
        return max(0, self.config.max_state_mb - self.config.prefix_cache_mb) << 20

    def state_room(self) -> int | None:
        """Bytes of session state that may still be admitted (None: no limit: ``max_state_mb`` 0 or no estimate)."""
        if self.state_size is None or not self.config.max_state_mb:
            return None
        return self._state_budget() - sum(self._session_bytes(s) for s in list(self.table.sessions.values()))

    def state_need(self, t: Turn) -> tuple[int, int, str | None]:
        """``(need, total, error)`` of a valid turn: ``total`` the bytes its session's state reaches at the
        turn's largest context (context + prompt + ``MAX_TOKENS``, at most ``max_ctx``), ``need`` what that
        adds to the bytes charged now, and the refusal when the turn could not fit even alone. (0, 0,
        None) without a limit."""
        if self.state_room() is None:
            return 0, 0, None
        s, cfg = self.table.sessions.get(t.sid), self.config
        base = 0 if t.start or s is None else len(s.committed) + 1
        end = min(cfg.max_ctx, base + len(t.tokens) + t.max_tokens)
        total = self.state_size.session(self.spec(t), end, unread=len(t.tokens) + 1)
        if total > self._state_budget():
            budget = self._state_budget() / 2**20
            return (
                0,
                total,
                (
                    f"{schema.MAX_TOKENS}: a turn reaching {end} tokens of context needs about "
                    f"{total / 2**20:.1f} MB of session state, more than the {budget:.0f} MB "
                    f"sessions may hold (max_state_mb {cfg.max_state_mb} less prefix_cache_mb "
                    f"{cfg.prefix_cache_mb}); ask for fewer tokens"
                ),
            )
        return total - (self._session_bytes(s) if s is not None else 0), total, None

    def _no_room(self, t: Turn, total: int, room: int) -> str:
        """The refusal of a turn whose state did not fit within ``admission_wait_s`` (counted as at capacity)."""
        self.stats["sessions_refused_memory"] = self.stats.get("sessions_refused_memory", 0) + 1
        cfg = self.config
        return (
            f"{schema.SEQUENCE_ID}: no room for {schema.sequence_name(t.sid)}: its turn needs about "
            f"{total / 2**20:.1f} MB of session state and {max(room, 0) / 2**20:.1f} MB of "
            f"{self._state_budget() / 2**20:.0f} MB are free (max_state_mb {cfg.max_state_mb} less prefix_cache_mb "
            f"{cfg.prefix_cache_mb}, {len(self.table.sessions)} sessions open), and not enough was freed within "
            f"{cfg.admission_wait_s:g} s (admission_wait_s); end finished sequences with {schema.SEQUENCE_END}, "
            f"ask for fewer tokens, or retry later {schema.AT_CAPACITY_MARKER}"
        )
