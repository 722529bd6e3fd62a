"""Stop strings: a turn's text followed token by token as tokens are accepted, the turn cut at the
first stop string, and the tokens that might begin one held back from the stream.

Semantics (vLLM's, ``SamplingParams.stop``): the turn's token ids run through the token that
completes the stop string, and exactly those stay in the session's context (the trunk cache is
rolled back past the rest of an accepted draft block, like a stop token id); the turn's *text*
ends before the stop string (``Receipt.stop_string`` tells a detokenizer where). While a turn
streams, a token whose text could be the start of a stop string is not sent until the next tokens
decide it, so streamed text never shows part of a stop string, including one that spans a burst
boundary.

Text attribution (:func:`response_text`, the one rule, shared with the stateless ``postprocessing``
model): a character belongs to the token that carries its last byte (byte-level BPE splits
multi-byte characters across tokens); :data:`DETOKENIZE_WINDOW` earlier tokens are decoded with the
new ones (as vLLM's ``detokenize_incrementally`` does with its offsets), and ``postprocessing`` gets
them as ``PRECEDING_IDS``.
"""

from __future__ import annotations

import bisect
from typing import Callable

from .. import schema

#: earlier tokens decoded with each new token (a UTF-8 character has at most 4 bytes, one token at least 1)
DETOKENIZE_WINDOW = schema.DETOKENIZE_WINDOW
REPLACEMENT = "\ufffd"


def _complete(text: str) -> str:
    """``text`` without a trailing U+FFFD (an incomplete UTF-8 sequence, finished by a later token)."""
    return text[:-1] if text.endswith(REPLACEMENT) else text


def response_text(
    decode: Callable[[list[int]], str],
    output_ids: list[int],
    preceding_ids: list[int],
    final: bool,
    stop_string: str = "",
) -> str:
    """The text of ``output_ids`` after ``preceding_ids`` (a ``tandem`` response's ``OUTPUT_IDS`` and
    ``PRECEDING_IDS``): the decode of both minus the decode of the preceding ones, each without an
    incomplete trailing character (U+FFFD), which the next response completes; a ``final`` response
    flushes it. ``decode``: ``list[int] -> str`` (special tokens skipped, e.g. ``ChatTokenizer.decode``);
    ``stop_string``: the response's ``STOP_STRING``: the text ends where it starts (tandem held back
    every token that could begin it, so it starts in this response's text).
    """
    before = _complete(decode(list(preceding_ids)))
    full = decode(list(preceding_ids) + list(output_ids))
    if not final:
        full = _complete(full)
    n = (
        len(before)
        if full.startswith(before)
        else next((i for i, (a, b) in enumerate(zip(before, full)) if a != b), min(len(before), len(full)))
    )
    text = full[n:]
    if stop_string and (i := text.find(stop_string)) >= 0:
        text = text[:i]
    return text


def validate_stops(stops: tuple[str, ...], decode: Callable | None) -> str | None:
    """Error text naming ``STOP`` and its limit (:data:`tandem.schema.MAX_STOPS` strings of 1 to
    :data:`tandem.schema.MAX_STOP_CHARS` characters), or None."""
    if not stops:
        return None
    if decode is None:
        return f"{schema.STOP}: this server has no tokenizer to match stop strings with"
    if len(stops) > schema.MAX_STOPS:
        return f"{schema.STOP}: at most {schema.MAX_STOPS} stop strings, got {len(stops)}"
    bad = next((s for s in stops if not 1 <= len(s) <= schema.MAX_STOP_CHARS), None)
    if bad is not None:
        return f"{schema.STOP}: each stop string must have 1 to {schema.MAX_STOP_CHARS} characters, got {len(bad)}"
    return None


class StopText:
    """One turn's generated text, for its stop strings.

    Args: ``decode`` — ``list[int] -> str`` (special tokens skipped, invalid UTF-8 as U+FFFD, e.g.
    ``ChatTokenizer.decode``); ``stops`` — the turn's stop strings (non-empty).

    :meth:`scan` takes each round's accepted tokens and says where a stop string completed;
    :meth:`hold_back` decides which accepted tokens a burst's response may carry.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        assert stops and all(stops), "stop strings must be non-empty"
        self.decode, self.stops = decode, tuple(stops)
        self.ids: list[int] = []  # the turn's accepted tokens
        self.text = ""  # their text (response_text's attribution)
        self.ends: list[int] = []  # len(text) once each token was pushed
        #: the stop string that ended the turn, and where it starts in :attr:`text`
        self.matched: str | None = None
        self.cut: int | None = None
        self.sent = 0  # tokens handed to responses
        self._gaps: list[float] = []  # top-2 gaps of the held tokens

    def push(self, tok: int) -> bool:
        """Append one accepted token; True when its text completes a stop string (then
        :attr:`matched` / :attr:`cut` are set; no further token may be pushed)."""
        assert self.matched is None, "the turn already stopped"
        start, prev = len(self.text), self.ids[-DETOKENIZE_WINDOW:]
        self.ids.append(int(tok))
        self.text += response_text(self.decode, [int(tok)], prev, final=False)
        if len(self.text) > start:
            frm = max(0, start - max(len(s) for s in self.stops) + 1)
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, frm)) >= 0]
            if hits:
                self.cut, self.matched = min(hits)
        self.ends.append(len(self.text))
        return self.matched is not None

    def scan(self, tokens: list[int]) -> int | None:
        """Push ``tokens`` in order; the count kept (through the token completing a stop string) when
        one completes, else None (all pushed)."""
        for i, t in enumerate(tokens):
            if self.push(t):
                return i + 1
        return None

    def safe(self) -> int:
        """Tokens that may be sent now: all once stopped; else those whose text ends before the
        longest end of :attr:`text` that is a proper prefix of a stop string."""
        if self.matched is not None:
            return len(self.ids)
        tail = max(
            (n for s in self.stops for n in range(min(len(s) - 1, len(self.text)), 0, -1) if self.text.endswith(s[:n])),
            default=0,
        )
        return bisect.bisect_right(self.ends, len(self.text) - tail)

    def hold_back(self, tokens: list[int], gaps: list[float], final: bool) -> tuple[list[int], list[float]]:
        """A burst's response tokens: the held ones, then ``tokens`` (the burst's accepted tokens, the
        last ones pushed), cut at :meth:`safe` unless ``final``; returns (tokens, top-2 gaps) to send."""
        assert self.ids[len(self.ids) - len(tokens) :] == list(tokens), "tokens must be the last ones pushed"
        n = len(self.ids) if final else self.safe()
        self._gaps += gaps
        out, k = self.ids[self.sent : n], n - self.sent
        gaps, self._gaps = self._gaps[:k], self._gaps[k:]
        self.sent = n
        return out, gaps

    def final_text(self) -> str:
        """The turn's text as a client shows it: cut before the stop string."""
        return self.text if self.cut is None else self.text[: self.cut]
