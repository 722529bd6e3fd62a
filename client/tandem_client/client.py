"""Streaming gRPC client for the decoupled ``tandem`` Triton model.

:func:`generate` sends one turn (a fresh sequence, START and END set) over a tritonclient gRPC
stream and collects the streamed bursts; :class:`IncrementalDecoder` turns token bursts into text
without splitting multi-byte characters.
"""

from __future__ import annotations

import os
import queue
import random
import time
from pathlib import Path
from typing import Callable

import numpy as np

DEFAULT_URL = "127.0.0.1:8001"
DEFAULT_MODEL = "tandem"


class TandemClientError(RuntimeError):
    """The server could not be reached, answered with an error, or the stream timed out."""


class ServerUnreachable(TandemClientError):
    """No Triton server answered at the URL."""


def default_checkpoint() -> Path:
    """``$TANDEM_CHECKPOINT`` if set, else the repository's ``model_repository/weights/tandem-tiny``."""
    env = os.environ.get("TANDEM_CHECKPOINT")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "model_repository" / "weights" / "tandem-tiny"


def new_sequence_id() -> int:
    """A random correlation id in ``[1, 2**62]`` (fits every client's int64 field)."""
    return random.SystemRandom().getrandbits(62) + 1


class IncrementalDecoder:
    """Decode a growing token list piece by piece. ``push(ids)`` returns the newly completed text;
    text ending in an incomplete UTF-8 sequence (decoded as U+FFFD) is held back until the next
    push or :meth:`flush`. ``decode``: ``list[int] -> str`` (e.g. ``ChatTokenizer.decode``)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""

    def _advance(self, full: str) -> str:
        if not full.startswith(self.text):  # a merge changed earlier text: emit nothing rather than garble
            return ""
        new, self.text = full[len(self.text):], full
        return new

    def push(self, ids: list[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        full = self.decode(self.ids)
        return self._advance(full[:-1] if full.endswith("\ufffd") else full)

    def flush(self) -> str:
        """Everything not yet returned (including a trailing U+FFFD if the stream really ended so)."""
        return self._advance(self.decode(self.ids))


def _check_reachable(client, url: str, timeout_s: float) -> None:
    from tritonclient.utils import InferenceServerException

    try:
        live = client.is_server_live(client_timeout=timeout_s)
    except InferenceServerException as e:
        raise ServerUnreachable(f"cannot reach a Triton server at {url} ({e.message() or e}); "
                                f"start one with `make serve`") from None
    if not live:
        raise ServerUnreachable(f"the Triton server at {url} is not live")


def generate(prompt_ids: list[int], max_tokens: int = 128, url: str = DEFAULT_URL, spec: str = "mtp",
             num_draft_tokens: int | None = None, sequence_id: int | None = None, model: str = DEFAULT_MODEL,
             on_tokens: Callable[[list[int]], None] | None = None, timeout_s: float = 300.0,
             connect_timeout_s: float = 5.0, sequence_start: bool = True, sequence_end: bool = True) -> dict:
    """Run one turn on the ``tandem`` model over a gRPC stream (by default a fresh sequence:
    a random ``sequence_id``, START and END set; pass ``sequence_id`` and the flags for multi-turn).

    Args: ``prompt_ids`` — token ids (e.g. ``ChatTokenizer.chat_prompt``); ``max_tokens`` ≥ 1;
    ``url`` — ``host:port`` of Triton's gRPC endpoint; ``spec`` — ``"mtp"`` or ``"off"``;
    ``num_draft_tokens`` — drafts per round (server default when None); ``on_tokens(ids)`` — called
    on the stream's thread for each burst's new ids; ``timeout_s`` — limit between responses.

    Returns ``token_ids``, ``rounds``, ``drafted``, ``accepted``, ``mean_acceptance_length``
    (tau = 1 + accepted / rounds, 0 without rounds), ``finish_reason``, ``bursts``, ``ttft_s``,
    ``elapsed_s`` (request sent to final response, seconds), ``tokens_per_s``, ``sequence_id``.

    Raises :class:`ServerUnreachable` when nothing answers at ``url``, :class:`TandemClientError`
    with the server's message on an error response, or when no response arrives within ``timeout_s``.
    """
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        _check_reachable(client, url, connect_timeout_s)
        inputs = []

        def add(name, arr, dtype):
            x = grpcclient.InferInput(name, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            inputs.append(x)

        if len(prompt_ids):  # a later turn may send no new tokens (the server continues from its anchor)
            add("INPUT_IDS", np.asarray(prompt_ids, dtype=np.int32).reshape(-1), "INT32")
        add("MAX_TOKENS", np.array([max_tokens], dtype=np.int32), "INT32")
        add("SPEC", np.array([spec.encode()], dtype=np.object_), "BYTES")
        if num_draft_tokens is not None:
            add("NUM_DRAFT_TOKENS", np.array([num_draft_tokens], dtype=np.int32), "INT32")
        sid = sequence_id if sequence_id is not None else new_sequence_id()
        q: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        out = {"token_ids": [], "rounds": 0, "drafted": 0, "accepted": 0, "finish_reason": None, "bursts": 0,
               "ttft_s": None, "sequence_id": sid}
        t0 = time.perf_counter()
        completed = False
        try:
            client.async_stream_infer(model, inputs, sequence_id=sid, sequence_start=sequence_start,
                                      sequence_end=sequence_end, enable_empty_final_response=True)
            while True:
                try:
                    result, error = q.get(timeout=timeout_s)
                except queue.Empty:
                    raise TandemClientError(f"no response from {model} within {timeout_s:.0f} s") from None
                if error is not None:
                    msg = error.message() if isinstance(error, InferenceServerException) else str(error)
                    raise TandemClientError(f"server error: {msg}")
                resp = result.get_response()
                final = resp.parameters["triton_final_response"].bool_param if "triton_final_response" in \
                    resp.parameters else False
                if resp.outputs:
                    ids = result.as_numpy("OUTPUT_IDS").astype(np.int64).tolist()
                    if ids and out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                    out["token_ids"] += ids
                    out["rounds"] += int(result.as_numpy("ROUNDS")[0])
                    out["drafted"] += int(result.as_numpy("DRAFTED")[0])
                    out["accepted"] += int(result.as_numpy("ACCEPTED")[0])
                    out["bursts"] += 1
                    fr = result.as_numpy("FINISH_REASON")[0]
                    fr = fr.decode() if isinstance(fr, bytes) else str(fr)
                    if fr:
                        out["finish_reason"] = fr
                    if ids and on_tokens is not None:
                        on_tokens(ids)
                if final:
                    completed = True
                    break
        finally:
            # an abandoned turn (error, timeout, Ctrl-C) is cancelled so the server stops generating it
            client.stop_stream(cancel_requests=not completed)
    except InferenceServerException as e:
        raise TandemClientError(f"server error: {e.message() or e}") from None
    finally:
        client.close()
    el = time.perf_counter() - t0
    out["elapsed_s"] = el
    out["tokens_per_s"] = len(out["token_ids"]) / el if el > 0 else 0.0
    out["mean_acceptance_length"] = 1.0 + out["accepted"] / out["rounds"] if out["rounds"] else 0.0
    return out
