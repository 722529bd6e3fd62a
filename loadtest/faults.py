"""The soak's fault mix (``make soak``): bad requests that must each be answered with one error
naming the field, and the outcome rules that tell an expected refusal or cancellation from a
failure. numpy only; the locustfile sends what :func:`bad_request` describes."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from tandem import schema


@dataclasses.dataclass(frozen=True)
class BadRequest:
    """One bad ``tandem`` request: ``arrays`` (wire name -> array), the sequence flags, and
    ``expect``: the text the server's error must contain (the field it names)."""

    name: str
    arrays: dict
    start: bool
    end: bool
    expect: str


def _i32(v: int) -> np.ndarray:
    return np.array([v], np.int32)


def bad_request(rng: random.Random, vocab: int = 8192, max_ctx: int = schema.DEFAULTS.max_ctx) -> BadRequest:
    """A bad request drawn from a fixed set (out-of-vocabulary id, MAX_TOKENS 0 or above the context,
    an unknown spec, a draft count beyond the limit, a later turn of an unknown sequence, an oversize
    prompt); each is sent on a fresh sequence id."""
    ids = np.array([rng.randrange(3, vocab) for _ in range(8)], np.int32)
    spec = lambda s: np.array([s.encode()], np.object_)  # noqa: E731
    cases = [
        BadRequest(
            "token id out of range",
            {schema.INPUT_IDS: np.array([vocab + 5], np.int32), schema.MAX_TOKENS: _i32(4)},
            True,
            True,
            schema.INPUT_IDS,
        ),
        BadRequest("MAX_TOKENS 0", {schema.INPUT_IDS: ids, schema.MAX_TOKENS: _i32(0)}, True, True, schema.MAX_TOKENS),
        BadRequest(
            "MAX_TOKENS above the context",
            {schema.INPUT_IDS: ids, schema.MAX_TOKENS: _i32(max_ctx + 1)},
            True,
            True,
            schema.MAX_TOKENS,
        ),
        BadRequest(
            "unknown spec",
            {schema.INPUT_IDS: ids, schema.MAX_TOKENS: _i32(4), schema.SPEC: spec("beam")},
            True,
            True,
            schema.SPEC,
        ),
        BadRequest(
            "draft count beyond the limit",
            {
                schema.INPUT_IDS: ids,
                schema.MAX_TOKENS: _i32(4),
                schema.SPEC: spec(schema.MTP),
                schema.NUM_DRAFT_TOKENS: _i32(schema.DEFAULTS.max_num_draft_tokens + 1),
            },
            True,
            True,
            schema.NUM_DRAFT_TOKENS,
        ),
        BadRequest(
            "later turn of an unknown sequence",
            {schema.INPUT_IDS: ids, schema.MAX_TOKENS: _i32(4)},
            False,
            True,
            schema.SEQUENCE_ID,
        ),
        BadRequest(
            "oversize prompt",
            {schema.INPUT_IDS: np.resize(ids, max_ctx + 8), schema.MAX_TOKENS: _i32(4)},
            True,
            True,
            schema.INPUT_IDS,
        ),
    ]
    return rng.choice(cases)


def judge_bad(req: BadRequest, error: str | None) -> str | None:
    """None when the server refused ``req`` as it should (an error naming its field), else what went wrong."""
    if error is None:
        return f"bad request '{req.name}' was accepted"
    if req.expect not in error or "internal error" in error:
        return f"bad request '{req.name}': the error does not name {req.expect}: {error}"
    return None
