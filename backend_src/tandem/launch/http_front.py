"""A bounded HTTP front for one tritonserver: HAProxy on the public HTTP and metrics ports.

Triton 2.51's HTTP server (its inference port and its metrics port alike) dies with ``Signal (11)`` on a
request whose ``Content-Length`` is about 4.2 MB or more, on any path, before any model sees it (Triton's
own bug, server#5840; 2.51 has no option to bound a request body). So ``tandem serve`` and
:func:`tandem.launch.serve.running_server` bind Triton's HTTP and metrics services on 127.0.0.1 at
internal free ports and put one HAProxy process (Debian's 2.6, :func:`~tandem.launch.haproxy.ensure_haproxy`)
on the public ports in front of them (:func:`front_config`):

- a request whose ``Content-Length`` is over :data:`MAX_BODY_BYTES` is answered 413 with a JSON error by
  HAProxy, and never reaches Triton;
- a request with a ``Transfer-Encoding`` body (chunked: no length known before it is read) is answered
  411: HAProxy 2.6 cannot bound such a body before forwarding it. Triton 2.51 does not crash on a
  chunked body (50 MB read to the end), but it reads and parses all of it, so chunked bodies would
  bypass the limit; tritonclient, curl ``--data-binary``, requests and Locust send ``Content-Length``;
- the public ports speak HTTP/1.1 only (``proto h1``): an HTTP/2 request may carry a body with no
  length at all, and Triton's HTTP server speaks HTTP/1.1 only anyway;
- the headers and the first buffer (16 KiB) of a body must arrive within :data:`REQUEST_TIMEOUT_S`
  (slow clients holding connections); after that, a connection idle for :data:`STREAM_TIMEOUT_S` on
  either side is closed, long enough for a server-sent-event stream of minutes;
- responses stream through unbuffered (``option http-no-delay``): each server-sent event is sent on
  as it comes;
- the connection to Triton closes after each response (``option http-server-close``; the client's may
  stay open): Triton's graceful stop waits, up to its exit timeout, for every open HTTP connection, so
  idle pooled connections would hold every stop for the whole timeout.

The gRPC port stays Triton's own: gRPC frames its messages (up to its 2 GiB maximum) and Triton 2.51 reads
and answers a 50 MB one (to a missing model, or the ensemble's stream, which refuses the oversized
``text_input``) without crashing.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from .haproxy import HaproxyError, ensure_haproxy

#: the largest request body (bytes, by ``Content-Length``) the front passes on; ``tandem serve
#: --max-body-bytes`` overrides it. 1 MiB is a quarter of the size that crashes Triton 2.51 (~4.2 MB) and
#: above any valid request: the text front refuses a ``text_input`` longer than the context can hold (256 KiB
#: for the shipped tokenizer and 4096 tokens), and 4096 token ids as JSON numbers are under 100 KB.
MAX_BODY_BYTES = 1 << 20
#: seconds a client has to send a request's headers and its first body buffer (also the keep-alive idle
#: limit between requests)
REQUEST_TIMEOUT_S = 10
#: seconds a connection may be idle on either side once a request is in flight (matches the cluster
#: proxy's 10 minutes: a streamed turn may wait in the admission queue, then stream for minutes)
STREAM_TIMEOUT_S = 600
#: the help text that names the setting, quoted in every 413 answer
LIMIT_OPTION = "tandem serve --max-body-bytes"


class FrontError(RuntimeError):
    """The front did not start or did not answer (the message carries its output)."""


def _quoted(text: str) -> str:
    """``text`` as one double-quoted HAProxy config argument (backslash escapes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def front_config(
    routes: list[tuple[str, int, int]],
    host: str = "127.0.0.1",
    max_body_bytes: int = MAX_BODY_BYTES,
    backend_host: str = "127.0.0.1",
) -> str:
    """The HAProxy config text of the front.

    ``routes``: ``(name, public port, internal port)`` each (``("http", 8000, 41234)``, ``("metrics", 8002,
    41235)``): HAProxy listens on ``host:public port`` and forwards to ``backend_host:internal port``.
    ``max_body_bytes``: the largest ``Content-Length`` passed on (a larger one gets 413 and a JSON body
    ``{"error": "request body of N bytes is over the limit of M bytes (tandem serve --max-body-bytes)"}``);
    a chunked body gets 411 with a JSON error. Raises ``ValueError`` when ``max_body_bytes`` < 1 or no
    route is given.
    """
    if max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {max_body_bytes}")
    if not routes:
        raise ValueError("the front needs at least one route")
    too_big = _quoted(
        json.dumps(
            {
                "error": f"request body of %[req.hdr_val(content-length)] bytes is over the limit "
                f"of {max_body_bytes} bytes ({LIMIT_OPTION})"
            }
        )
    )
    chunked = _quoted(
        json.dumps(
            {
                "error": "a request body must have a Content-Length (chunked transfer encoding is "
                f"refused: it cannot be bounded; the limit is {max_body_bytes} bytes, "
                f"{LIMIT_OPTION})"
            }
        )
    )
    refuse_chunked = (
        f"http-request return status 411 content-type application/json string {chunked} "
        "if { req.hdr(transfer-encoding) -m found }"
    )
    refuse_too_big = (
        f"http-request return status 413 content-type application/json lf-string {too_big} "
        f"if {{ req.hdr_val(content-length) gt {max_body_bytes} }}"
    )
    sections = []
    for name, public, internal in routes:
        sections.append(f"""
frontend {name}
    bind {host}:{public} proto h1
    {refuse_chunked}
    {refuse_too_big}
    default_backend triton_{name}

backend triton_{name}
    server triton {backend_host}:{internal}
""")
    return f"""# tandem's bounded HTTP front (generated by tandem.launch.http_front.front_config)
global
    maxconn 4096

defaults
    mode http
    option http-no-delay
    option http-buffer-request
    # no idle connection to Triton kept open: its shutdown waits (up to its exit timeout) for every open HTTP connection
    option http-server-close
    timeout connect 5s
    timeout http-request {REQUEST_TIMEOUT_S}s
    timeout http-keep-alive {REQUEST_TIMEOUT_S}s
    timeout client {STREAM_TIMEOUT_S}s
    timeout server {STREAM_TIMEOUT_S}s
{"".join(sections)}"""


class Front:
    """A running front: ``proc`` (the HAProxy process), ``routes`` (as given to :func:`front_config`),
    ``config_path``, ``log_path`` (its output: warnings and errors only, no line per request)."""

    def __init__(
        self, proc: subprocess.Popen, routes: list[tuple[str, int, int]], workdir: Path, log_path: Path
    ) -> None:
        self.proc, self.routes, self.workdir, self.log_path = proc, routes, workdir, log_path
        self.config_path = workdir / "front.cfg"
        self._unfollow = threading.Event()

    def output(self) -> str:
        """What HAProxy wrote so far ("" when nothing or when its folder is gone)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def follow(self, server: subprocess.Popen, poll_s: float = 0.2) -> None:
        """Stop the front as soon as ``server`` exits (a daemon thread polls it every ``poll_s`` s), so a
        server that dies leaves no proxy answering 503 on its ports."""

        def watch() -> None:
            while not self._unfollow.wait(poll_s):
                if server.poll() is not None:
                    self.stop()
                    return

        threading.Thread(target=watch, name="tandem-front-follow", daemon=True).start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop HAProxy (SIGTERM, then SIGKILL), end :meth:`follow`'s watch and remove the front's folder;
        a no-op when stopped."""
        self._unfollow.set()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_front(
    routes: list[tuple[str, int, int]], host: str = "127.0.0.1", max_body_bytes: int = MAX_BODY_BYTES
) -> Front:
    """Start HAProxy on :func:`front_config` ``(routes, host, max_body_bytes)``, its config and output in a
    new temporary folder (removed by :meth:`Front.stop`). It binds at once; :func:`wait_front` waits until
    it answers. Raises ``ValueError`` for a bad limit, :class:`~tandem.launch.haproxy.HaproxyError` when
    HAProxy cannot be installed or rejects the config."""
    cfg = front_config(routes, host, max_body_bytes)
    haproxy = ensure_haproxy()
    workdir = Path(tempfile.mkdtemp(prefix="tandem-front-"))
    try:
        (workdir / "front.cfg").write_text(cfg)
        log = workdir / "haproxy.log"
        proc = haproxy.popen(workdir / "front.cfg", log)
    except (OSError, HaproxyError):
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Front(proc, routes, workdir, log)


def wait_front(
    front: Front, port: int, timeout_s: float = 10.0, path: str = "/v2/health/ready", host: str = "127.0.0.1"
) -> float:
    """Poll ``GET host:port path`` through the front until it answers 200 (``host`` as bound; a wildcard
    address is polled on 127.0.0.1). Returns seconds waited. Raises :class:`FrontError` with HAProxy's
    output when it exits or does not answer within ``timeout_s``."""
    addr = "127.0.0.1" if host in ("", "0.0.0.0", "::", "*") else host
    addr = f"[{addr}]" if ":" in addr else addr
    t0 = time.monotonic()
    while True:
        if front.proc.poll() is not None:
            raise FrontError(f"the HTTP front (haproxy) exited with code {front.proc.returncode}\n{front.output()}")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(f"http://{addr}:{port}{path}", timeout=1.0) as r:
                if r.status == 200 and front.proc.poll() is None:
                    return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise FrontError(
                f"the HTTP front on {addr}:{port} does not answer {path} after {timeout_s:.0f} s\n{front.output()}"
            )
        time.sleep(0.05)
