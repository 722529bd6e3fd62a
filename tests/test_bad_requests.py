"""Integration: bad `tandem` requests, sent raw with tritonclient, each answered with one error that
names the field (and its limit) while another session keeps streaming, untouched."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

from tandem import schema  # noqa: E402
from tandem.model.checkpoint import DEFAULT_CHECKPOINT  # noqa: E402
from tandem_client.client import generate, new_sequence_id  # noqa: E402

pytestmark = pytest.mark.integration

CKPT = Path(os.environ.get("TANDEM_TEST_CHECKPOINT") or DEFAULT_CHECKPOINT)
MAX_CTX, VOCAB = schema.DEFAULTS.max_ctx, 8192
_DT = {np.int32: "INT32", np.int64: "INT64", np.float32: "FP32", np.object_: "BYTES"}


def raw_turn(url: str, arrays: dict, sid: int | None = None, start: bool = True, end: bool = True) -> str | None:
    """Send one ``tandem`` request as given; the error message of its response, or None when it streamed to the end."""
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    try:
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        ins = []
        for name, a in arrays.items():
            x = grpcclient.InferInput(name, list(a.shape), _DT[a.dtype.type])
            x.set_data_from_numpy(a)
            ins.append(x)
        c.async_stream_infer(
            schema.TANDEM.name,
            ins,
            sequence_id=sid or new_sequence_id(),
            sequence_start=start,
            sequence_end=end,
            enable_empty_final_response=True,
        )
        while True:
            r, e = q.get(timeout=30)
            if e is not None:
                return e.message() if hasattr(e, "message") else str(e)
            p = r.get_response().parameters
            if "triton_final_response" in p and p["triton_final_response"].bool_param:
                return None
    finally:
        c.stop_stream()
        c.close()


def _i32(*v):
    return np.array(v, np.int32)


def _s(*v):
    return np.array([x.encode() for x in v], dtype=np.object_)


OK = {schema.INPUT_IDS: _i32(10, 11, 12), schema.MAX_TOKENS: _i32(4)}
CASES = [  # (id, inputs replacing / added to OK (None: removed), sequence flags, the error must contain)
    ("missing MAX_TOKENS", {schema.MAX_TOKENS: None}, {}, "MAX_TOKENS"),
    ("MAX_TOKENS as fp32", {schema.MAX_TOKENS: np.array([4.0], np.float32)}, {}, "MAX_TOKENS"),
    ("MAX_TOKENS of shape [2]", {schema.MAX_TOKENS: _i32(4, 4)}, {}, "MAX_TOKENS"),
    ("MAX_TOKENS 0", {schema.MAX_TOKENS: _i32(0)}, {}, f"MAX_TOKENS must be in [1, {MAX_CTX}], got 0"),
    (
        "MAX_TOKENS over the context",
        {schema.MAX_TOKENS: _i32(MAX_CTX + 1)},
        {},
        f"MAX_TOKENS must be in [1, {MAX_CTX}]",
    ),
    ("MAX_TOKENS int32 max", {schema.MAX_TOKENS: _i32(2**31 - 1)}, {}, f"MAX_TOKENS must be in [1, {MAX_CTX}]"),
    ("INPUT_IDS as int64", {schema.INPUT_IDS: np.array([10, 11], np.int64)}, {}, "INPUT_IDS"),
    ("INPUT_IDS 2-D", {schema.INPUT_IDS: np.array([[10, 11]], np.int32)}, {}, "INPUT_IDS"),
    ("no prompt", {schema.INPUT_IDS: None}, {}, "INPUT_IDS: the first turn of a sequence needs at least 1 token"),
    ("empty prompt", {schema.INPUT_IDS: _i32()}, {}, "INPUT_IDS: the first turn of a sequence needs at least 1 token"),
    ("negative token id", {schema.INPUT_IDS: _i32(5, -1)}, {}, f"INPUT_IDS: token ids must be in [0, {VOCAB}), got -1"),
    (
        "token id = vocab",
        {schema.INPUT_IDS: _i32(VOCAB)},
        {},
        f"INPUT_IDS: token ids must be in [0, {VOCAB}), got {VOCAB}",
    ),
    (
        "oversize prompt",
        {schema.INPUT_IDS: np.ones(MAX_CTX + 1, np.int32)},
        {},
        f"INPUT_IDS has {MAX_CTX + 1} elements, over the limit of {MAX_CTX}",
    ),
    ("huge batch dimension", {schema.INPUT_IDS: np.ones(1 << 19, np.int32)}, {}, "INPUT_IDS"),
    ("unknown spec", {schema.SPEC: _s("medusa")}, {}, "SPEC must be one of"),
    ("SPEC of shape [2]", {schema.SPEC: _s("mtp", "off")}, {}, "SPEC"),
    (
        "0 drafts",
        {schema.NUM_DRAFT_TOKENS: _i32(0), schema.SPEC: _s("dflash2")},
        {},
        "NUM_DRAFT_TOKENS must be in [1, 7], got 0 (the dflash2 block is 8 rows)",
    ),
    (
        "8 drafts in a DFlash block of 8",
        {schema.NUM_DRAFT_TOKENS: _i32(8), schema.SPEC: _s("dflash2")},
        {},
        "NUM_DRAFT_TOKENS must be in [1, 7], got 8",
    ),
    ("drafts with the default spec (plain)", {schema.NUM_DRAFT_TOKENS: _i32(2)}, {}, "decodes plain (SPEC 'off')"),
    (
        "99 MTP drafts",
        {schema.NUM_DRAFT_TOKENS: _i32(99), schema.SPEC: _s("mtp")},
        {},
        "NUM_DRAFT_TOKENS must be in [1, 8], got 99",
    ),
    (
        "drafts for plain decoding",
        {schema.NUM_DRAFT_TOKENS: _i32(2), schema.SPEC: _s("off")},
        {},
        "NUM_DRAFT_TOKENS: sequence",
    ),
    (
        "negative temperature",
        {schema.TEMPERATURE: np.array([-1.0], np.float32)},
        {},
        "TEMPERATURE must be in [0.0, 10.0]",
    ),
    (
        "NaN temperature",
        {schema.TEMPERATURE: np.array([np.nan], np.float32)},
        {},
        "TEMPERATURE must be a finite number",
    ),
    ("temperature as int32", {schema.TEMPERATURE: _i32(1)}, {}, "TEMPERATURE"),
    (
        "top-p 0",
        {schema.TEMPERATURE: np.array([0.7], np.float32), schema.TOP_P: np.array([0.0], np.float32)},
        {},
        "TOP_P must be in (0.0, 1.0], got 0.0",
    ),
    (
        "top-p above 1",
        {schema.TEMPERATURE: np.array([0.7], np.float32), schema.TOP_P: np.array([1.5], np.float32)},
        {},
        "TOP_P must be in (0.0, 1.0], got 1.5",
    ),
    (
        "negative top-k",
        {schema.TEMPERATURE: np.array([0.7], np.float32), schema.TOP_K: _i32(-1)},
        {},
        "TOP_K must be in [0, ",
    ),
    (
        "negative seed",
        {schema.TEMPERATURE: np.array([0.7], np.float32), schema.SEED: np.array([-1], np.int64)},
        {},
        "SEED must be in [0, ",
    ),
    (
        "unknown sampling mode",
        {schema.TEMPERATURE: np.array([0.7], np.float32), schema.SAMPLING: _s("beam")},
        {},
        "SAMPLING must be one of ('rejection', 'coupled'), got 'beam'",
    ),
    (
        "17 stop token ids",
        {schema.STOP_TOKEN_IDS: _i32(*range(17))},
        {},
        "STOP_TOKEN_IDS has 17 elements, over the limit of 16",
    ),
    (
        "stop token id = vocab",
        {schema.STOP_TOKEN_IDS: _i32(VOCAB)},
        {},
        f"STOP_TOKEN_IDS: token ids must be in [0, {VOCAB}), got {VOCAB}",
    ),
    ("stop token ids 2-D", {schema.STOP_TOKEN_IDS: np.array([[1, 2]], np.int32)}, {}, "STOP_TOKEN_IDS"),
    ("no START on an unknown sequence", {}, {"start": False, "end": False}, "sequence_start"),
    ("END on an unknown sequence", {}, {"start": False, "end": True}, "sequence_start"),
]


def test_at_least_25_cases():
    assert len(CASES) >= 25


@pytest.fixture(scope="module")
def streaming(server):
    """A long greedy stream running while the bad requests arrive; yields its result box."""
    from tandem.model.tokenizer import ChatTokenizer

    prompt = ChatTokenizer(CKPT).chat_prompt("Tell me about the history of rivers.")
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(res=generate(prompt, 200, url=server.grpc_url, spec="off")))
    t.start()
    yield box
    t.join(timeout=300)
    assert len(box["res"]["token_ids"]) == 200 and box["res"]["finish_reason"] == "length"


@pytest.mark.parametrize("name, change, flags, expect", CASES, ids=[c[0] for c in CASES])
def test_bad_request_names_the_field(server, streaming, name, change, flags, expect):
    arrays = {k: v for k, v in {**OK, **change}.items() if v is not None}
    err = raw_turn(server.grpc_url, arrays, **flags)
    assert err is not None and expect in err, (name, err)
    assert "res" not in streaming or len(streaming["res"]["token_ids"]) == 200  # the other stream goes on


def test_a_good_request_after_the_bad_ones(server, streaming):
    assert raw_turn(server.grpc_url, dict(OK)) is None
