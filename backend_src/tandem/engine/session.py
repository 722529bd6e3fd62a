"""`SpecSession`: the state of one request stream's speculative decoding (README, "The session contract").

At every burst boundary: ``pos() == len(committed)`` rows are in the trunk cache; every committed
row's trunk state equals a fresh prime of ``committed`` (checked by :mod:`tandem.engine.gate`);
exactly one emitted-but-uncommitted anchor exists (row 0 of the next verify).

The session holds state only: the engine core (:class:`~tandem.engine.scheduler.Scheduler` and the
classes it wires) opens and closes its stage state (batched over sessions) and applies each round's
results; :func:`finish` ends a turn.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable

from .. import schema
from .draft_length import DraftState

if TYPE_CHECKING:
    from .sampling import SamplingParams


@dataclasses.dataclass
class Receipt:
    """What one burst produced for one session: ``tokens`` emitted, and the deltas of verify
    ``rounds``, ``drafted`` and ``accepted`` tokens; ``accepted_at[i]`` counts rounds whose draft
    ``i`` was accepted (``spec_rounds``: the rounds that carried drafts); ``finish_reason`` is None while the turn continues, else ``"stop"`` (a stop
    token), ``"length"`` (MAX_TOKENS), ``"context"`` (context capacity) or ``"cancelled"`` (by its client:
    the turn's last receipt, no tokens); ``top2_gaps`` the
    trunk's top-1 minus top-2 logit at each emitted token (near-tie analysis)."""

    tokens: list[int]
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    spec_rounds: int = 0
    top2_gaps: list[float] = dataclasses.field(default_factory=list)
    #: the stop string that ended the turn ("" otherwise; :mod:`tandem.engine.stops`)
    stop_string: str = ""

    def merge(self, later: "Receipt") -> None:
        """Add a later receipt of the same turn to this one (one response for several bursts)."""
        self.tokens += later.tokens
        self.top2_gaps += later.top2_gaps
        for f in ("rounds", "drafted", "accepted", "spec_rounds"):
            setattr(self, f, getattr(self, f) + getattr(later, f))
        n = max(len(self.accepted_at), len(later.accepted_at))
        self.accepted_at = [sum(a[i] for a in (self.accepted_at, later.accepted_at) if i < len(a)) for i in range(n)]
        self.finish_reason, self.stop_string = later.finish_reason, later.stop_string


@dataclasses.dataclass(eq=False)
class SpecSession:
    """One sequence: committed tokens, the anchor, counters and the current turn.

    ``spec`` is the speculation method (:data:`tandem.schema.SPECS`); ``num_draft_tokens`` is 0 for
    plain decoding; ``trunk`` is the trunk stage (or its proxy), read only by :meth:`cache_ref`;
    ``drafter`` the session's drafter stage (or proxy), read only by :meth:`export_draft_tail`;
    ``ingest`` holds the committed rows the drafter has not seen yet (their trunk pass
    :class:`~tandem.engine.protocols.VerifyOut`, or a list of them queued while it rests, and next tokens ``[n]``;
    :meth:`drafter_input` joins them); ``drafter_rows`` counts the
    committed rows the drafter has ingested; ``prefix_capture`` is the prompt-boundary
    :class:`~tandem.engine.prefix.PrefixCapture` (None when the prefix cache is off, the spec is MTP, or
    the prompt has no whole reusable block); ``warm_rows`` the prompt rows taken from the prefix cache;
    ``trunk_commit`` the rows of the last verify the trunk still has to keep (the commit rides on the
    session's next prime / verify call, or :meth:`~tandem.engine.scheduler.Scheduler.settle`).
    """

    sid: int
    num_draft_tokens: int
    max_ctx: int
    trunk: Any = None
    spec: str = "mtp"
    committed: list[int] = dataclasses.field(default_factory=list)
    anchor: int | None = None
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = dataclasses.field(default_factory=list)
    turn_remaining: int = 0
    turn_done: bool = True
    finish_reason: str | None = None
    last_active: float = dataclasses.field(default_factory=time.monotonic)
    ingest: tuple[Any, list[int]] | None = None
    prefix_capture: Any = None
    drafter: Any = None
    drafter_rows: int = 0
    warm_rows: int = 0
    trunk_commit: int = 0
    #: the current turn's :class:`~tandem.engine.sampling.SamplingParams` (None: greedy)
    sampling: Any = None
    #: the :mod:`~tandem.engine.draft_length` policy's state of this session (its acceptance, its rest)
    drafting: DraftState = dataclasses.field(default_factory=DraftState)
    #: its drafter failed: it decodes plain for the rest of its life (:mod:`tandem.engine.stage_set`)
    degraded: bool = False
    #: tokens that end the current turn: the scheduler's and the turn's own ``stop_token_ids``
    stop_ids: tuple[int, ...] = ()
    #: the current turn's :class:`~tandem.engine.stops.StopText` (None: it has no stop strings)
    stop_text: Any = None
    #: the turn's prime while it runs in chunks (:class:`~tandem.engine.prefill.PendingPrefill`), else None
    prefill: object = None
    #: the current turn's structured-output :class:`~tandem.engine.structured.Constraint` (None: unconstrained)
    constraint: Any = None

    def __post_init__(self) -> None:
        if not self.accepted_at:
            self.accepted_at = [0] * max(self.num_draft_tokens, 1)

    # -- the session contract -----------------------------------------------------------------------
    def cache_max_ctx(self) -> int:
        """Context capacity in tokens (the server's context guard)."""
        return self.max_ctx

    def pos(self) -> int:
        """Trunk rows committed (``len(committed)``; the trunk cache holds them once ``trunk_commit`` is applied)."""
        return len(self.committed)

    def finished(self) -> bool:
        """True once the current turn committed a stop token or the context guard tripped."""
        return self.finish_reason in ("stop", "context")

    def take_prefix_capture(self):
        """Drain the prompt-boundary capture (a :class:`~tandem.engine.prefix.PrefixCapture`, or None:
        the MTP spec keeps none, nor does a prompt shorter than one block + 1 or a server without a
        prefix cache). The scheduler publishes it once :meth:`prefix_capture_ready`."""
        cap, self.prefix_capture = self.prefix_capture, None
        return cap

    def prefix_capture_ready(self) -> bool:
        """A capture exists AND the drafter KV covers its boundary: at once for plain decoding (no
        drafter), after round 1 on the DFlash specs (the prompt's features are ingested then)."""
        cap = self.prefix_capture
        return cap is not None and (self.spec == schema.OFF or self.drafter_rows >= cap.boundary)

    def export_draft_tail(self, upto: int):
        """The DFlash drafter's context K/V of rows ``[0, upto)`` (per layer ``(k, v) [1, H, upto, d]``),
        from an in-process drafter stage. None on the native MTP spec (its KV is not a block
        drafter's window), for plain decoding, behind BLS (the drafter lives in its own process: the
        scheduler publishes through its ``publish`` op) and when the drafter covers fewer than ``upto`` rows."""
        if self.spec not in schema.DFLASH_SPECS or not hasattr(self.drafter, "export_tail"):
            return None
        return self.drafter.export_tail(self.sid, upto)

    def cache_ref(self):
        """Read-only view of the trunk cache (in-process trunk stage); None behind BLS, where the
        cache lives in the ``trunk`` process."""
        caches = getattr(self.trunk, "caches", None)
        return None if caches is None else caches.get(self.sid)

    def queue_for_drafter(self, rows: Any, emitted: list[int]) -> None:
        """Put committed ``rows`` (their trunk pass, a :class:`~tandem.engine.protocols.VerifyOut` of one row
        an emitted token) and their next tokens ``emitted`` after those :attr:`ingest` holds already."""
        if self.ingest is None:
            self.ingest = ([rows], list(emitted))
            return
        parts, queued = self.ingest
        if not isinstance(parts, list):  # rows a round left: the queue starts with them
            parts, queued = [parts], list(queued)
        parts.append(rows)  # joined once, when the drafter takes them (drafter_input): no copy a call
        queued.extend(emitted)
        self.ingest = (parts, queued)

    def drafter_input(self) -> tuple[Any, list[int]]:
        """:attr:`ingest` with its queued rows joined into one
        :class:`~tandem.engine.protocols.VerifyOut` (``[n]`` rows and the ``n`` tokens after them)."""
        rows, emitted = self.ingest
        if isinstance(rows, list):
            self.ingest = (rows[0].join(rows), emitted)
        return self.ingest

    @property
    def drafts_later(self) -> bool:
        """Whether the rows of a round without drafts wait for this session's drafter: a resting session's, until
        it drafts again; a session that does not draft (spec ``off``, degraded) keeps its newest round's only."""
        return self.spec != schema.OFF and not self.degraded and self.ingest is not None

    def demote_eligible(self) -> bool:
        """Whether another draft length (plain decoding included) would give this session the same stream, so
        the draft-length policy may choose it: greedy and ``coupled`` sessions (every token a function of the
        trunk distribution and the session's noise at its position) yes; ``rejection`` sampling no (its stream
        depends on which draws the walk made)."""
        p = self.sampling
        return p is None or p.greedy or p.mode == schema.COUPLED

    def plain_greedy(self) -> bool:
        """Whether the current turn's tokens are the trunk's greedy targets as they come (greedy, no stop strings, no
        structured output): what the rounds compiled together (plain or speculative) decode."""
        return self.sampling is None and self.stop_text is None and self.constraint is None

    def mean_acceptance_length(self) -> float | None:
        """tau = 1 + accepted / rounds (bonus included); None before any verify round."""
        return 1.0 + self.accepted / self.rounds if self.rounds else None

    # -- rounds -----------------------------------------------------------------------------------
    def draft_budget(self) -> int:
        """Drafts to propose this round: ``num_draft_tokens`` capped so that even when every draft is
        accepted, the committed rows plus the new anchor stay within ``max_ctx`` tokens."""
        return max(0, min(self.num_draft_tokens, self.max_ctx - len(self.committed) - 2))


def finish(s: SpecSession, r: Receipt, reason: str | None) -> None:
    """End ``s``'s turn with ``reason`` (None: it goes on, unless its next anchor would leave no context
    room: then ``"context"``), recording the reason and any matched stop string in its receipt ``r``."""
    if reason is None and len(s.committed) + 1 >= s.max_ctx:
        reason = "context"
    if reason is not None:
        r.finish_reason = s.finish_reason = reason
        s.turn_done = True
        r.stop_string = (s.stop_text.matched or "") if s.stop_text is not None else ""


#: ``emit(receipt, error, final)``: one streamed response (``receipt`` None when ``error`` is set).
Emit = Callable[[Receipt | None, str | None, bool], None]


@dataclasses.dataclass
class Turn:
    """One request in a sequence: append ``tokens`` and generate up to ``max_tokens``.

    ``spec``: one of :data:`tandem.schema.SPECS` (None: the session's spec, or the server default for
    a new session); ``start``/``end``: Triton sequence flags;
    ``num_draft_tokens``: None for the server default; ``sampling``: the turn's
    :class:`~tandem.engine.sampling.SamplingParams` (None: greedy); ``stop_token_ids``: tokens that
    end this turn besides the scheduler's ``stop_ids``; ``emit`` is called once per burst
    and once with ``final=True``.
    """

    sid: int
    tokens: list[int]
    max_tokens: int
    emit: Emit
    spec: str | None = None
    start: bool = True
    end: bool = True
    num_draft_tokens: int | None = None
    sampling: SamplingParams | None = None
    stop_token_ids: tuple[int, ...] = ()
    #: stop strings (:mod:`tandem.engine.stops`; need the scheduler's ``decode``); ``stream``: False sends
    #: the turn as one response (the front merges its bursts)
    stop: tuple[str, ...] = ()
    stream: bool = True
    #: the prefix-cache namespace (:mod:`tandem.engine.prefix`): only prompts primed with the same salt share
    #: cached blocks ("": the shared default); a later turn's salt is not used (its sequence is primed)
    cache_salt: str = ""
    #: structured output: the ``RESPONSE_FORMAT`` text (:class:`~tandem.engine.structured.ResponseFormat`; "":
    #: none), and once validated its compiled grammar (set by :meth:`Admission.validate`, or earlier by the
    #: front, which compiles on the request's thread)
    response_format: str = ""
    grammar: Any = None
    #: the turn's number (the front numbers turns 1, 2, ... and a ``CANCEL`` may name one; 0: unnumbered)
    number: int = 0
    #: ``cancelled(sync)``: whether the turn's client has cancelled it (None: it cannot). ``sync`` True may
    #: ask the client's connection now (a round trip); False answers from what is known and may start a
    #: look whose answer a later call returns. The scheduler asks at burst boundaries, between prefill
    #: chunks, after the prime and before a turn's final response, and ends a cancelled turn there.
    cancelled: Callable[[bool], bool] | None = None
    #: ``time.monotonic()`` when the turn reached the server (0: when the scheduler first sees it); the
    #: admission clock (``admission_wait_s``) runs from here, also while the turn waits in a queue
    arrived: float = 0.0
