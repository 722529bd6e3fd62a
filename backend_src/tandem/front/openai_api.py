"""An OpenAI-compatible HTTP API over the ``tandem`` model (FastAPI; run by :func:`main` under uvicorn).

``POST /v1/chat/completions`` renders ``messages`` with the checkpoint's chat template; ``POST /v1/completions``
takes ``prompt`` as text; ``GET /v1/models`` lists the one model. Each request is one turn of a fresh sequence on
the ``tandem`` model over gRPC streaming (:func:`tandem_client.client.generate`): a request carries its whole
conversation, as the API defines, and a later request's shared prefix (the system prompt and earlier messages)
hits the server's prefix cache. With ``stream: true`` the reply comes as server-sent events, one chunk per burst,
then ``data: [DONE]``; a client that goes away cancels its turn.

Fields: ``max_tokens`` / ``max_completion_tokens`` (default :data:`~tandem.schema_text.DEFAULT_MAX_TOKENS`),
``temperature``, ``top_p``, ``seed``, ``stop`` (a string or a list), ``stream``, ``stream_options.include_usage``,
``n`` (1 only); tandem's own as extras: ``top_k``, ``spec``, ``num_draft_tokens``, ``sampling``. ``usage`` gives
``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and the turn's speculation, as vLLM counts it:
``num_draft_tokens``, ``num_accepted_tokens``, ``mean_acceptance_length``. Fields that would change the output
and are not served (``response_format``, ``logprobs``, ``tools``, penalties, ``n`` above 1, image parts) are
refused naming them; other unknown fields are ignored, as OpenAI's API ignores them.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a field (the server's own
refusals included), 404 for another model, 429 when the server is full, 503 when it cannot be reached or is
stopping, 500 otherwise.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .. import schema, schema_text

#: the threads the turns' gRPC streams run on (each waits on its stream; asyncio's default pool has cpu + 4
#: threads, which would queue the turns past them in the front): as many as the server holds sessions by default
TURN_THREADS = schema.DEFAULTS.max_sessions
#: the model id the front serves (``GET /v1/models``; a request naming another is answered 404)
MODEL_ID = "tandem"
#: fields that would change the reply and are not served: refused when set to anything but their default
_UNSERVED = {
    "response_format": (None, {"type": "text"}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
}


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status``, ``message``, ``type``, ``param`` (the field), ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = (
            "invalid_request_error"
            if 400 <= status < 500 and status != 429
            else ("rate_limit_error" if status == 429 else "server_error")
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _number(body: dict, name: str, kind, lo=None, hi=None, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, kind) or (isinstance(v, float) and not math.isfinite(v)):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a finite number'}, got {v!r}", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        rng = f"{'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else f"{'>' if lo_open else '>='} {lo}"
        raise ApiError(400, f"{name} must be {'in ' if hi is not None else ''}{rng}, got {v}", name)
    return v


def _sampling(body: dict, name: str, wire_name: str):
    """``body[name]`` checked against the ``tandem`` wire's sampling input ``wire_name`` (its type and limits, written
    once in :data:`tandem.schema.SAMPLING_INPUTS`); None when absent."""
    w = next(t for t in schema.SAMPLING_INPUTS if t.name == wire_name)
    integer = w.dtype in ("TYPE_INT32", "TYPE_INT64")
    hi = w.hi if w.hi is not None else (2**63 - 1 if w.dtype == "TYPE_INT64" else 2**31 - 1 if integer else None)
    return _number(body, name, int if integer else (int, float), w.lo, hi, lo_open=w.lo_open)


def turn_request(body: dict, chat: bool) -> dict:
    """The tandem turn of a request body: ``{"messages" | "prompt", "max_tokens", "sampling", "stop", "spec",
    "num_draft_tokens", "stream", "include_usage"}``. Raises :class:`ApiError` (400) naming a field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    for name, ok in _UNSERVED.items():
        if name in body and body[name] not in ok:
            raise ApiError(400, f"{name} is not supported by this server", name, "unsupported_parameter")
    n = body.get("n")
    if n not in (None, 1):
        raise ApiError(400, f"n must be 1 (one choice per request), got {n!r}", "n", "unsupported_parameter")
    out: dict = {}
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
        conv = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ApiError(
                    400, f"messages[{i}] must be an object {{role, content}}, got {type(m).__name__}", "messages"
                )
            role, content = m.get("role"), m.get("content")
            if role not in ("system", "developer", "user", "assistant"):
                raise ApiError(
                    400, f"messages[{i}].role must be system, developer, user or assistant, got {role!r}", "messages"
                )
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) for p in content):
                    raise ApiError(400, f"messages[{i}].content parts must be objects {{type, text}}", "messages")
                kinds = {str(p.get("type")) for p in content}
                if kinds - {"text"}:
                    raise ApiError(
                        400,
                        f"messages[{i}].content: only text parts are served, got {sorted(kinds - {'text'})} "
                        "(image and audio inputs are not supported)",
                        "messages",
                    )
                if not all(isinstance(p.get("text"), str) for p in content):
                    raise ApiError(400, f"messages[{i}].content: a text part needs a string text", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or text parts", "messages")
            conv.append(("system" if role == "developer" else role, content))
        out["messages"] = conv
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string", "prompt")
        out["prompt"] = prompt
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    out["max_tokens"] = _number({name: mt}, name, int, 1) or schema_text.DEFAULT_MAX_TOKENS
    sampling = {
        schema.TEMPERATURE: _sampling(body, "temperature", schema.TEMPERATURE),
        schema.TOP_P: _sampling(body, "top_p", schema.TOP_P),
        schema.TOP_K: _sampling(body, "top_k", schema.TOP_K),
        schema.SEED: _sampling(body, "seed", schema.SEED),
        schema.SAMPLING: body.get("sampling"),
    }
    if sampling[schema.SAMPLING] is not None and sampling[schema.SAMPLING] not in schema.SAMPLING_MODES:
        raise ApiError(
            400, f"sampling must be one of {list(schema.SAMPLING_MODES)}, got {sampling[schema.SAMPLING]!r}", "sampling"
        )
    out["sampling"] = {k: v for k, v in sampling.items() if v is not None}
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", "stop")
    if len(stop) > schema.MAX_STOPS or any(not 1 <= len(s) <= schema.MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"stop: at most {schema.MAX_STOPS} strings of 1-{schema.MAX_STOP_CHARS} characters", "stop")
    out["stop"] = stop
    spec = body.get("spec")
    if spec is not None and spec not in schema.SPECS:
        raise ApiError(400, f"spec must be one of {list(schema.SPECS)}, got {spec!r}", "spec")
    out["spec"] = spec
    out["num_draft_tokens"] = _number(body, "num_draft_tokens", int, 0)
    if body.get("stream") not in (None, True, False):
        raise ApiError(400, f"stream must be true or false, got {body['stream']!r}", "stream")
    out["stream"] = bool(body.get("stream"))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise ApiError(400, "stream_options must be {include_usage: true | false}", "stream_options")
    out["include_usage"] = bool(opts.get("include_usage", False))
    return out


def _finish(reason: str | None) -> str:
    """tandem's finish reason (:data:`tandem.schema.FINISH_REASONS`) as OpenAI's."""
    return "length" if reason in ("length", "context") else "stop"


def _usage(res: dict) -> dict:
    u = res.get("usage") or {}
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", len(res["token_ids"]))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "num_draft_tokens": res["drafted"],
        "num_accepted_tokens": res["accepted"],
        "mean_acceptance_length": u.get("mean_acceptance_length") or res.get("mean_acceptance_length") or 1.0,
    }


class _Cancelled(Exception):
    """Raised on the stream's thread when the HTTP client left: the turn is cancelled on the server."""


#: the ``tandem`` wire's input names as the API's fields (a server refusal names the field the client sent)
_PARAMS = {
    schema.INPUT_IDS: "prompt",
    schema.MAX_TOKENS: "max_tokens",
    schema.TEMPERATURE: "temperature",
    schema.TOP_K: "top_k",
    schema.TOP_P: "top_p",
    schema.SEED: "seed",
    schema.SAMPLING: "sampling",
    schema.STOP: "stop",
    schema.SPEC: "spec",
    schema.NUM_DRAFT_TOKENS: "num_draft_tokens",
}


def _api_error(e: Exception, chat: bool = True) -> ApiError:
    """A client library error as the API's."""
    from tandem_client.client import AtCapacity, ServerUnreachable, TandemClientError

    if isinstance(e, ApiError):
        return e
    if isinstance(e, AtCapacity):
        return ApiError(429, str(e), code="at_capacity")
    if isinstance(e, ServerUnreachable):
        return ApiError(503, str(e), code="server_unavailable")
    msg = str(e).removeprefix("server error: ")
    if isinstance(e, TandemClientError):
        field = msg.split(":", 1)[0].split(" ", 1)[0].strip()
        if field.isupper() and field.replace("_", "").isalpha():  # the server's own refusal of an input
            param = "messages" if field == schema.INPUT_IDS and chat else _PARAMS.get(field, field.lower())
            return ApiError(400, param + msg[len(field) :], param)
        if "stopping" in msg or "unavailable" in msg.lower():
            return ApiError(503, msg, code="server_unavailable")
    return ApiError(500, msg)


def create_app(url: str, checkpoint: str | Path, model_id: str = MODEL_ID, max_body_bytes: int = 1 << 20):
    """The FastAPI app serving the API against the ``tandem`` model at gRPC ``url`` (``host:port``), with the
    tokenizer and chat template of ``checkpoint``; a request body over ``max_body_bytes`` is answered 413 before
    it is read whole (the launcher passes its ``--max-body-bytes``, the HTTP port's limit too)."""
    from starlette.exceptions import HTTPException
    from ..model.tokenizer import ChatTokenizer
    from tandem_client.client import IncrementalDecoder, generate

    tok = ChatTokenizer(Path(checkpoint) / "tokenizer.json")
    pool = ThreadPoolExecutor(TURN_THREADS, thread_name_prefix="openai-turn")
    app = FastAPI(title="tandem", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):  # an unknown path or method, in the API's shape
        return JSONResponse(
            {"error": {"message": str(e.detail), "type": "invalid_request_error", "param": None, "code": None}},
            status_code=e.status_code,
        )

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 past ``max_body_bytes`` (by Content-Length at once, else while it arrives)."""
        too_big = ApiError(
            413, f"the request body is over the limit of {max_body_bytes} bytes", code="request_too_large"
        )
        if int(request.headers.get("content-length") or 0) > max_body_bytes:
            raise too_big
        chunks, n = [], 0
        async for c in request.stream():
            n += len(c)
            if n > max_body_bytes:
                raise too_big
            chunks.append(c)
        return b"".join(chunks)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_id, "object": "model", "created": created, "owned_by": "tandem"}],
        }

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await read_body(request))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the body is not valid JSON") from None
        if isinstance(body, dict) and body.get("model") not in (None, model_id):
            raise ApiError(
                404,
                f"the model {body.get('model')!r} does not exist; this server serves {model_id!r}",
                "model",
                "model_not_found",
            )
        t = turn_request(body, chat)
        loop = asyncio.get_running_loop()  # the template and the tokenizer off the event loop: other requests go on
        ids = await loop.run_in_executor(pool, lambda: tok.render(t["messages"]) if chat else tok.encode(t["prompt"]))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        kind = "chat.completion" if chat else "text_completion"
        q: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()
        dec = IncrementalDecoder(tok.decode, tuple(t["stop"]))

        def on_tokens(new):
            if gone.is_set():
                raise _Cancelled()
            piece = dec.push(new)
            if piece:
                loop.call_soon_threadsafe(q.put_nowait, ("text", piece))

        def run():
            try:
                res = generate(
                    ids,
                    max_tokens=t["max_tokens"],
                    url=url,
                    spec=t["spec"],
                    num_draft_tokens=t["num_draft_tokens"],
                    on_tokens=on_tokens,
                    sampling=t["sampling"],
                    stop=t["stop"] or None,
                )
                rest = dec.flush()
                if rest:
                    loop.call_soon_threadsafe(q.put_nowait, ("text", rest))
                loop.call_soon_threadsafe(q.put_nowait, ("done", res))
            except Exception as e:  # noqa: BLE001 - every failure reaches the client as an API error
                loop.call_soon_threadsafe(q.put_nowait, ("error", e))

        worker = loop.run_in_executor(pool, run)

        def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        if not t["stream"]:
            parts, checked = [], loop.time()
            while True:
                try:
                    what, v = await asyncio.wait_for(q.get(), 0.2)
                except asyncio.TimeoutError:
                    what = None
                if loop.time() - checked >= 0.2:  # a client that left: its turn is cancelled at the next burst
                    checked = loop.time()
                    if not gone.is_set() and await request.is_disconnected():
                        gone.set()
                if what is None:
                    continue
                if what == "text":
                    parts.append(v)
                elif what == "error":
                    raise _api_error(v, chat)
                else:
                    res = v
                    break
            await worker
            text = "".join(parts)
            first = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
                if chat
                else {"index": 0, "text": text, "logprobs": None}
            )
            return {
                "id": rid,
                "object": kind,
                "created": int(time.time()),
                "model": model_id,
                "choices": [{**first, "finish_reason": _finish(res["finish_reason"])}],
                "usage": _usage(res),
            }

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, usage: dict | None = None) -> str:
            d = {"id": rid, "object": chunk_kind, "created": int(time.time()), "model": model_id, "choices": choices}
            if usage is not None or t["include_usage"]:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        async def events():
            sent_first = False
            try:
                while True:
                    what, v = await q.get()
                    if what == "text":
                        yield event([choice(v, None, first=not sent_first)])
                        sent_first = True
                    elif what == "error":
                        yield f"data: {json.dumps(_api_error(v, chat).body())}\n\n"
                        break
                    else:
                        if not sent_first and chat:
                            yield event([choice("", None, first=True)])
                        yield event([choice(None, _finish(v["finish_reason"]))])
                        if t["include_usage"]:
                            yield event([], _usage(v))
                        yield "data: [DONE]\n\n"
                        break
            finally:  # the client left (or the stream ended): a turn still running is cancelled
                gone.set()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    return app


def main() -> None:
    """``python -m tandem.front.openai_api --grpc-url HOST:PORT --port N [--host 127.0.0.1] [--checkpoint DIR]``."""
    import argparse

    import uvicorn

    from tandem_client.client import default_checkpoint

    ap = argparse.ArgumentParser(description="tandem's OpenAI-compatible front")
    ap.add_argument("--grpc-url", default="127.0.0.1:8001", help="the tandem server's gRPC host:port")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=8003)
    ap.add_argument("--checkpoint", default=None, help="folder with tokenizer.json (default: the served one)")
    ap.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 past it)")
    a = ap.parse_args()
    app = create_app(a.grpc_url, a.checkpoint or default_checkpoint(), max_body_bytes=a.max_body_bytes)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
