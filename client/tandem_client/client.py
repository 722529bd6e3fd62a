"""The tandem client library: a streaming gRPC client for the decoupled ``tandem`` Triton model.

:func:`generate` sends one turn (by default a fresh sequence, ``sequence_start`` and
``sequence_end`` set) over a tritonclient gRPC stream and collects the streamed bursts;
:class:`IncrementalDecoder` turns token bursts into text without splitting multi-byte characters;
:func:`stage_health` reports each model. The ``tandem`` command is :mod:`tandem_client.cli`. Wire
names and defaults come from :mod:`tandem.schema`.
"""

from __future__ import annotations

import os
import json
import queue
import random
import time
import urllib.request
from pathlib import Path
from typing import Callable

import numpy as np

from tandem import schema, schema_text

#: Triton's gRPC endpoint: ``$TANDEM_URL`` when set, else the one ``make serve`` opens
DEFAULT_URL = os.environ.get("TANDEM_URL") or "127.0.0.1:8001"


class TandemClientError(RuntimeError):
    """The server could not be reached, answered with an error, or the stream timed out."""


class ServerUnreachable(TandemClientError):
    """No Triton server answered at the URL."""


class SessionLost(TandemClientError):
    """The server no longer holds the session: it died or is shutting down (the stream broke mid-turn, or
    its message carries :data:`tandem.schema.SESSION_LOST_MARKER`), or a proxy sent the turn to a server
    that never held it. The server keeps nothing of it; re-prime the conversation under a new sequence
    id (:class:`tandem_client.conversation.Conversation` does)."""


class AtCapacity(TandemClientError):
    """The server had no free session slot for a first turn (its message carries
    :data:`tandem.schema.AT_CAPACITY_MARKER`); retry it under a new sequence id, which a proxy routes by load."""


def error_from(error, url: str, sid: int) -> TandemClientError:
    """The typed client error for a failed turn: ``error`` is tritonclient's exception (or any other)
    from the stream of sequence ``sid`` at ``url``. A transport error (gRPC status set: the stream broke,
    e.g. ``UNAVAILABLE`` when the server died) and a message with the session-lost marker give
    :class:`SessionLost`; the at-capacity marker :class:`AtCapacity`; anything else
    :class:`TandemClientError` carrying the server's message."""
    from tritonclient.utils import InferenceServerException

    msg = (error.message() or str(error)) if isinstance(error, InferenceServerException) else str(error)
    status = error.status() if isinstance(error, InferenceServerException) else None
    if status and schema.SESSION_LOST_MARKER not in msg and schema.AT_CAPACITY_MARKER not in msg:
        return SessionLost(
            f"the stream of sequence {sid} via {url} broke ({status}: {msg}); the server holding it "
            f"is gone {schema.SESSION_LOST_MARKER}"
        )
    kind = (
        SessionLost
        if schema.SESSION_LOST_MARKER in msg
        else AtCapacity
        if schema.AT_CAPACITY_MARKER in msg
        else TandemClientError
    )
    return kind(f"server error: {msg}")


def default_checkpoint() -> Path:
    """``$TANDEM_CHECKPOINT`` if set, else the shipped checkpoint (``model_repository/`` +
    :attr:`tandem.schema.ServingConfig.checkpoint`)."""
    env = os.environ.get("TANDEM_CHECKPOINT")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "model_repository" / schema.DEFAULTS.checkpoint


def new_sequence_id() -> int:
    """A random correlation id in ``[1, 2**62]`` (fits every client's int64 field)."""
    return random.SystemRandom().getrandbits(62) + 1


class IncrementalDecoder:
    """Decode a growing token list piece by piece. ``push(ids)`` returns the newly completed text;
    text ending in an incomplete UTF-8 sequence (decoded as U+FFFD) is held back until the next
    push or :meth:`flush`. ``decode``: ``list[int] -> str`` (e.g. ``ChatTokenizer.decode``);
    ``stops``: the turn's stop strings: text from the first one on is never returned (the server
    holds back tokens that could begin one, so nothing before it needs taking back)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()) -> None:
        self.decode, self.stops = decode, tuple(stops)
        self.ids: list[int] = []
        self.text = ""

    def _advance(self, full: str) -> str:
        if not full.startswith(self.text):  # a merge changed earlier text: emit nothing rather than garble
            return ""
        cut = min((i for s in self.stops if (i := full.find(s)) >= 0), default=-1)
        if cut >= 0:
            full = full[: max(cut, len(self.text))]
        new, self.text = full[len(self.text) :], full
        return new

    def push(self, ids: list[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        full = self.decode(self.ids)
        return self._advance(full[:-1] if full.endswith("\ufffd") else full)

    def flush(self) -> str:
        """Everything not yet returned (including a trailing U+FFFD if the stream really ended so)."""
        return self._advance(self.decode(self.ids))


def turn_text(decode: Callable[[list[int]], str], ids: list[int], stop_string: str = "") -> str:
    """A turn's text: ``decode(ids)``, ending where ``stop_string`` (the turn's ``stop_string``) starts."""
    text = decode(list(ids))
    i = text.find(stop_string) if stop_string else -1
    return text if i < 0 else text[:i]


def check_url(url: str) -> str:
    """``url`` if it is ``host:port`` (Triton's gRPC endpoint), else raise :class:`TandemClientError`
    saying what to pass instead (a scheme, a path, no port)."""
    if "://" in url or "/" in url:
        raise TandemClientError(
            f"--url takes host:port of Triton's gRPC endpoint (e.g. {DEFAULT_URL}), not a URL: {url!r}"
        )
    host, sep, port = url.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TandemClientError(f"--url must be host:port of Triton's gRPC endpoint (e.g. {DEFAULT_URL}), got {url!r}")
    return url


def _answers_http(url: str) -> bool:
    """Whether Triton's HTTP health endpoint answers at ``url`` (the HTTP port given for the gRPC one)."""
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/live", timeout=1.0) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - anything else: not an HTTP Triton port
        return False


#: how gRPC reports an HTTP/2 REFUSED_STREAM (the request was not processed, so it is safe to send again):
#: HAProxy answers so while it finds that a session's server died; the liveness check asks again
REFUSED_STREAM, REFUSED_RETRIES, REFUSED_PAUSE_S = "RST_STREAM with error code 7", 5, 0.2


def _check_reachable(client, url: str, timeout_s: float, headers: dict | None = None) -> None:
    from tritonclient.utils import InferenceServerException

    for attempt in range(REFUSED_RETRIES + 1):
        try:
            live = client.is_server_live(headers=headers, client_timeout=timeout_s)
            break
        except InferenceServerException as e:
            if REFUSED_STREAM in (e.message() or "") and attempt < REFUSED_RETRIES:
                time.sleep(REFUSED_PAUSE_S)
                continue
            if _answers_http(url):
                raise ServerUnreachable(
                    f"{url} is Triton's HTTP port; the tandem client speaks gRPC: pass the gRPC "
                    f"port (8001 by default, e.g. --url {url.rpartition(':')[0]}:8001)"
                ) from None
            if "status: 503" in (e.message() or ""):  # a proxy (make serve-cluster) answered, but no replica is up
                raise ServerUnreachable(
                    f"the proxy at {url} has no live replica to route to ({e.message()}); "
                    "restart a server behind it, or wait for its health check"
                ) from None
            raise ServerUnreachable(
                f"cannot reach a Triton server at {url} ({e.message() or e}); start one with `make serve`"
            ) from None
    if not live:
        raise ServerUnreachable(f"the Triton server at {url} is not live")


def generate(
    prompt_ids: list[int],
    max_tokens: int = schema_text.DEFAULT_MAX_TOKENS,
    url: str = DEFAULT_URL,
    spec: str | None = None,
    num_draft_tokens: int | None = None,
    sequence_id: int | None = None,
    model: str = schema.TANDEM.name,
    on_tokens: Callable[[list[int]], None] | None = None,
    timeout_s: float = 300.0,
    connect_timeout_s: float = 5.0,
    sequence_start: bool = True,
    sequence_end: bool = True,
    sampling: dict | None = None,
    stop_token_ids: list[int] | None = None,
    stop: list[str] | None = None,
    start_retries: int = 0,
    cache_salt: str | None = None,
    response_format: str | dict | None = None,
) -> dict:
    """Run one turn on the ``tandem`` model over a gRPC stream (by default a fresh sequence:
    a random ``sequence_id``, START and END set; pass ``sequence_id`` and the flags for multi-turn).

    Args: ``prompt_ids`` — token ids (e.g. ``ChatTokenizer.chat_prompt``); ``max_tokens`` ≥ 1;
    ``url`` — ``host:port`` of Triton's gRPC endpoint; ``spec`` — one of :data:`tandem.schema.SPECS`
    (None: not sent, so the server's default spec for a new sequence, the sequence's spec for a later turn);
    ``num_draft_tokens`` — drafts per round (server default when None); ``on_tokens(ids)`` — called
    on the stream's thread for each burst's new ids; ``timeout_s`` — limit between responses;
    ``sampling`` — the turn's sampling inputs by wire name (``{"TEMPERATURE": 0.8, "SEED": 7, ...}``,
    see :data:`tandem.schema.SAMPLING_INPUTS`; None or absent names: the server's defaults, greedy);
    ``stop_token_ids`` — tokens that also end the turn (emitted; nothing after them); ``stop`` —
    stop strings (the ids run through the token completing one; the text ends before it, see
    :class:`IncrementalDecoder`'s ``stops``); ``start_retries`` — a first turn on a fresh sequence id
    (``sequence_id`` None) refused :class:`AtCapacity` is sent again this many times, each under a new id
    (through a proxy, routed by load); ``cache_salt`` — the prefix-cache namespace of a first turn (only
    sequences primed with the same salt share cached prompt blocks, so their hits stay invisible to other
    tenants; None: the shared namespace); ``response_format`` — structured output, OpenAI's
    ``response_format`` object or its JSON text (``{"type": "json_schema", "json_schema": {"schema": {...}}}``,
    ``json_object``, tandem's ``regex`` and ``grammar``; see :data:`tandem.schema.RESPONSE_FORMAT`). The stream carries the routing header
    (:data:`tandem.schema.ROUTING_HEADER`: the sequence id) for a proxy.

    Returns ``token_ids``, ``rounds``, ``drafted``, ``accepted``, ``mean_acceptance_length``
    (tau = 1 + accepted / rounds; None without rounds), ``finish_reason``, ``bursts``, ``ttft_s``,
    ``elapsed_s`` (request sent to final response, seconds), ``tokens_per_s``, ``sequence_id``,
    ``stop_string`` (the stop string that ended the turn, else ""), and
    ``usage``: the server's count for the turn from its final response (``prompt_tokens``: the
    sequence's context before generating, ``completion_tokens``, ``rounds``, ``mean_acceptance_length``).

    Raises :class:`ServerUnreachable` when nothing answers at ``url``; :class:`SessionLost` when the server
    does not hold the session or the stream broke (the server died); :class:`AtCapacity` when no session
    slot was free (after ``start_retries``); :class:`TandemClientError` with the server's message on any
    other error response, or when no response arrives within ``timeout_s``.
    """
    if sequence_id is None and sequence_start and start_retries > 0:
        args = {k: v for k, v in locals().items() if k not in ("sequence_id", "start_retries")}
        for left in range(start_retries, -1, -1):
            try:
                return generate(**args, sequence_id=new_sequence_id())
            except AtCapacity:
                if not left:
                    raise
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    for name, v in ((schema.MAX_TOKENS, max_tokens), (schema.NUM_DRAFT_TOKENS, num_draft_tokens)):
        if v is not None and not -(2**31) <= v < 2**31:  # the wire is int32: never send a wrapped value
            raise TandemClientError(f"{name} must fit in an int32 (the server's limit is far lower), got {v}")
    client = grpcclient.InferenceServerClient(check_url(url))
    sid = sequence_id if sequence_id is not None else new_sequence_id()
    try:  # the liveness check carries the routing header too: a proxy routes both requests to one server
        _check_reachable(client, url, connect_timeout_s, headers={schema.ROUTING_HEADER: str(sid)})
        inputs = []

        def add(name, arr, dtype):
            x = grpcclient.InferInput(name, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            inputs.append(x)

        if len(prompt_ids):  # a later turn may send no new tokens (the server continues from its anchor)
            add(schema.INPUT_IDS, np.asarray(prompt_ids, dtype=np.int32).reshape(-1), "INT32")
        add(schema.MAX_TOKENS, np.array([max_tokens], dtype=np.int32), "INT32")
        if spec is not None:
            add(schema.SPEC, np.array([spec.encode()], dtype=np.object_), "BYTES")
        if num_draft_tokens is not None:
            add(schema.NUM_DRAFT_TOKENS, np.array([num_draft_tokens], dtype=np.int32), "INT32")
        if stop_token_ids:
            add(schema.STOP_TOKEN_IDS, np.asarray(stop_token_ids, dtype=np.int32).reshape(-1), "INT32")
        if stop:
            add(schema.STOP, np.array([x.encode() for x in stop], dtype=np.object_), "BYTES")
        if cache_salt:
            add(schema.CACHE_SALT, np.array([cache_salt.encode()], dtype=np.object_), "BYTES")
        if response_format:
            fmt = response_format if isinstance(response_format, str) else json.dumps(response_format)
            add(schema.RESPONSE_FORMAT, np.array([fmt.encode()], dtype=np.object_), "BYTES")
        for t in schema.SAMPLING_INPUTS:
            v = (sampling or {}).get(t.name)
            if v is not None:
                dt = schema.NUMPY[t.dtype]
                add(t.name, np.array([v.encode() if isinstance(v, str) else v], dtype=dt), _TRITON[t.dtype])
        q: queue.Queue = queue.Queue()
        # the routing key a proxy reads (schema.ROUTING_HEADER; the sequence id itself sits in the protobuf body)
        client.start_stream(
            callback=lambda result, error: q.put((result, error)), headers={schema.ROUTING_HEADER: str(sid)}
        )
        out = {
            "token_ids": [],
            "rounds": 0,
            "drafted": 0,
            "accepted": 0,
            "finish_reason": None,
            "bursts": 0,
            "ttft_s": None,
            "sequence_id": sid,
            "usage": None,
            "stop_string": "",
        }
        t0 = time.perf_counter()
        completed = False
        try:
            client.async_stream_infer(
                model,
                inputs,
                sequence_id=sid,
                sequence_start=sequence_start,
                sequence_end=sequence_end,
                enable_empty_final_response=True,
            )
            while True:
                try:
                    result, error = q.get(timeout=timeout_s)
                except queue.Empty:
                    raise TandemClientError(f"no response from {model} within {timeout_s:.0f} s") from None
                if error is not None:
                    raise error_from(error, url, sid)
                resp = result.get_response()
                final = (
                    resp.parameters["triton_final_response"].bool_param
                    if "triton_final_response" in resp.parameters
                    else False
                )
                if resp.outputs:
                    ids = result.as_numpy(schema.OUTPUT_IDS).astype(np.int64).tolist()
                    if ids and out["ttft_s"] is None:
                        out["ttft_s"] = time.perf_counter() - t0
                    out["token_ids"] += ids
                    out["rounds"] += int(result.as_numpy(schema.ROUNDS)[0])
                    out["drafted"] += int(result.as_numpy(schema.DRAFTED)[0])
                    out["accepted"] += int(result.as_numpy(schema.ACCEPTED)[0])
                    out["bursts"] += 1
                    fr = result.as_numpy(schema.FINISH_REASON)[0]
                    fr = fr.decode() if isinstance(fr, bytes) else str(fr)
                    if fr:
                        out["finish_reason"] = fr
                        out["stop_string"] = result.as_numpy(schema.STOP_STRING)[0].decode()
                        out["usage"] = {
                            "prompt_tokens": int(result.as_numpy(schema.PROMPT_TOKENS)[0]),
                            "completion_tokens": int(result.as_numpy(schema.COMPLETION_TOKENS)[0]),
                            "rounds": int(result.as_numpy(schema.TOTAL_ROUNDS)[0]),
                            "mean_acceptance_length": float(result.as_numpy(schema.MEAN_ACCEPTANCE_LENGTH)[0]),
                        }
                    if ids and on_tokens is not None:
                        on_tokens(ids)
                if final:
                    t_final = time.perf_counter()
                    completed = True
                    break
        finally:
            # an abandoned turn (error, timeout, Ctrl-C) is cancelled so the server stops generating it
            client.stop_stream(cancel_requests=not completed)
    except InferenceServerException as e:
        raise error_from(e, url, sid) from None
    finally:
        client.close()
    el = t_final - t0  # not the stream's teardown after it
    out["elapsed_s"] = el
    out["tokens_per_s"] = len(out["token_ids"]) / el if el > 0 else 0.0
    out["mean_acceptance_length"] = 1.0 + out["accepted"] / out["rounds"] if out["rounds"] else None
    return out


_TRITON = {"TYPE_INT32": "INT32", "TYPE_INT64": "INT64", "TYPE_FP32": "FP32", "TYPE_STRING": "BYTES"}


def stage_infer(c, spec, inputs: list, timeout_s: float = 5.0):
    """One call of a stage model by gRPC client ``c`` (a ``tritonclient.grpc.InferenceServerClient``
    with no stream open): a unary ``infer``, or for a decoupled model (``spec.decoupled``: the
    ``trunk``) a stream that carries the request and its one response. Returns the ``InferResult``;
    raises ``InferenceServerException`` with the model's error, or "Deadline Exceeded" when no answer
    came within ``timeout_s`` seconds."""
    import queue

    from tritonclient.utils import InferenceServerException

    if not spec.decoupled:
        return c.infer(spec.name, inputs, client_timeout=timeout_s)
    got: queue.SimpleQueue = queue.SimpleQueue()
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        c.async_stream_infer(spec.name, inputs)
        try:
            result, error = got.get(timeout=timeout_s)
        except queue.Empty:
            raise InferenceServerException(
                f"Deadline Exceeded: {spec.name} did not answer within {timeout_s:g} s"
            ) from None
    finally:
        c.stop_stream(cancel_requests=True)
    if error is not None:
        raise error
    return result


def stage_health(url: str = DEFAULT_URL, timeout_s: float = 5.0) -> dict[str, str]:
    """Each model the server serves (a model of the repository it never loaded, such as the drafter models
    while the drafters run in the ``tandem`` model's process, is left out) and its state: ``READY``;
    ``NOT READY`` (Triton has not loaded it yet, or is restarting it);
    ``NOT ANSWERING`` (a stage model that does not answer an empty ``close`` within ``timeout_s``
    seconds: a hung process); ``DEAD: <reason>`` (its process is gone). Stage models are probed
    with that no-op request, since Triton reports a model ready while its process is dead.
    Raises :class:`ServerUnreachable`."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    c = grpcclient.InferenceServerClient(check_url(url))
    try:
        _check_reachable(c, url, timeout_s)
        index = c.get_model_repository_index(as_json=True, client_timeout=timeout_s).get("models", [])
        served = {m["name"] for m in index if m.get("state")}  # (a model never loaded has no state)
        out = {}
        for name, spec in {**schema.MODELS, **schema_text.MODELS}.items():
            if name not in served:
                continue
            try:
                ready = c.is_model_ready(name, client_timeout=timeout_s)
            except InferenceServerException as e:  # "Server not ready" while Triton reloads a model
                if "not ready" not in (e.message() or str(e)).lower():
                    raise
                ready = False
            if not ready:
                out[name] = "NOT READY"
                continue
            out[name] = "READY"
            if not spec.ops:
                continue
            op, sids = grpcclient.InferInput("OP", [1], "BYTES"), grpcclient.InferInput("SIDS", [0], "INT64")
            op.set_data_from_numpy(schema.string_array("close"))
            sids.set_data_from_numpy(np.zeros(0, np.int64))
            try:
                stage_infer(c, spec, [op, sids], timeout_s)
            except InferenceServerException as e:
                msg = e.message() or str(e)
                if "is not healthy" in msg:
                    out[name] = f"DEAD: {msg}"
                elif "Deadline" in msg or "timed out" in msg.lower():
                    out[name] = f"NOT ANSWERING within {timeout_s:g} s"
                # any other answer (this checkpoint has no DFlash drafter) comes from a live process
        return out
    finally:
        c.close()
