"""Integration: the prefix cache does not tell one tenant another tenant's prompt by timing.

Against a real tritonserver (the shared ``server`` fixture), over tritonclient gRPC streaming to the
``tandem`` model: tenant A (``CACHE_SALT`` "a") primes a long system prompt; tenant B then guesses it
among wrong prompts of the same length. B's right guess must take as long to its first token as the
wrong ones (medians within 1.2x): A's blocks are invisible outside A's namespace. The control: the
same prompt under A's salt is a cache hit (``tandem_prefix_cache_hits_total``) with a much lower TTFT.

Each of B's requests is a first prompt in a namespace of B's own (``b-<i>``): a repeat of the right
guess under one salt would hit B's own first copy, which tells B nothing about A but would hide the
measurement.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")

from tandem import schema  # noqa: E402
from tandem.launch.observe import tandem_metrics  # noqa: E402
from tandem_client.client import TandemClientError, generate  # noqa: E402

from conftest import settled  # noqa: E402

pytestmark = pytest.mark.integration

#: prompt length: 6 whole 64-token blocks can come from the cache (the last row always runs)
PROMPT_TOKENS = 400
WRONG, RIGHT = 19, 5


def _prompt(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 8000, PROMPT_TOKENS).tolist()


def _hits(srv) -> float:
    return tandem_metrics(srv.metrics_port).get("tandem", {}).get("prefix_cache_hits_total", 0.0)


def _hits_reach(srv, want: float, timeout_s: float = 10.0) -> float:
    """The hit counter once it reaches ``want`` (the metrics are published every few hundred ms), or its
    value at ``timeout_s``."""
    t0 = time.monotonic()
    while (h := _hits(srv)) < want and time.monotonic() - t0 < timeout_s:
        time.sleep(0.2)
    return h


def _ttft(srv, ids: list[int], salt: str) -> float:
    res = generate(ids, max_tokens=2, url=srv.grpc_url, spec=schema.OFF, cache_salt=salt)
    assert res["finish_reason"] == "length", res
    return res["ttft_s"]


def test_a_right_guess_from_another_tenant_is_timed_like_a_wrong_one(server):
    secret = _prompt(1)
    for i in range(3):  # warm the server's paths up (cold prompts of the same length)
        _ttft(server, _prompt(100 + i), f"warmup-{i}")
    h0 = settled(lambda: _hits(server))  # (the shared server's count so far)
    for _ in range(2):  # tenant A primes its system prompt; the second is a hit in A's namespace
        _ttft(server, secret, "a")
    h1 = _hits_reach(server, h0 + 1)
    assert h1 == h0 + 1, (h0, h1)

    wrong = [_prompt(200 + i) for i in range(WRONG)]
    right_at = {2 + 5 * j for j in range(RIGHT)}  # the right guess interleaved among the wrong ones
    right_t, wrong_t = [], []
    for i in range(WRONG + RIGHT):
        if i in right_at:
            right_t.append(_ttft(server, secret, f"b-{i}"))
        else:
            wrong_t.append(_ttft(server, wrong.pop(), f"b-{i}"))
    time.sleep(1.0)
    assert _hits(server) == h1  # not one of B's guesses was served from the cache
    r, w = statistics.median(right_t), statistics.median(wrong_t)
    print(f"tenant B ttft median: right guess {r * 1e3:.1f} ms, wrong guesses {w * 1e3:.1f} ms")
    assert 1 / 1.2 <= r / w <= 1.2, (right_t, wrong_t)

    control = [_ttft(server, secret, "a") for _ in range(3)]  # the same prompt in A's namespace: hits
    c = statistics.median(control)
    print(f"tenant A ttft median (cache hit): {c * 1e3:.1f} ms")
    assert _hits_reach(server, h1 + 3) == h1 + 3
    assert c < 0.6 * w, (control, wrong_t)


def test_an_oversize_salt_is_refused_naming_the_field(server):
    with pytest.raises(TandemClientError, match=f"{schema.CACHE_SALT}.*{schema.MAX_CACHE_SALT_BYTES}"):
        generate(
            _prompt(3)[:20],
            max_tokens=2,
            url=server.grpc_url,
            spec=schema.OFF,
            cache_salt="x" * (schema.MAX_CACHE_SALT_BYTES + 1),
        )


def test_the_ensemble_passes_cache_salt_through(server):
    """Over HTTP ``generate`` on the ``ensemble``: a repeat of a long prompt under the same
    ``cache_salt`` is a hit, under another salt it is not, and the text is the same either way."""
    import json
    import urllib.request

    def post(salt: str) -> str:
        body = {"text_input": "Tell me about the sea. " * 30, "max_tokens": 8, "spec": schema.OFF, "cache_salt": salt}
        req = urllib.request.Request(
            f"http://127.0.0.1:{server.http_port}/v2/models/ensemble/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["text_output"]

    h0 = settled(lambda: _hits(server))  # (the shared server's count so far)
    first = post("ens-1")
    assert post("ens-2") == first
    time.sleep(1.0)
    assert _hits(server) == h0
    assert post("ens-1") == first
    assert _hits_reach(server, h0 + 1) == h0 + 1
