"""An OpenAI-compatible HTTP API over the ``tandem`` model (FastAPI; run by :func:`main` under uvicorn).

``POST /v1/chat/completions`` renders ``messages`` with the checkpoint's chat template; ``POST /v1/completions``
takes ``prompt`` as text; ``GET /v1/models`` lists the one model. Each request is one turn of a fresh sequence on
the ``tandem`` model over gRPC streaming (:func:`tandem_client.client.generate`): a request carries its whole
conversation, as the API defines, and a later request's shared prefix (the system prompt and earlier messages)
hits the server's prefix cache. With ``stream: true`` the reply comes as server-sent events, one chunk per burst,
then ``data: [DONE]``; a client that goes away cancels its turn.

Fields: ``max_tokens`` / ``max_completion_tokens`` (default :data:`~tandem.schema_text.DEFAULT_MAX_TOKENS`),
``temperature``, ``top_p``, ``seed``, ``stop`` (a string or a list), ``stream``, ``stream_options.include_usage``,
``n`` (1 only), ``response_format`` (structured output: :func:`response_format`, which also takes vLLM's
``structured_outputs`` / ``guided_*`` and SGLang's ``regex`` / ``ebnf``); tandem's own as extras: ``top_k``,
``spec``, ``num_draft_tokens``, ``sampling``. ``usage`` gives
``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and the turn's speculation, as vLLM counts it:
``num_draft_tokens``, ``num_accepted_tokens``, ``mean_acceptance_length``. Fields that would change the output
and are not served (``logprobs``, ``tools``, penalties, ``n`` above 1, image parts) are
refused naming them; other unknown fields are ignored, as OpenAI's API ignores them.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a field (the server's own
refusals included), 404 for another model, 429 when the server is full, 503 when it cannot be reached or is
stopping, 500 otherwise.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .. import schema
from .openai_request import ApiError, api_error, finish_reason, turn_request, usage

#: the threads the turns' gRPC streams run on (each waits on its stream; asyncio's default pool has cpu + 4
#: threads, which would queue the turns past them in the front): as many as the server holds sessions by default
TURN_THREADS = schema.DEFAULTS.max_sessions
#: the model id the front serves (``GET /v1/models``; a request naming another is answered 404)
MODEL_ID = "tandem"


class _Cancelled(Exception):
    """Raised on the stream's thread when the HTTP client left: the turn is cancelled on the server."""


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
                    response_format=t["response_format"],
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
                    raise api_error(v, chat, t["format_field"])
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
                "choices": [{**first, "finish_reason": finish_reason(res["finish_reason"])}],
                "usage": usage(res),
            }

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, totals: dict | None = None) -> str:
            d = {"id": rid, "object": chunk_kind, "created": int(time.time()), "model": model_id, "choices": choices}
            if totals is not None or t["include_usage"]:
                d["usage"] = totals
            return f"data: {json.dumps(d)}\n\n"

        # the first item before the first byte: a refusal (a format that does not compile, a full server) gets its
        # status, not a 200 stream holding an error; meanwhile a client that leaves cancels its turn
        while True:
            try:
                head = await asyncio.wait_for(q.get(), 0.2)
                break
            except asyncio.TimeoutError:
                if not gone.is_set() and await request.is_disconnected():
                    gone.set()
        if head[0] == "error":
            raise api_error(head[1], chat, t["format_field"])

        async def events():
            sent_first, pending = False, head
            try:
                while True:
                    (what, v), pending = (pending, None) if pending is not None else (await q.get(), None)
                    if what == "text":
                        yield event([choice(v, None, first=not sent_first)])
                        sent_first = True
                    elif what == "error":
                        yield f"data: {json.dumps(api_error(v, chat, t['format_field']).body())}\n\n"
                        break
                    else:
                        if not sent_first and chat:
                            yield event([choice("", None, first=True)])
                        yield event([choice(None, finish_reason(v["finish_reason"]))])
                        if t["include_usage"]:
                            yield event([], usage(v))
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
