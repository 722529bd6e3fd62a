"""Requests in, responses out, for the ``tandem`` model: a request's tensors, correlation id and flags
decoded into a :class:`TurnRequest` (:func:`parse_turn`), and a burst's receipt with the turn's
:class:`Usage` packed into one streamed response (:func:`receipt_outputs`). numpy only."""

from __future__ import annotations

import dataclasses
import secrets

import numpy as np

from .. import schema
from ..engine.sampling import SamplingParams
from ..engine.scheduler import Turn
from ..schema import Arrays, WireError


# -- requests in, receipts out ------------------------------------------------------------------------
def TurnRequest(sid: int, tokens: list[int], max_tokens: int, spec: str | None = None, **fields) -> Turn:
    """A decoded ``tandem`` request: a :class:`~tandem.engine.scheduler.Turn` (same fields) whose
    ``emit`` is still None; :meth:`tandem.serving.engine_core.EngineCore.submit` sets it."""
    return Turn(sid, tokens, max_tokens, None, spec=spec, **fields)


def parse_sampling(arrays: Arrays) -> SamplingParams | None:
    """The turn's sampling inputs (None when it sends none: greedy). Raises
    :class:`~tandem.schema.WireError` naming a field of the wrong shape or out of range."""
    specs = {t.name: t for t in schema.SAMPLING_INPUTS}
    if not any(n in arrays for n in specs):
        return None
    kw = {n: schema.get_scalar(arrays, t) for n, t in specs.items() if n != schema.SAMPLING}
    mode = schema.get_string(arrays, specs[schema.SAMPLING]).strip().lower()
    return SamplingParams.create(kw[schema.TEMPERATURE], kw[schema.TOP_K], kw[schema.TOP_P], kw[schema.SEED], mode)


def parse_cache_salt(arrays: Arrays) -> str:
    """The turn's ``CACHE_SALT`` ("" when absent: the shared prefix-cache namespace). Raises
    :class:`~tandem.schema.WireError` naming the field for more than one string, one over
    :data:`tandem.schema.MAX_CACHE_SALT_BYTES` bytes (checked before decoding) or one that is not UTF-8."""
    t = schema.TANDEM.input(schema.CACHE_SALT)
    if t.name not in arrays:
        return ""
    a = np.asarray(arrays[t.name], dtype=object).reshape(-1)
    schema.check_size(a, t, max_items=1)
    v = a[0] if a.size else b""
    try:
        return v.decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else str(v)
    except UnicodeDecodeError as e:
        raise WireError(f"{t.name} must be UTF-8 text: {e}") from None


def one_turn_id() -> int:
    """A new one-turn session's id (a request without a sequence id): :data:`tandem.schema.ONE_TURN_SEQUENCE_IDS`
    plus 63 random bits. The id is what a ``CANCEL`` names, so it must not be guessable from another turn's
    (only the turn's own responses carry it, as ``SESSION_ID``)."""
    return schema.ONE_TURN_SEQUENCE_IDS | secrets.randbits(63)


def parse_turn(arrays: Arrays, correlation_id, flags: int, max_ctx: int = schema.DEFAULTS.max_ctx) -> Turn:
    """Decode a ``tandem`` request: its tensors (absent optional inputs left out of ``arrays``), its
    correlation id (tritonclient's ``sequence_id``: an unsigned integer below
    :data:`tandem.schema.ONE_TURN_SEQUENCE_IDS`; 0, as Triton's HTTP generate endpoint and a client
    that sets none send: a one-turn session of its own) and its flags
    (:data:`tandem.schema.FLAG_START` / :data:`tandem.schema.FLAG_END`: ``sequence_start`` /
    ``sequence_end``). Value ranges are checked once, by :meth:`Scheduler.validate`. Raises
    :class:`~tandem.schema.WireError` naming the field when a tensor has the wrong shape, a required
    one is missing or the sequence id is a string or in tandem's one-turn range, and before decoding
    anything, when an input is over its size limit (``INPUT_IDS``: ``max_ctx`` tokens; strings and lists:
    :func:`tandem.schema.check_size`).
    """
    wire = schema.TANDEM
    if isinstance(correlation_id, str):
        raise WireError(f"{schema.SEQUENCE_ID}: sequence ids are unsigned integers, got the string {correlation_id!r}")
    sid = int(correlation_id or 0)
    if sid >= schema.ONE_TURN_SEQUENCE_IDS:
        raise WireError(
            f"{schema.SEQUENCE_ID} must be below 2**63 (ids from there up are tandem's one-turn sessions), got {sid}"
        )
    if sid == 0:  # no sequence: a session for this one turn
        sid, flags = one_turn_id(), schema.FLAG_START | schema.FLAG_END
    ids = arrays.get(schema.INPUT_IDS)
    if ids is not None and np.asarray(ids).ndim != 1:
        raise WireError(f"{schema.INPUT_IDS} must be 1-D, got shape {list(np.asarray(ids).shape)}")
    if ids is not None:
        schema.check_size(np.asarray(ids), wire.input(schema.INPUT_IDS), max_items=max_ctx)
    for name in (
        schema.STOP_TOKEN_IDS,
        schema.STOP,
        schema.RESPONSE_FORMAT,
    ):  # sizes first: nothing below decodes an oversize input
        if name in arrays:
            schema.check_size(np.asarray(arrays[name]), wire.input(name))
    tokens = [] if ids is None else np.asarray(ids).astype(np.int64).tolist()
    stops = arrays.get(schema.STOP_TOKEN_IDS)
    if stops is not None and np.asarray(stops).ndim != 1:
        raise WireError(f"{schema.STOP_TOKEN_IDS} must be 1-D, got shape {list(np.asarray(stops).shape)}")
    spec = None if schema.SPEC not in arrays else schema.get_string(arrays, wire.input(schema.SPEC)).strip().lower()
    return TurnRequest(
        sid,
        tokens,
        schema.get_scalar(arrays, wire.input(schema.MAX_TOKENS)),
        spec or None,
        start=bool(flags & schema.FLAG_START),
        end=bool(flags & schema.FLAG_END),
        num_draft_tokens=None
        if schema.NUM_DRAFT_TOKENS not in arrays
        else schema.get_scalar(arrays, wire.input(schema.NUM_DRAFT_TOKENS)),
        sampling=parse_sampling(arrays),
        stop_token_ids=() if stops is None else tuple(np.asarray(stops).astype(np.int64).tolist()),
        stop=schema.get_strings(arrays, wire.input(schema.STOP)),
        stream=schema.get_scalar(arrays, wire.input(schema.STREAM)),
        cache_salt=parse_cache_salt(arrays),
        response_format=schema.get_string(arrays, wire.input(schema.RESPONSE_FORMAT)),
    )


@dataclasses.dataclass
class Usage:
    """A turn's usage so far: ``prompt_tokens`` (its context: earlier turns + this prompt),
    ``completion_tokens``, ``rounds`` and ``accepted`` (draft tokens) summed over its responses."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    accepted: int = 0

    def add(self, receipt) -> None:
        self.completion_tokens += len(receipt.tokens)
        self.rounds += receipt.rounds
        self.accepted += receipt.accepted

    @property
    def tau(self) -> float:
        """Mean acceptance length 1 + accepted / rounds (0.0 before any round)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0


def receipt_outputs(
    receipt, usage: Usage | None = None, preceding: list[int] = (), sid: int = 0, turn: int = 0
) -> Arrays:
    """One streamed ``tandem`` response (:data:`tandem.schema.TANDEM` outputs) from a
    :class:`~tandem.engine.session.Receipt`: ``OUTPUT_IDS [n]`` int32, ``PRECEDING_IDS [<= 6]``
    (``preceding``: the turn's tokens sent before), ``ROUNDS`` / ``DRAFTED`` /
    ``ACCEPTED [1]`` int32 (deltas for this burst), ``FINISH_REASON [1]`` ("" while streaming),
    ``STOP_STRING [1]``, ``SESSION_ID [1]`` (``sid``, uint64 bits as int64), ``TURN [1]`` int64 (``turn``:
    the turn's number, what a ``CANCEL`` names), and the turn's :class:`Usage` so far: ``PROMPT_TOKENS``,
    ``COMPLETION_TOKENS``, ``TOTAL_ROUNDS [1]`` int32, ``MEAN_ACCEPTANCE_LENGTH [1]`` fp32 (``usage``
    None: this receipt alone)."""
    if usage is None:
        usage = Usage()
        usage.add(receipt)
    out = {
        schema.OUTPUT_IDS: np.array(receipt.tokens, dtype=np.int32),
        schema.PRECEDING_IDS: np.array(list(preceding)[-schema.DETOKENIZE_WINDOW :], dtype=np.int32),
        schema.ROUNDS: np.array([receipt.rounds], dtype=np.int32),
        schema.DRAFTED: np.array([receipt.drafted], dtype=np.int32),
        schema.ACCEPTED: np.array([receipt.accepted], dtype=np.int32),
        schema.FINISH_REASON: schema.string_array(receipt.finish_reason or ""),
        schema.STOP_STRING: schema.string_array(receipt.stop_string),
        schema.SESSION_ID: schema.sids_to_wire([sid]),
        schema.TURN: np.array([turn], dtype=np.int64),
        schema.PROMPT_TOKENS: np.array([usage.prompt_tokens], dtype=np.int32),
        schema.COMPLETION_TOKENS: np.array([usage.completion_tokens], dtype=np.int32),
        schema.TOTAL_ROUNDS: np.array([usage.rounds], dtype=np.int32),
        schema.MEAN_ACCEPTANCE_LENGTH: np.array([usage.tau], dtype=np.float32),
    }
    assert tuple(out) == schema.TANDEM.output_names
    return out
