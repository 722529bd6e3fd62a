"""The text front's two steps, Triton-free: ``preprocessing`` (a user message rendered with the
checkpoint's chat template and tokenized) and ``postprocessing`` (a ``tandem`` response's tokens
turned into text, statelessly). ``model_repository/{preprocessing,postprocessing}/1/model.py``
convert tensors; the ``ensemble`` model chains them around ``tandem``
(:mod:`tandem.schema_text` holds every name).

Stateless incremental detokenization: each ``tandem`` response carries ``PRECEDING_IDS``, the
turn's last tokens before its own, so a response's text is the decode of (preceding + its ids)
minus the decode of the preceding ids. A character belongs to the response carrying its last byte:
text ending in an incomplete UTF-8 sequence (decoded as U+FFFD) is left to the next response, and
only the final response flushes it (:func:`tandem.engine.stops.response_text`, the rule
:class:`~tandem.engine.stops.StopText` follows too, so a turn cut at a stop string loses exactly the
text from the stop string on).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .. import schema, schema_text
from ..engine.stops import response_text
from ..schema import Arrays, WireError


def postprocess(decode: Callable[[list[int]], str], arrays: Arrays) -> Arrays:
    """One ``postprocessing`` response from one ``tandem`` response's tensors (names of
    :data:`tandem.schema_text.POSTPROCESSING`): ``text_output [1]`` (TYPE_STRING, see
    :func:`response_text`), and every other tandem output passed through under its lowercase name.
    Raises :class:`~tandem.schema.WireError` naming a missing or malformed input."""
    wire = schema_text.POSTPROCESSING
    for t in wire.inputs:
        if t.name not in arrays:
            raise WireError(f"{t.name} is required (a {schema.TANDEM.name} output)")
    ids = schema.get_vector(arrays, wire.input(schema.OUTPUT_IDS)).astype(np.int64).tolist()
    prev = schema.get_vector(arrays, wire.input(schema.PRECEDING_IDS)).astype(np.int64).tolist()
    finish = schema.get_string(arrays, wire.input(schema.FINISH_REASON))
    stop = schema.get_string(arrays, wire.input(schema.STOP_STRING))
    out = {schema_text.TEXT_OUTPUT: schema.string_array(response_text(decode, ids, prev, bool(finish), stop))}
    for name in schema_text.PASSED_THROUGH:
        out[name.lower()] = np.asarray(arrays[name])
    assert tuple(out) == wire.output_names
    return out


def preprocess(
    render: Callable[[str], list[int]], arrays: Arrays, max_ctx: int | None = None, max_text_bytes: int | None = None
) -> Arrays:
    """One ``preprocessing`` response (names of :data:`tandem.schema_text.PREPROCESSING`): the user
    message ``text_input`` rendered and tokenized by ``render`` (``str -> list[int]``, e.g.
    ``ChatTokenizer.chat_prompt``) as ``INPUT_IDS [n]`` int32; ``max_tokens`` and ``stream`` as
    ``MAX_TOKENS [1]`` int32 and ``STREAM [1]`` bool, with their defaults when absent (ranges are
    ``tandem``'s to check). A text of more than ``max_text_bytes`` bytes is refused before it is decoded
    or tokenized (it cannot fit the context: see :attr:`ChatTokenizer.max_token_bytes`), and a prompt of
    more than ``max_ctx`` tokens after it (None: no check). Raises :class:`~tandem.schema.WireError`
    naming the field and the limit (also for a missing ``text_input`` and for ``exclude_input_in_output``
    false)."""
    wire = schema_text.PREPROCESSING
    if schema_text.TEXT_INPUT not in arrays:
        raise WireError(f"{schema_text.TEXT_INPUT} is required (the user message, a string)")
    raw = np.asarray(arrays[schema_text.TEXT_INPUT]).reshape(-1)
    if (
        max_text_bytes is not None
        and raw.size == 1
        and isinstance(raw[0], (bytes, np.bytes_))
        and len(raw[0]) > max_text_bytes
    ):
        raise WireError(
            f"{schema_text.TEXT_INPUT}: {len(raw[0])} bytes is over the limit of {max_text_bytes} bytes "
            f"(a longer text cannot fit the context of {max_ctx} tokens)"
        )
    if not schema.get_scalar(arrays, wire.input(schema_text.EXCLUDE_INPUT)):
        raise WireError(f"{schema_text.EXCLUDE_INPUT} must be true: tandem's output never repeats the prompt")
    text = schema.get_string(arrays, wire.input(schema_text.TEXT_INPUT))
    ids = render(text)
    if max_ctx is not None and len(ids) > max_ctx:
        raise WireError(
            f"{schema_text.TEXT_INPUT}: the prompt is {len(ids)} tokens, over the limit of {max_ctx} "
            f"(max_ctx: tokens per session)"
        )
    out = {
        schema.INPUT_IDS: np.asarray(ids, dtype=np.int32),
        schema.MAX_TOKENS: np.array([schema.get_scalar(arrays, wire.input(schema_text.MAX_TOKENS_IN))], np.int32),
        schema.STREAM: np.array([schema.get_scalar(arrays, wire.input(schema_text.STREAM_IN))], np.bool_),
    }
    assert tuple(out) == wire.output_names
    return out


class Preprocessor:
    """The ``preprocessing`` model's ``handle(arrays, correlation_id, flags) -> arrays``
    (:func:`preprocess`) over a checkpoint's tokenizer and chat template (``tokenizer`` a
    ``ChatTokenizer``; ``max_ctx``: the server's tokens per session, which bounds the text it tokenizes).
    The ensemble passes its request's sequence id and flags to this step: a
    turn of a sequence without ``sequence_start`` is a later turn (the template's preamble left out)."""

    def __init__(self, tokenizer, max_ctx: int = schema.DEFAULTS.max_ctx) -> None:
        self.tokenizer, self.max_ctx = tokenizer, max_ctx
        self.max_text_bytes = max_ctx * tokenizer.max_token_bytes

    def handle(self, arrays: Arrays, correlation_id=0, flags: int = 0) -> Arrays:
        later = bool(correlation_id) and not flags & schema.FLAG_START
        return preprocess(
            lambda text: self.tokenizer.chat_prompt(text, later=later), arrays, self.max_ctx, self.max_text_bytes
        )


class Postprocessor:
    """The ``postprocessing`` model's ``handle(arrays) -> arrays`` (:func:`postprocess`), and
    :meth:`cancelled` for a response whose client left: Triton marks the ensemble's later step
    requests cancelled, not the running ``tandem`` step (server issue #6739), so this step passes the
    cancel on. ``cancel(session_id, turn)``: sends ``tandem`` a ``CANCEL`` request for that turn of the
    session (BLS, in model.py)."""

    #: (session, turn) pairs remembered at most; past it the oldest half is forgotten (a turn's responses
    #: arrive within its life, so only a turn still streaming needs its entry)
    REMEMBER = 4096

    def __init__(self, tokenizer, cancel=None) -> None:
        self.tokenizer, self.cancel = tokenizer, cancel
        self._cancelled: dict[tuple[int, int], None] = {}

    def handle(self, arrays: Arrays) -> Arrays:
        return postprocess(self.tokenizer.decode, arrays)

    def cancelled(self, arrays: Arrays) -> None:
        """Cancel the ``tandem`` turn behind a cancelled response, once per turn (``SESSION_ID``,
        ``TURN``): each later turn of the same session is cancelled on its own, and a late response of
        an earlier turn never cancels a later one (the ``CANCEL`` names the turn)."""
        if self.cancel is None or schema.SESSION_ID not in arrays or schema.TURN not in arrays:
            return
        sid = schema.sids_from_wire(np.asarray(arrays[schema.SESSION_ID]).reshape(-1))[0]
        key = (sid, int(np.asarray(arrays[schema.TURN]).reshape(-1)[0]))
        if key in self._cancelled:
            return
        if len(self._cancelled) >= self.REMEMBER:
            for k in list(self._cancelled)[: self.REMEMBER // 2]:
                del self._cancelled[k]
        self._cancelled[key] = None
        self.cancel(*key)
