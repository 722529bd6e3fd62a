"""The OpenAI-compatible front (tandem.front.openai_api) driven by the official ``openai`` client against a real
server: chat and completions, streaming and not, equal to the tandem client's greedy turn; usage equal to the
server's own token counters; a stop string; a seed twice; OpenAI-shaped errors; a client that leaves mid-stream
cancels its turn."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from tandem.launch.host import free_ports  # noqa: E402
from tandem.launch.observe import scrape  # noqa: E402
from tandem.model.tokenizer import ChatTokenizer  # noqa: E402
from tandem_client.client import generate  # noqa: E402

from conftest import CHECKPOINT  # noqa: E402

QUESTION = "Explain what a hash table is."
TOKENS = ("tandem_prompt_tokens_total", frozenset({("model", "tandem")}))
GENERATED = ("tandem_generation_tokens_total", frozenset({("model", "tandem")}))
#: a JSON schema that does not compile (an unknown type)
BAD = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
#: a schema whose replies the miniature completes well within 120 tokens
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
CANCELLED = ("tandem_request_success_total", frozenset({("model", "tandem"), ("finished_reason", "cancelled")}))


@pytest.fixture(scope="module")
def front(server):
    """The front on a free 127.0.0.1 port against the shared server, as ``make serve`` starts it."""
    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.front.openai_api", "--grpc-url", server.grpc_url, "--port", str(port)]
        + ["--checkpoint", str(CHECKPOINT)],
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the OpenAI front did not start")
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def client(front):
    return openai.OpenAI(base_url=f"{front}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer(CHECKPOINT / "tokenizer.json")


def _settled(server, cond, timeout_s: float = 5.0) -> dict:
    """The server's metrics once ``cond(metrics)`` holds (they follow each burst), or after ``timeout_s``."""
    t0 = time.monotonic()
    while not cond(m := scrape(server.metrics_port)) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.1)
    return m


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tandem"]


@pytest.mark.parametrize("spec", ["off", "dflash2"])
def test_chat_streams_the_tandem_clients_greedy_text_and_counts_usage(server, client, tok, spec):
    start = scrape(server.metrics_port)
    ref = generate(tok.chat_prompt(QUESTION), max_tokens=40, url=server.grpc_url, spec="off")
    before = _settled(server, lambda m: m.get(GENERATED, 0) >= start.get(GENERATED, 0) + len(ref["token_ids"]))
    chunks = list(
        client.chat.completions.create(
            model="tandem",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"spec": spec},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok.decode(ref["token_ids"]) and len(text) > 20
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        "length" if len(ref["token_ids"]) == 40 else "stop"
    )
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == len(ref["token_ids"])
    assert (
        usage.prompt_tokens == len(tok.chat_prompt(QUESTION))
        and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    )
    after = _settled(server, lambda m: m.get(GENERATED, 0) - before.get(GENERATED, 0) >= usage.completion_tokens)
    assert after[GENERATED] - before.get(GENERATED, 0) == usage.completion_tokens
    assert after[TOKENS] - before.get(TOKENS, 0) == usage.prompt_tokens
    extra = usage.model_extra
    assert extra["num_accepted_tokens"] <= extra["num_draft_tokens"] and (
        spec == "dflash2" or extra["num_draft_tokens"] == 0
    )
    whole = client.chat.completions.create(
        model="tandem", messages=[{"role": "user", "content": QUESTION}], max_tokens=40
    )
    assert whole.choices[0].message.content == text and whole.usage.completion_tokens == usage.completion_tokens


@pytest.mark.parametrize("spec", ["off", "dflash2"])
def test_a_json_schema_streams_valid_json_equal_to_the_tandem_client(server, client, tok, spec):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    ask = "Describe a person."
    ref = generate(tok.chat_prompt(ask), max_tokens=120, url=server.grpc_url, spec="off", response_format=fmt)
    chunks = list(
        client.chat.completions.create(
            model="tandem",
            messages=[{"role": "user", "content": ask}],
            max_tokens=120,
            stream=True,
            stream_options={"include_usage": True},
            response_format=fmt,
            extra_body={"spec": spec},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok.decode(ref["token_ids"]) and ref["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].usage.completion_tokens == len(ref["token_ids"])
    digits = client.completions.create(  # vLLM's field for a regex
        model="tandem", prompt="My number is", max_tokens=12, extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}
    )
    assert len(digits.choices[0].text) == 4 and digits.choices[0].text.isdigit()


def test_completions_take_the_prompt_as_text(server, client, tok):
    prompt = "def fibonacci(n):"
    ref = generate(tok.encode(prompt), max_tokens=16, url=server.grpc_url, spec="off")
    got = client.completions.create(model="tandem", prompt=prompt, max_tokens=16)
    assert got.choices[0].text == tok.decode(ref["token_ids"]) and got.usage.completion_tokens == len(ref["token_ids"])


def test_a_stop_string_ends_the_text_before_it(client):
    base = client.chat.completions.create(
        model="tandem", messages=[{"role": "user", "content": QUESTION}], max_tokens=40
    )
    text = base.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    got = client.chat.completions.create(
        model="tandem", messages=[{"role": "user", "content": QUESTION}], max_tokens=40, stop=[stop]
    )
    assert got.choices[0].message.content == text[: text.index(stop)] and got.choices[0].finish_reason == "stop"


def test_a_seed_twice_gives_the_same_sample(client):
    def once(seed):
        return (
            client.chat.completions.create(
                model="tandem",
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=24,
                temperature=0.8,
                seed=seed,
                extra_body={"spec": "dflash2"},
            )
            .choices[0]
            .message.content
        )

    a, b, c = once(7), once(7), once(8)
    assert a == b and a != c


@pytest.mark.parametrize(
    "kwargs, status, param",
    [
        ({"n": 2}, 400, "n"),
        ({"temperature": 11.0}, 400, "temperature"),
        ({"seed": -1}, 400, "seed"),
        ({"extra_body": {"sampling": "greedy-ish"}}, 400, "sampling"),
        ({"extra_body": {"messages": ["hi"]}}, 400, "messages"),
        ({"extra_body": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}}, 400, "messages"),
        ({"seed": 10**30}, 400, "seed"),
        ({"extra_body": {"stream": "yes"}}, 400, "stream"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}},
            400,
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, 400, "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, 400, "structured_outputs.regex"),
        ({"extra_body": {"guided_regex": "a", "regex": "b"}}, 400, "regex"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"extra_body": {"messages": []}}, 400, "messages"),
        ({"model": "gpt-4"}, 404, "model"),
        ({"extra_body": {"spec": "medusa"}}, 400, "spec"),
        ({"max_tokens": 100000}, 400, "max_tokens"),
    ],
)
def test_errors_have_openais_shape(client, kwargs, status, param):
    """Bad fields, the server's own refusals among them (a schema that does not compile), name the field."""
    args = {"model": "tandem", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == status
    err = e.value.body
    assert err["param"] == param and err["type"] and err["message"]


def test_a_streamed_request_the_server_refuses_gets_its_status(client):
    """A refusal that comes from the server (a schema that does not compile) answers a streamed request with
    its status too, not a 200 stream holding an error; the message is the engine's, without its log prefix."""
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(
            model="tandem",
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=8,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}},
        )
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "response_format"
    assert (
        err["message"].startswith("response_format.json_schema.schema does not compile: ")
        and ".cc:" not in err["message"]
    )


def test_a_long_prompt_a_big_body_and_a_wrong_path_answer_in_the_apis_shape(front):
    def post(path, data: bytes):
        req = urllib.request.Request(f"{front}{path}", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    long = {"model": "tandem", "messages": [{"role": "user", "content": "sea " * 5000}], "max_tokens": 4}
    status, body = post("/v1/chat/completions", json.dumps(long).encode())
    assert status == 400 and body["error"]["param"] == "messages" and "4096" in body["error"]["message"]
    host, port = front.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Length", str(2 << 20))  # over the 1 MiB default: refused before the body is sent
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 413 and json.loads(r.read())["error"]["code"] == "request_too_large"
    conn.close()
    status, body = post("/v1/no_such_path", b"{}")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    status, body = post("/v1/chat/completions", b'{"model": "tandem", "messages": [')
    assert status == 400 and body["error"]["message"] == "the body is not valid JSON"


def test_images_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="only text parts are served"):
        client.chat.completions.create(
            model="tandem",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        )


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_turn(server, front, stream):
    before = scrape(server.metrics_port)  # (the count of cancelled turns changes only by a cancel)
    body = json.dumps(
        {"model": "tandem", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 3000, "stream": stream}
    ).encode()
    req = urllib.request.Request(
        f"{front}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    if stream:
        r = urllib.request.urlopen(req, timeout=30)
        assert r.readline().startswith(b"data: ")
        r.close()  # gone mid-stream
    else:
        host, port = front.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        time.sleep(0.5)
        conn.close()  # gives up waiting for the whole reply: gone
    now = _settled(server, lambda m: m.get(CANCELLED, 0) > before.get(CANCELLED, 0), 10.0)
    assert now.get(CANCELLED, 0) == before.get(CANCELLED, 0) + 1
