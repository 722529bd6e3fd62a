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
from ..model.device import invariant_prime
from ..schema import ServingConfig
from .accept import Walk, accept_walk
from .demotion import Demotion
from .lifecycle import Lifecycle
from .prefill import Prefill
from .prefix import PrefixIndex, publish_ready, reusable_blocks
from .plain_rounds import PlainRounds
from .protocols import Commit, DrafterAPI, DraftRequest, Rows, TrunkAPI, VerifyOut
from .session import Receipt, SpecSession, Turn  # noqa: F401 - Turn: re-exported (the scheduler's API)
from .state_size import StateSize
from .stops import StopText, validate_stops


class Scheduler(Lifecycle, Prefill, PlainRounds):
    """Sessions by sequence id, and the round / burst loop over them.

    Args: ``trunk`` — a :class:`~tandem.engine.protocols.TrunkAPI`; ``drafters`` — arm ->
    :class:`~tandem.engine.protocols.DrafterAPI` (arms not listed are refused; one stage may serve
    several arms, and gets one call per round for all of them); ``config`` — defaults and limits;
    ``stop_ids`` — tokens that end a turn; ``decode`` — ``list[int] -> str`` for stop strings (None: refused);
    ``state_size`` — the session state estimate admission by bytes uses (``max_state_mb``; None: none).
    ``request_cancel`` may be called from any thread; everything else from one thread.
    """

    def __init__(
        self,
        trunk: TrunkAPI,
        drafters: dict[str, DrafterAPI] | None = None,
        config: ServingConfig = schema.DEFAULTS,
        stop_ids: tuple[int, ...] = (),
        decode: Callable[[list[int]], str] | None = None,
        state_size: StateSize | None = None,
    ) -> None:
        self.trunk, self.drafters = trunk, dict(drafters or {})
        #: estimates each session's state in bytes (None: admission by count alone, ``state_bytes`` 0)
        self.state_size = state_size
        #: sid -> bytes charged to a session while its turn runs (its state at the turn's largest context)
        self._reserved: dict[int, int] = {}
        #: held while :meth:`admit` sorts turns into admitted / waiting / refused (:meth:`refuse_overdue`)
        self._admit_lock = threading.Lock()
        self.config, self.decode = config, decode
        #: a prime's rows do not depend on its pieces, so chunked prefill cuts prompts anywhere (prefill.py)
        self.invariant_prime = invariant_prime(config)
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
        self.stats = {
            "sessions_opened": 0,
            "sessions_expired": 0,
            "cancelled": 0,
            "rounds": 0,
            "drafted": 0,
            "accepted": 0,
            "accept_walks": 0,
        }
        #: the prefix cache's index (None when ``config.prefix_cache_mb`` is 0)
        self.prefix = PrefixIndex(config.prefix_cache_mb << 20) if config.prefix_cache_mb > 0 else None
        #: wall seconds per stage of :meth:`round` (summed; a batched round counts once)
        self.timing = {"draft_s": 0.0, "verify_s": 0.0, "accept_s": 0.0, "rounds": 0}
        #: moves sessions to plain decoding and back (counts ``demotions`` / ``promotions`` in stats)
        self.demotion = Demotion(config, self.stats)
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
            return f"{schema.SPEC} {arm!r} needs the {model} model with a {arm} drafter, which is not loaded" + (
                " (the checkpoint has none: `make drafter` trains it)" if arm in schema.DFLASH_ARMS else ""
            )
        if s is not None and not t.start and t.spec is not None and t.spec != s.arm:
            return f"{schema.SPEC}: sequence {t.sid} runs {s.arm!r}; a later turn cannot switch to {t.spec!r}"
        if t.num_draft_tokens is not None and arm == schema.OFF:  # never silently ignored
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
                    hi=cfg.block_size - 1 if arm in schema.DFLASH_ARMS else cfg.max_num_draft_tokens,
                )
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
            return (
                f"{schema.SEQUENCE_ID}: unknown sequence id {t.sid}: this server holds no such session (set "
                f"{schema.SEQUENCE_START} on the first turn; behind a proxy, send the {schema.ROUTING_HEADER} "
                f"header, the sequence id, with every turn so it reaches the server holding the session) "
                f"{schema.SESSION_LOST_MARKER}"
            )
        if t.sid in self.turns:
            return f"{schema.SEQUENCE_ID}: sequence id {t.sid} already has a turn in progress"
        base = 0 if t.start or s is None else len(s.committed) + (s.anchor is not None and not self._drops_anchor(s, t))
        if base + len(t.tokens) >= cfg.max_ctx:
            return (
                f"{schema.INPUT_IDS}: {base} context + {len(t.tokens)} new tokens leaves no room to generate "
                f"within the context capacity of {cfg.max_ctx} tokens (at most {cfg.max_ctx - 1 - base} new tokens)"
            )
        if base == 0 and not t.tokens:
            return f"{schema.INPUT_IDS}: the first turn of a sequence needs at least 1 token"
        return None

    def _ending(self, sid: int) -> bool:
        """Whether ``sid`` has a turn running that is cancelled (by a ``CANCEL`` or its client) and ends at
        the next burst boundary: a new turn of the sequence (a client that cancelled and goes on, or
        reuses its id) waits for it instead of being refused as a second turn at once."""
        running = self.turns.get(sid)
        if running is None:
            return False
        with self._cancel_lock:
            if sid in self._to_cancel:
                return True
        try:
            return running.cancelled is not None and bool(running.cancelled(False))
        except Exception:  # noqa: BLE001 - a broken client counts as not cancelled here; the burst checks again
            return False

    def admit(self, turns: list[Turn]) -> None:
        """Validate, open the new sessions' stage state (one call per stage), prime every admitted
        turn in one trunk call, and emit each turn's first token. A new sequence finding all
        ``max_sessions`` open, or a turn whose state would not fit in ``max_state_mb``
        (:meth:`state_need`), waits (retried by each later call, in arrival order) until
        ``admission_wait_s`` after it arrived (``Turn.arrived``), then is refused; :meth:`refuse_overdue`
        refuses it from another thread when this one is busy in a stage call then. A first turn on a sequence id
        whose turn is running (a client that cancelled and reuses its id: its cancel may not be seen yet), or
        any turn of a sequence whose running turn is cancelled (:meth:`_ending`), waits likewise for it to end."""
        ok: list[tuple[Turn, SpecSession, list[int]]] = []
        seen: set[int] = set()
        now = time.monotonic()
        for t in turns:
            t.arrived = t.arrived or now
        reserve: dict[int, int] = {}
        with self._admit_lock:  # (refuse_overdue leaves the waiting turns alone meanwhile)
            held, waiting = self._waiting, []
            free = self.config.max_sessions - len(self.sessions)
            room = self.state_room()
            for deadline, t in held + [(t.arrived + self.config.admission_wait_s, t) for t in turns]:
                if t.sid in self.turns and (t.start or self._ending(t.sid)) and now < deadline and t.sid not in seen:
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
                    full = t.sid not in self.sessions and free <= 0  # a new session needs a free slot
                    if full or (room is not None and need > room):
                        if now < deadline:
                            waiting.append((deadline, t))
                            seen.add(t.sid)  # a later turn of the sequence is "two turns at once"
                            continue
                        err = self._no_free_session(t) if full else self._no_room(t, total, room)
                    else:
                        free -= t.sid not in self.sessions
                        room = None if room is None else room - need
                        reserve[t.sid] = total
                if err is not None:
                    self._refused(t, err, twice)
                    continue
                self._admitted(t, ok)
                seen.add(t.sid)
            self._waiting = waiting
        self._reserved = {sid: b for sid, b in self._reserved.items() if sid in self.sessions and sid in self.turns}
        self._reserved.update(reserve)
        self._flush_closes()
        if not ok:
            return
        ok = self._chunked(ok)  # each prime item cut to the piece the prefill budget gives it now
        new = [s for _, s, _ in ok if s.sid not in self.sessions]
        for s in new:
            self.sessions[s.sid] = s
        self.stats["sessions_opened"] += len(new)
        self.admitting = [t for t, _, _ in ok]  # a watchdog may answer them while a call hangs
        try:
            if new:
                self.trunk.open([s.sid for s in new])
                warm = {s.sid: (s.arm, r.prefix) for _, s, r in ok if r.prefix and s.arm in schema.DFLASH_ARMS}
                self._open_drafters(new, warm)
            outs = self.trunk.prime([rows for _, _, rows in ok])
        except Exception as e:  # noqa: BLE001 - the turns being admitted fail; running sessions go on
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
        self._drop_captures()
        self._flush_closes()

    def _drop_captures(self) -> None:
        """Publish or drop the prompt-boundary captures of open sessions whose turn has ended, so an idle
        session holds its cache and nothing more: a ready capture is published (a turn that ended at its
        first token on the plain arm), the others (a DFlash turn that ended at its first token: its drafter
        had not read the prompt) are dropped with one trunk ``publish`` of no blocks, which drops the
        trunk's capture (KDA states at each block end)."""
        idle = [s for sid, s in self.sessions.items() if s.prefix_capture is not None and sid not in self.turns]
        if not idle or not self._usable(self.trunk):
            return
        self._publish_prefixes(idle)
        stale = [s for s in idle if s.prefix_capture is not None]
        if not stale:
            return
        for s in stale:
            s.prefix_capture = None
        try:
            self.trunk.publish([(s.sid, []) for s in stale])
        except Exception as e:  # noqa: BLE001 - the capture goes with the session's close instead
            self.on_event(f"dropping prompt captures failed: {type(e).__name__}: {e}")

    # -- admission by bytes -----------------------------------------------------------------------
    def _session_bytes(self, s: SpecSession) -> int:
        """Bytes charged to ``s``: while its turn runs, its state at the turn's largest context (what
        :meth:`admit` reserved); else its state at its context now."""
        if s.sid in self.turns and s.sid in self._reserved:
            return self._reserved[s.sid]
        return self.state_size.session(s.arm, len(s.committed) + 1)

    def state_bytes(self) -> int:
        """Estimated bytes of state the open sessions hold at their contexts now (0 without ``state_size``)."""
        if self.state_size is None:
            return 0
        return sum(self.state_size.session(s.arm, len(s.committed) + 1) for s in list(self.sessions.values()))

    def _state_budget(self) -> int:
        """Bytes the sessions may hold: ``max_state_mb`` less the prefix cache's bound ``prefix_cache_mb``."""
        return max(0, self.config.max_state_mb - self.config.prefix_cache_mb) << 20

    def state_room(self) -> int | None:
        """Bytes of session state that may still be admitted (None: no limit: ``max_state_mb`` 0 or no estimate)."""
        if self.state_size is None or not self.config.max_state_mb:
            return None
        return self._state_budget() - sum(self._session_bytes(s) for s in list(self.sessions.values()))

    def state_need(self, t: Turn) -> tuple[int, int, str | None]:
        """``(need, total, error)`` of a valid turn: ``total`` the bytes its session's state reaches at the
        turn's largest context (context + prompt + ``MAX_TOKENS``, at most ``max_ctx``), ``need`` what that
        adds to the bytes charged now, and the refusal when the turn could not fit even alone. (0, 0,
        None) without a limit."""
        if self.state_room() is None:
            return 0, 0, None
        s, cfg = self.sessions.get(t.sid), self.config
        base = 0 if t.start or s is None else len(s.committed) + 1
        end = min(cfg.max_ctx, base + len(t.tokens) + t.max_tokens)
        total = self.state_size.session(self._arm(t), end, unread=len(t.tokens) + 1)
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
            f"{cfg.prefix_cache_mb}, {len(self.sessions)} sessions open), and not enough was freed within "
            f"{cfg.admission_wait_s:g} s (admission_wait_s); end finished sequences with {schema.SEQUENCE_END}, "
            f"ask for fewer tokens, or retry later {schema.AT_CAPACITY_MARKER}"
        )

    def refuse_overdue(self, now: float | None = None) -> int:
        """Thread-safe: refuse every waiting turn whose ``admission_wait_s`` has passed, without waiting
        for :meth:`admit` (the worker may be inside a long stage call). Does nothing while :meth:`admit`
        is sorting turns (it applies the same deadlines). Returns how many were refused."""
        if not self._admit_lock.acquire(blocking=False):
            return 0
        try:
            now = time.monotonic() if now is None else now
            late = [(d, t) for d, t in self._waiting if d <= now and t.sid not in self.sessions]
            if late:  # (a later turn of an open sequence is left to admit: a refused END closes its session)
                self._waiting = [x for x in self._waiting if x not in late]
        finally:
            self._admit_lock.release()
        for _, t in late:
            full = len(self.sessions) >= self.config.max_sessions
            t.emit(
                None,
                self._no_free_session(t)
                if full or self.state_size is None
                else self._no_room(t, self.state_need(t)[1], self.state_room() or 0),
                True,
            )
        return len(late)

    def _refused(self, t: Turn, err: str, twice: bool) -> None:
        """Answer a turn :meth:`admit` refuses; a refused ``END`` still ends its sequence."""
        t.emit(None, err, True)
        if t.end and not twice and t.sid in self.sessions:
            self.cancel(t.sid, f"sequence {t.sid} ended by a refused final request: {err}")

    def _admitted(self, t: Turn, ok: list) -> None:
        """Make turn ``t``'s session (a new one, or its sequence's) and append its prime to ``ok``."""
        if t.start and t.sid in self.sessions:
            self.close(t.sid)
        s = self.sessions.get(t.sid)
        if s is None:
            arm = self._arm(t)
            s = SpecSession(
                t.sid,
                self._num_draft_tokens(t),
                self.config.max_ctx,
                trunk=self.trunk,
                arm=arm,
                drafter=self.drafters.get(arm),
            )
        elif t.num_draft_tokens is not None:  # a later turn may change the draft count
            s.num_draft_tokens = self._num_draft_tokens(t)
            s.accepted_at += [0] * (s.num_draft_tokens - len(s.accepted_at))
        drop = self._drops_anchor(s, t)
        rows = ([s.anchor] if s.anchor is not None and not drop else []) + list(t.tokens)
        if drop and s.ingest is not None:  # the last committed row is followed by this turn's first token
            s.ingest = (s.ingest[0], s.ingest[1][:-1] + rows[:1])
        item = self._prefix_rows(s, rows, t.cache_salt)
        item.commit, s.trunk_commit = s.trunk_commit, 0  # the last turn's final commit rides on this prime
        item.sampling = s.sampling = t.sampling
        s.stop_ids = self.stop_ids + tuple(x for x in t.stop_token_ids if x not in self.stop_ids)
        s.stop_text = StopText(self.decode, t.stop) if t.stop else None
        ok.append((t, s, item))  # (cut to this burst's piece by _chunked)

    def _drops_anchor(self, s: SpecSession, t: Turn) -> bool:
        """Whether turn ``t`` replaces ``s``'s anchor instead of priming it. A turn that ended at the
        template's stop token leaves that token as the anchor; it is not context: the next turn's own
        first token (``<|user|>`` in the chat template) is the boundary. A turn without tokens has no
        boundary of its own, so the stop token stays: it is primed as the turn's one row and the turn
        generates after it, as after any other ending (the session contract's one anchor is always
        the next row). (A turn's own ``stop_token_ids`` are ordinary text: such an anchor stays context.)"""
        return bool(t.tokens) and s.anchor is not None and s.finish_reason == "stop" and s.anchor in self.stop_ids

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
        return Rows(s.sid, rows[s.warm_rows :], cap.keys[:hit])

    def _after_prime(self, s: SpecSession, item: Rows, out: VerifyOut, max_tokens: int) -> Receipt | None:
        """A turn's prime is complete (``out``: its rows' outputs): commit its rows and return the receipt
        of its first token. A turn its client cancelled meanwhile ends here instead (None: nothing to
        send, nothing published); one that ends at its first token publishes its prompt's blocks now
        (it reaches no burst)."""
        t = self.turns[s.sid]
        if self._cancelled_by_client([t], sync=True):
            self._end_cancelled(t)
            return None
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
        if r.finish_reason is not None:
            self._publish_prefixes([s])
        return r

    def _publish_prefixes(self, sessions: list[SpecSession]) -> None:
        """Publish the prefix captures of ``sessions`` that are ready (:func:`publish_ready`); a failure
        loses only the cache entries (counted in ``prefix.stats["errors"]``)."""
        if self.prefix is None or not sessions:
            return
        try:
            publish_ready(self.prefix, sessions, self.trunk, self.drafters)
        except Exception as e:  # noqa: BLE001 - a prefix the stores could not take is only a lost cache entry
            self.prefix.stats["last_error"] = f"{type(e).__name__}: {e}"  # counted in stats["errors"]

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
        return t.num_draft_tokens or (
            self.config.block_size - 1 if arm in schema.DFLASH_ARMS else self.config.num_draft_tokens
        )

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
        first commits each session's previous round (the walk's rows kept, see :meth:`settle`)."""
        act = self.active()
        if not act:
            return
        clock = time.perf_counter
        t0 = clock()
        drafts: dict[int, list[int]] = {s.sid: [] for s in act}
        spec = [s for s in act if self.demotion.speculates(s)]  # demoted sessions decode plain rows
        for stage, group in self._by_drafter(spec):
            reqs = [
                DraftRequest(s.sid, s.ingest[0].hidden, s.ingest[1], s.draft_budget(), s.ingest[0].features, s.arm)
                for s in group
            ]
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
        prime / verify carries the commit); tests and in-process inspection do."""
        pend = [s for s in self.sessions.values() if s.trunk_commit]
        if pend:
            self.trunk.commit([Commit(s.sid, s.trunk_commit) for s in pend])
            for s in pend:
                s.trunk_commit = 0

    def _after_verify(self, s: SpecSession, drafts: list[int], out: VerifyOut, r: Receipt, load: int | None) -> int:
        """Apply the accept walk to the session and the burst's receipt (and, after a speculative
        round with ``load`` active sessions, to the demotion policy); returns rows to commit."""
        w = accept_walk(drafts, out.argmax.tolist(), s.stop_ids, s.turn_remaining)
        self.stats["accept_walks"] += 1
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
        """Close the turns cancelled since the last burst (asking each turn's client, see
        :attr:`Turn.cancelled`; a turn being primed in chunks is asked before each chunk), run up to
        ``burst_rounds`` rounds (ending at the first round boundary after ``burst_ms`` of rounds), then
        publish each session's receipt (a burst boundary). A turn that finished in the burst is asked
        once more before its final response: cancelled, it ends as cancelled and publishes nothing."""
        turns = list(self.turns.values())
        for sync in (False, True):  # a turn in chunked prefill has sent nothing yet: asked now
            for t in self._cancelled_by_client(
                [t for t in turns if (self.sessions[t.sid].prefill is not None) == sync], sync
            ):
                self.request_cancel(t.sid, t)
        self._apply_cancels()
        self._prefill_step()
        receipts: dict[int, Receipt] = {}
        deadline = time.perf_counter() + self.config.burst_ms / 1e3 if self.config.burst_ms > 0 else None
        self._rounds_burst(receipts, deadline)
        ending = [t for sid, r in receipts.items() if r.finish_reason and (t := self.turns.get(sid)) is not None]
        for t in self._cancelled_by_client(ending, True):
            del receipts[t.sid]
            self._end_cancelled(t)
        self._publish_prefixes([self.sessions[sid] for sid in receipts])
        for sid, r in receipts.items():
            self._publish(self.sessions[sid], r)
        self._drop_captures()
        self._flush_closes()

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
