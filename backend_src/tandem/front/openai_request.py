"""The OpenAI API's requests and replies as tandem's: a request body checked and turned into a ``tandem`` turn
(:func:`turn_request`, structured output by :func:`response_format`), tandem's finish reasons and usage as the
API's, and a refusal as an OpenAI-shaped :class:`ApiError` naming the field the client sent (:func:`api_error`).
Runs in the front's process (:mod:`tandem.front.openai_api`); no web framework here.
"""

from __future__ import annotations

import json
import math

from .. import schema, schema_text

#: fields that would change the reply and are not served: refused when set to anything but their default
_UNSERVED = {
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


#: the structured-output fields a request may use (one at most): OpenAI's, vLLM's and SGLang's
FORMAT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
    "regex",
    "ebnf",
)


def _choice_grammar(choices, field: str) -> dict:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ApiError(400, f"{field} must be a non-empty list of non-empty strings", field)
    return {"type": "grammar", "grammar": "root ::= " + " | ".join(json.dumps(c) for c in choices)}


def response_format(body: dict) -> tuple[dict | None, str | None]:
    """The request's structured output as the ``tandem`` wire's ``RESPONSE_FORMAT`` object (None: none) and the
    field that gave it. Takes OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``; tandem's
    ``regex`` and ``grammar`` types too), vLLM's ``structured_outputs`` (``json``, ``regex``, ``grammar``,
    ``choice``) and ``guided_*`` fields, and SGLang's ``regex`` and ``ebnf``. The server checks and compiles
    it; here only its shape. Raises :class:`ApiError` (400) naming the field."""
    given = [f for f in FORMAT_FIELDS if body.get(f) is not None]
    if len(given) > 1:
        raise ApiError(400, f"give one structured-output field, got {given}", given[1])
    if not given:
        return None, None
    field = given[0]
    v = body[field]
    if field == "response_format":
        if not isinstance(v, dict) or v.get("type") not in schema.RESPONSE_FORMAT_TYPES:
            raise ApiError(
                400, f"response_format.type must be one of {list(schema.RESPONSE_FORMAT_TYPES)}", "response_format"
            )
        return (None if v["type"] == "text" else v), field
    if field == "structured_outputs":
        keys = [k for k in ("json", "regex", "grammar", "choice") if isinstance(v, dict) and v.get(k) is not None]
        if len(keys) != 1:
            raise ApiError(400, "structured_outputs must hold one of json, regex, grammar, choice", field)
        field, v = f"structured_outputs.{keys[0]}", v[keys[0]]
        kind = keys[0]
    else:
        kind = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "ebnf": "grammar"}.get(
            field, field.removeprefix("guided_")
        )
    if kind == "choice":
        return _choice_grammar(v, field), field
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ApiError(400, f"{field} must be a JSON schema: {e}", field) from None
        if not isinstance(v, dict):
            raise ApiError(400, f"{field} must be a JSON schema (an object)", field)
        return {"type": "json_schema", "json_schema": {"name": "schema", "schema": v}}, field
    if not isinstance(v, str) or not v:
        raise ApiError(400, f"{field} must be a non-empty string", field)
    return {"type": kind, kind: v}, field


def turn_request(body: dict, chat: bool) -> dict:
    """The tandem turn of a request body: ``{"messages" | "prompt", "max_tokens", "sampling", "stop", "spec",
    "num_draft_tokens", "stream", "include_usage", "response_format", "format_field"}``. Raises
    :class:`ApiError` (400) naming a field."""
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
    out["response_format"], out["format_field"] = response_format(body)
    return out


def finish_reason(reason: str | None) -> str:
    """tandem's finish reason (:data:`tandem.schema.FINISH_REASONS`) as OpenAI's."""
    return "length" if reason in ("length", "context") else "stop"


def usage(res: dict) -> dict:
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


def api_error(e: Exception, chat: bool = True, format_field: str | None = None) -> ApiError:
    """A client library error as the API's (``format_field``: the field the structured output came in, which a
    refusal of ``RESPONSE_FORMAT`` names)."""
    from tandem_client.client import AtCapacity, ServerUnreachable, TandemClientError

    if isinstance(e, ApiError):
        return e
    if isinstance(e, AtCapacity):
        return ApiError(429, str(e), code="at_capacity")
    if isinstance(e, ServerUnreachable):
        return ApiError(503, str(e), code="server_unavailable")
    msg = str(e).removeprefix("server error: ")
    if isinstance(e, TandemClientError) and msg.startswith(schema.RESPONSE_FORMAT):
        param = format_field or "response_format"
        rest = msg[len(schema.RESPONSE_FORMAT) :]
        if param != "response_format":  # the wire's object path means nothing to a client that sent another field
            rest = ":" + rest.split(":", 1)[1] if ":" in rest else rest
        return ApiError(400, param + rest, param)
    if isinstance(e, TandemClientError):
        field = msg.split(":", 1)[0].split(" ", 1)[0].strip()
        if field.isupper() and field.replace("_", "").isalpha():  # the server's own refusal of an input
            param = "messages" if field == schema.INPUT_IDS and chat else _PARAMS.get(field, field.lower())
            return ApiError(400, param + msg[len(field) :], param)
        if "stopping" in msg or "unavailable" in msg.lower():
            return ApiError(503, msg, code="server_unavailable")
    return ApiError(500, msg)
