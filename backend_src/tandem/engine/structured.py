"""Structured output, lossless under speculation: a turn's response format (a JSON schema, any JSON object, a
regex or an EBNF grammar) compiled by xgrammar (Dong et al. 2024) into a token-level matcher, one per turn.

The trunk masks every row it decides: a verify row's target is chosen among the tokens the grammar allows in
the state that row sees, the state after the anchor and the drafts before it (:meth:`Constraint.row_masks`
advances the matcher through the drafts, then rolls it back). After the accept walk the matcher advances over
the emitted tokens (:meth:`Constraint.advance`): the accepted drafts and the trunk's token after them. The
drafter is never masked, so acceptance shows what the constraint costs. The mask applies to the logits before
temperature, top-k and top-p (:func:`apply_masks`), so greedy and sampled targets alike are those plain decoding
under the same mask would choose, and a constrained speculative stream equals constrained plain decoding token
for token (``tests/test_structured.py``).

xgrammar was chosen over llguidance by its mask time per row, which every verify row pays, measured on this CPU
with the shipped vocabulary and a 150,000-token one (docs/structured-output.md).

Runs in the engine core's process: the scheduler owns each turn's :class:`Constraint`, the trunk stage reads
its masks.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import torch

from .. import schema
from ..schema import WireError

_FIELD = schema.RESPONSE_FORMAT
#: the prefix xgrammar's native errors carry, ``[13:17:47] /project/cpp/json_schema_converter.cc:5082: ``
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


@dataclasses.dataclass(frozen=True)
class ResponseFormat:
    """A parsed response format: ``kind`` (one of :data:`tandem.schema.RESPONSE_FORMAT_TYPES` but ``text``)
    and ``source``: the JSON schema (JSON text, its properties in the client's order, which the output keeps),
    the regex or the EBNF grammar (``""`` for ``json_object``)."""

    kind: str
    source: str = ""

    @classmethod
    def parse(cls, text: str) -> "ResponseFormat | None":
        """The format the wire's ``RESPONSE_FORMAT`` text describes (None: ``""`` or ``{"type": "text"}``, no
        constraint). Accepts OpenAI's shapes, ``{"type": "json_object"}`` and ``{"type": "json_schema",
        "json_schema": {"name": ..., "schema": {...}}}``, and tandem's ``{"type": "regex", "regex": "..."}`` and
        ``{"type": "grammar", "grammar": "..."}``. Raises :class:`~tandem.schema.WireError` naming the field."""
        if not text.strip():
            return None
        if len(text.encode("utf-8")) > schema.MAX_RESPONSE_FORMAT_BYTES:
            raise WireError(f"{_FIELD}: at most {schema.MAX_RESPONSE_FORMAT_BYTES} bytes")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise WireError(f"{_FIELD} must be a JSON object: {e}") from None
        if not isinstance(obj, dict):
            raise WireError(f"{_FIELD} must be a JSON object, got {type(obj).__name__}")
        kind = obj.get("type")
        if kind not in schema.RESPONSE_FORMAT_TYPES:
            raise WireError(f"{_FIELD}.type must be one of {schema.RESPONSE_FORMAT_TYPES}, got {kind!r}")
        known = {"type", kind}
        if extra := sorted(set(obj) - known):
            raise WireError(f"{_FIELD}: unknown field(s) {extra} for type {kind!r}")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(kind)
        body = obj.get(kind)
        if kind == "json_schema":
            if not isinstance(body, dict) or not isinstance(body.get("schema"), (dict, bool)):
                raise WireError(f"{_FIELD}.json_schema.schema must be a JSON schema (an object)")
            return cls(kind, json.dumps(body["schema"]))
        if not isinstance(body, str) or not body:
            raise WireError(f"{_FIELD}.{kind} must be a non-empty string")
        return cls(kind, body)

    def wire(self) -> str:
        """The format as ``RESPONSE_FORMAT`` text (:meth:`parse` gives it back)."""
        if self.kind == "json_schema":
            return json.dumps({"type": self.kind, "json_schema": {"schema": json.loads(self.source)}})
        return json.dumps(
            {"type": self.kind} if self.kind == "json_object" else {"type": self.kind, self.kind: self.source}
        )


class Grammars:
    """The grammar engine of one tokenizer: compiles response formats (cached by format: a compile costs
    milliseconds, a cached one nothing) and makes each turn's :class:`Constraint`.

    Args: ``tokenizer`` — the checkpoint's ``tokenizer.json`` path; ``vocab_size`` — the trunk's logits
    width (ids beyond the tokenizer's are never allowed); ``stop_ids`` — the tokens that end a turn, the
    only ones a completed format allows. Thread-safe: the request threads compile, the engine core's
    thread makes matchers; nothing is imported before :meth:`load`. :attr:`stats` counts ``compiles``,
    ``compile_s``, ``mask_rows`` and ``mask_s`` (seconds filling masks), added to in place.

    JSON is generated compact (one space after ``,`` and ``:``, none elsewhere), as a model writes it without
    an indent; a schema may not reach for more whitespace.
    """

    def __init__(self, tokenizer: str | Path, vocab_size: int, stop_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = Path(tokenizer), vocab_size, tuple(stop_ids)
        self.stats = {"compiles": 0, "compile_s": 0.0, "mask_rows": 0, "mask_s": 0.0}
        self._lock = threading.Lock()
        self._xgr: Any = None
        self.compiler: Any = None

    def load(self) -> "Grammars":
        """Import the engine and index the vocabulary (once; seconds, mostly the import): a server does it at
        load, in-process engines at their first format."""
        with self._lock:
            if self.compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                hf = PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer))
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_ids)
                )
                self._xgr, self.compiler = xgr, xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return self

    def compile(self, fmt: ResponseFormat) -> Any:
        """``fmt`` compiled (an ``xgrammar.CompiledGrammar``). Raises :class:`~tandem.schema.WireError` naming
        the field when it does not compile (an invalid schema, regex or grammar)."""
        c = self.load().compiler
        t = time.perf_counter()
        try:
            if fmt.kind in ("json_object", "json_schema"):  # json_object: any object, as OpenAI's (not any value)
                src = '{"type": "object"}' if fmt.kind == "json_object" else fmt.source
                out = c.compile_json_schema(src, any_whitespace=False, strict_mode=True)
            elif fmt.kind == "regex":
                out = c.compile_regex(fmt.source)
            else:
                out = c.compile_grammar(fmt.source)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / its own errors
            where = f"{_FIELD}.json_schema.schema" if fmt.kind == "json_schema" else f"{_FIELD}.{fmt.kind}"
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            msg = _NATIVE_PREFIX.sub("", msg)  # (the engine's log prefix: a time and its C++ source line)
            raise WireError(f"{where} does not compile: {msg}") from None
        with self._lock:
            self.stats["compiles"] += 1
            self.stats["compile_s"] += time.perf_counter() - t
        return out

    def constraint(self, compiled: Any, max_rows: int) -> "Constraint":
        """A new turn's :class:`Constraint` over ``compiled``, for verifies of up to ``max_rows`` rows."""
        return Constraint(self.load()._xgr.GrammarMatcher(compiled), self, max_rows)


class Constraint:
    """One turn's grammar state: an xgrammar matcher that has consumed every token the turn emitted.

    ``max_rows``: the most rows one verify asks masks for (anchor + drafts). Not thread-safe: the engine core's
    thread uses it."""

    def __init__(self, matcher: Any, grammars: Grammars, max_rows: int) -> None:
        self.matcher, self.grammars = matcher, grammars
        xgr = grammars._xgr
        self._fill = xgr.GrammarMatcher.fill_next_token_bitmask
        self.bitmask = xgr.allocate_token_bitmask(max_rows, grammars.vocab_size)

    def row_masks(self, drafts: list[int]) -> torch.Tensor:
        """The masks of a verify of ``[anchor, *drafts]`` (or a prime's last row: no drafts): ``[k + 1, W]``
        int32 bitmasks (``W = ceil(V / 32)``, bit ``t`` of row ``i``: token ``t`` allowed), row ``i`` for the
        state after ``drafts[:i]``. Rows after a draft the grammar refuses allow every token (the walk stops
        at that draft: the target there differs from it). The matcher is left as it was."""
        n = len(drafts) + 1
        bm = self.bitmask[:n]
        m, took, t0 = self.matcher, 0, time.perf_counter()
        filled = 0
        while filled < n and not m.is_terminated():  # (terminated: a stop draft, where the walk ends)
            self._fill(m, bm, filled)
            filled += 1
            if filled == n or not m.accept_token(int(drafts[filled - 1])):
                break
            took += 1
        if filled < n:
            bm[filled:] = -1
        if took:
            m.rollback(took)
        st = self.grammars.stats
        st["mask_rows"] += filled
        st["mask_s"] += time.perf_counter() - t0
        return bm

    def advance(self, tokens: list[int]) -> None:
        """Consume the tokens the turn emitted (each chosen under this matcher's mask). Raises
        ``RuntimeError`` for a token the grammar refuses: an engine fault, never a client's."""
        for t in tokens:
            if self.matcher.is_terminated():
                raise RuntimeError(f"structured output: token {t} after the format ended")
            if not self.matcher.accept_token(int(t)):
                raise RuntimeError(f"structured output: token {t} is not allowed by the format")

    @property
    def done(self) -> bool:
        """Whether the format is complete and its stop token consumed."""
        return self.matcher.is_terminated()


def apply_masks(logits: torch.Tensor, lengths: list[int], masks: list[torch.Tensor | None]) -> None:
    """Set the disallowed tokens' logits to ``-inf`` in place: ``logits [R, V]`` hold the sequences' rows in
    turn (``lengths``); ``masks[j]`` is sequence ``j``'s ``[lengths[j], W]`` bitmask (None: unconstrained)."""
    import xgrammar as xgr

    off = 0
    for n, m in zip(lengths, masks):
        if m is not None:
            xgr.apply_token_bitmask_inplace(logits[off : off + n], m.to(logits.device, non_blocking=True))
        off += n
