"""The bounded HTTP front (HAProxy on the public HTTP and metrics ports, tandem.launch.http_front): a body
over the limit is answered 413 at once on every path, a chunked body 411, and the server, and a stream
running meanwhile, carry on untouched; small requests pass through; the front stops with its server (a
killed one here; a clean stop: the shared ``server`` fixture's, in conftest.py)."""

import http.client
import json
import os
import signal
import socket
import threading
import time

import pytest

from tandem.launch.haproxy import ensure_haproxy
from tandem.launch.http_front import MAX_BODY_BYTES, front_config

PROMPT = "Write a haiku about the sea."
#: every kind of HTTP path: text generate / stream, a model's infer, a model that does not exist, the repository
PATHS = (
    "/v2/models/ensemble/generate",
    "/v2/models/ensemble/generate_stream",
    "/v2/models/tandem/infer",
    "/v2/models/no_such_model/infer",
    "/v2/repository/index",
)
BIG = (5_000_000, 50_000_000)


def _json_body(n: int) -> bytes:
    """A valid JSON generate body of exactly ``n`` bytes."""
    head, tail = b'{"text_input": "', b'"}'
    return head + b"a" * (n - len(head) - len(tail)) + tail


def _read_response(f) -> tuple[int, dict, bytes]:
    status = int(f.readline().split()[1])
    headers = {}
    while line := f.readline().rstrip(b"\r\n"):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, f.read(int(headers.get("content-length", "0")))


def _post_raw(port: int, path: str, body: bytes, chunked: bool = False) -> tuple[int, bytes, float]:
    """POST ``body`` to ``127.0.0.1:port path`` the way a client that does not wait for an answer sends it
    (the whole body, from a thread, while the answer is read). Returns (status, answer body, seconds until
    the answer was read)."""
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode()
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)

    def send() -> None:
        try:
            s.sendall(head)
            step = 1 << 20
            for off in range(0, len(body), step):
                piece = memoryview(body)[off : off + step]
                s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n" if chunked else piece)
            if chunked:
                s.sendall(b"0\r\n\r\n")
        except OSError:  # the front answered and closed before the whole body was sent
            pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        with s.makefile("rb") as f:
            status, _, answer = _read_response(f)
        took = time.monotonic() - t0
    finally:
        s.close()
        sender.join(timeout=10)
    return status, answer, took


def _get(port: int, path: str) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def _stream(port: int, events: list, finished: threading.Event) -> None:
    """A greedy 64-token generate_stream turn of PROMPT; appends (monotonic time, event) per SSE event."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        c.request(
            "POST",
            "/v2/models/ensemble/generate_stream",
            body=json.dumps({"text_input": PROMPT, "max_tokens": 64, "stream": True}),
            headers={"Content-Type": "application/json"},
        )
        r = c.getresponse()
        assert r.status == 200, r.read()
        for line in r:
            if line.startswith(b"data: "):
                events.append((time.monotonic(), json.loads(line[len(b"data: ") :])))
    finally:
        c.close()
        finished.set()


def _summary(events: list) -> tuple[str, int, str]:
    ev = [e for _, e in events]
    assert ev and all("error" not in e for e in ev), ev
    return "".join(e["text_output"] for e in ev), ev[-1]["completion_tokens"], ev[-1]["finish_reason"]


def test_front_config_states_the_limit_and_haproxy_accepts_it(tmp_path):
    cfg = front_config([("http", 18000, 41000), ("metrics", 18002, 41001)], max_body_bytes=12345)
    assert cfg.count("req.hdr_val(content-length) gt 12345") == 2 and cfg.count("status 413") == 2
    assert cfg.count("status 411") == 2 and "over the limit of 12345 bytes (tandem serve --max-body-bytes)" in cfg
    assert "bind 127.0.0.1:18000 proto h1" in cfg and "server triton 127.0.0.1:41000" in cfg
    assert "bind 127.0.0.1:18002 proto h1" in cfg and "server triton 127.0.0.1:41001" in cfg
    assert "timeout http-request 10s" in cfg and "timeout server 600s" in cfg and "option http-no-delay" in cfg
    assert "option http-server-close" in cfg  # no idle connection holds Triton's graceful stop
    assert f"gt {MAX_BODY_BYTES} " in front_config([("http", 1, 2)]) and MAX_BODY_BYTES == 1 << 20
    (tmp_path / "front.cfg").write_text(cfg)
    ensure_haproxy().check(tmp_path / "front.cfg")  # raises HaproxyError with haproxy's output when refused
    with pytest.raises(ValueError, match="--max-body-bytes must be >= 1"):
        front_config([("http", 1, 2)], max_body_bytes=0)


@pytest.mark.integration
def test_big_bodies_get_413_at_once_and_a_running_stream_is_untouched(server):
    """5 MB and 50 MB bodies (Triton 2.51 itself crashes from ~4.2 MB) to every kind of path and to the
    metrics port are answered 413 within 1 s, sent one after another from before a greedy stream starts
    until it has finished; the server stays ready and the stream's text equals that of the same request
    sent alone afterwards."""
    bodies = {n: _json_body(n) for n in BIG}
    targets = [
        (port, path, n)
        for port, path in [(server.http_port, p) for p in PATHS] + [(server.metrics_port, "/metrics")]
        for n in BIG
    ]
    answers, streamed = [], threading.Event()

    def send_big_bodies() -> None:
        i = 0
        while not streamed.is_set() or i < len(targets):
            port, path, n = targets[i % len(targets)]
            answers.append((time.monotonic(), path, n, *_post_raw(port, path, bodies[n])))
            i += 1

    sender = threading.Thread(target=send_big_bodies, daemon=True)
    sender.start()
    t0 = time.monotonic()
    while not answers and time.monotonic() - t0 < 10:
        time.sleep(0.001)
    events, started = [], time.monotonic()
    try:
        _stream(server.http_port, events, streamed)
    finally:
        streamed.set()
        sender.join(timeout=60)
    assert len(answers) >= len(targets) and not sender.is_alive()
    for _, path, n, status, answer, took in answers:
        assert status == 413 and took < 1.0, (path, n, status, answer[:300], took)
        assert json.loads(answer) == {
            "error": f"request body of {n} bytes is over the limit of {MAX_BODY_BYTES} "
            "bytes (tandem serve --max-body-bytes)"
        }
    assert any(started < t < events[-1][0] for t, *_ in answers), "no big body was answered while the stream ran"
    assert _get(server.http_port, "/v2/health/ready")[0] == 200
    assert server.proc.poll() is None and "Signal (11)" not in server.log()
    alone, alone_done = [], threading.Event()
    _stream(server.http_port, alone, alone_done)
    assert _summary(events) == _summary(alone)
    assert _summary(alone)[1:] == (64, "length")


@pytest.mark.integration
def test_chunked_body_gets_411_and_the_limit_is_exact(server):
    status, answer, took = _post_raw(
        server.http_port, "/v2/models/ensemble/generate", _json_body(5_000_000), chunked=True
    )
    assert status == 411 and took < 1.0, (status, answer[:300])
    assert "must have a Content-Length" in json.loads(answer)["error"]
    status, answer, _ = _post_raw(
        server.http_port, "/v2/models/ensemble/generate", b'{"text_input": "Hi"}', chunked=True
    )
    assert status == 411, answer  # a small chunked body too: the rule is the framing, not the size
    # exactly the limit reaches Triton (which has no such model); one byte more does not
    status, answer, _ = _post_raw(server.http_port, "/v2/models/no_such_model/infer", _json_body(MAX_BODY_BYTES))
    assert status == 404 and b"no_such_model" in answer, answer[:300]
    status, answer, _ = _post_raw(server.http_port, "/v2/models/no_such_model/infer", _json_body(MAX_BODY_BYTES + 1))
    assert status == 413, answer[:300]
    assert _get(server.http_port, "/v2/health/ready")[0] == 200


@pytest.mark.integration
def test_small_requests_pass_through_the_front(server):
    c = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        c.request(
            "POST",
            "/v2/models/ensemble/generate",
            body=json.dumps({"text_input": PROMPT, "max_tokens": 8}),
            headers={"Content-Type": "application/json"},
        )
        r = c.getresponse()
        out = json.loads(r.read())
    finally:
        c.close()
    assert r.status == 200 and out["completion_tokens"] == 8 and out["text_output"], out
    status, text = _get(server.metrics_port, "/metrics")
    assert status == 200 and b"nv_inference_request_success" in text
    for port in (server.http_port, server.internal_http_port):  # the front and Triton's own port behind it
        assert _get(port, "/v2/health/ready")[0] == 200
    assert {server.internal_http_port, server.internal_metrics_port}.isdisjoint(
        {server.http_port, server.grpc_port, server.metrics_port}
    )


@pytest.mark.integration
def test_a_server_that_dies_takes_its_front_down():
    """Its public HTTP and metrics ports refuse connections at once: no proxy left answering 503. (A server
    of its own, with the preprocessing model alone: the front watches the tritonserver process, whatever it
    serves, and the light model starts in seconds.)"""
    from conftest import CHECKPOINT

    from tandem.launch.serve import running_server

    env = {"TANDEM_CHECKPOINT": str(CHECKPOINT.resolve())}
    with running_server(env=env, models=("preprocessing",), ready_timeout_s=240) as srv:
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.front.proc.wait(timeout=5)
        for port in (srv.http_port, srv.metrics_port):
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert not srv.front.workdir.exists()
