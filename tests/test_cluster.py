"""Integration: two tritonservers behind HAProxy on loopback (``running_cluster``).

Which server served a request is read from two independent places: HAProxy's log (one line per
stream: the ``x-tandem-session`` key and the server name) and each server's own Prometheus counters
(sessions opened, turns finished). Affinity: 8 sessions x 3 turns, each session's turns on one server,
both servers used. Server loss: server A killed (SIGKILL of its process group) cuts its streaming turn
with ``SessionLost`` and answers its sessions' next turns with ``SessionLost`` within 5 s, while B's
sessions stream on; re-primed conversations equal an uninterrupted run token for token. Server return:
A restarted; re-primed sessions stay on B, new sessions reach A. Capacity: a full server refuses a
first turn "at capacity"; the client retries under a new id and the proxy sends it to the other server.
``make serve-cluster``'s command stops everything on SIGINT. Without a server: the HAProxy config, the
client's error typing and Conversation's transcript.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("tritonclient.grpc")

from tandem import schema  # noqa: E402
from tandem.serving.observe import scrape, tandem_metrics  # noqa: E402
from tandem_client.client import AtCapacity, SessionLost, TandemClientError, generate, new_sequence_id  # noqa: E402
from tandem_client.conversation import Conversation  # noqa: E402

from conftest import CHECKPOINT, long_turn_prompt  # noqa: E402
from test_faults_served import wait_for  # noqa: E402

pytestmark = pytest.mark.integration

MAX_SESSIONS = 8
ENV = {"TANDEM_MAX_SESSIONS": str(MAX_SESSIONS), "TANDEM_ADMISSION_WAIT_S": "0.5"}
TEXTS = ["Write a haiku about the sea.", "What is a hash table?", "Name three rivers.", "Explain recursion.",
         "Give me a recipe for bread.", "Why is the sky blue?"]
LATER = ["Tell me more.", "Now say it in one line."]
STATE: dict = {}


@pytest.fixture(scope="module")
def cluster():
    from tandem.serving.cluster import running_cluster

    if not (CHECKPOINT / "model.safetensors").exists():
        pytest.skip(f"{CHECKPOINT} has no model.safetensors")
    with running_cluster(2, env={"TANDEM_CHECKPOINT": str(CHECKPOINT.resolve()), **ENV},
                         models=tuple(schema.MODELS), ready_timeout_s=300) as c:
        yield c


def counters(c, i: int) -> tuple[float, float]:
    """Server i's own counts: sessions opened, turns finished (any reason)."""
    port = c.ports[i][2]
    done = sum(v for (name, _), v in scrape(port).items() if name == "tandem_request_success_total")
    return tandem_metrics(port)["tandem"]["sessions_opened"], done


def streams(c) -> dict[str, list[str]]:
    """Routing key -> the server of each of its turn streams, in order (HAProxy's log)."""
    out: dict[str, list[str]] = {}
    for r in c.routed():
        if r["path"].endswith("/ModelStreamInfer"):
            out.setdefault(r["key"], []).append(r["server"])
    return out


def test_each_session_stays_on_one_server(cluster, tokenizer):
    """8 sessions x 3 turns at once through the proxy: HAProxy routed every turn of a session (and its
    liveness calls) to one server, both servers took sessions, and each server's own counters show
    exactly the sessions and turns the log gives it."""
    before = [counters(cluster, i) for i in range(2)]
    sids, errors = [new_sequence_id() for _ in range(8)], []

    def session(k: int) -> None:
        try:
            for t in range(3):
                prompt = tokenizer.chat_prompt(TEXTS[k % len(TEXTS)] if t == 0 else LATER[t - 1], later=t > 0)
                generate(prompt, 8, url=cluster.url, sequence_id=sids[k], sequence_start=t == 0, sequence_end=t == 2)
        except TandemClientError as e:
            errors.append(str(e))
    threads = [threading.Thread(target=session, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors
    keys = {str(s) for s in sids}
    wait_for(lambda: all(len(streams(cluster).get(k, [])) == 3 for k in keys), 5.0)
    routed = streams(cluster)
    per = {k: set(routed[k]) for k in keys}
    assert all(len(v) == 1 for v in per.values()), per
    live = [r for r in cluster.routed() if r["key"] in keys and r["path"].endswith("/ServerLive")]
    assert len(live) == 24 and all({r["server"]} == per[r["key"]] for r in live)
    count = {n: sum(per[k] == {n} for k in keys) for n in cluster.names}
    assert min(count.values()) >= 1 and sum(count.values()) == 8, count
    for i, name in enumerate(cluster.names):  # the servers' own view (published once a second)
        want = (before[i][0] + count[name], before[i][1] + 3 * count[name])
        wait_for(lambda: counters(cluster, i) == want, 5.0)
    print(f"affinity: sessions per server {count}")


def _reference(url: str, tokenizer, text: str) -> list[list[int]]:
    conv = Conversation(url, stop_ids=tokenizer.stop_ids)
    out = [conv.turn(tokenizer.chat_prompt(text), 12)["token_ids"]]
    out += [conv.turn(tokenizer.chat_prompt(LATER[t], later=True), 12, end=t == 1)["token_ids"] for t in range(2)]
    return out


def test_server_loss_gives_session_lost_and_reprime_equals_reference(cluster, tokenizer):
    """A long turn streams on server A; A is killed. That stream ends in SessionLost within 5 s; each
    of A's conversations gets SessionLost on its next turn within 5 s; B's conversations go on; the
    re-primed conversations (a new sequence id carrying the transcript) reach B and every turn's greedy
    output equals an uninterrupted run's."""
    refs = [_reference(cluster.url, tokenizer, text) for text in TEXTS]
    convs = [Conversation(cluster.url, stop_ids=tokenizer.stop_ids) for _ in TEXTS]
    for conv, text, ref in zip(convs, TEXTS, refs):
        assert conv.turn(tokenizer.chat_prompt(text), 12)["token_ids"] == ref[0]
    on = {}
    wait_for(lambda: all(len(streams(cluster).get(str(c.sequence_id), [])) == 1 for c in convs), 5.0)
    for k, conv in enumerate(convs):
        on[k] = streams(cluster)[str(conv.sequence_id)][0]
    assert set(on.values()) == set(cluster.names), on
    # a long turn streaming when its server dies; its server (by the servers' own turns_running gauge) is A
    box, first = {}, threading.Event()

    def stream() -> None:
        try:
            box["res"] = generate(list(long_turn_prompt(3000)), 4000, url=cluster.url, spec="off",
                                  on_tokens=lambda ids: first.set())
        except TandemClientError as e:
            box["err"], box["t"] = e, time.monotonic()
    th = threading.Thread(target=stream)
    th.start()
    assert first.wait(60)
    running, _ = wait_for(lambda: [i for i in range(2)
                                   if tandem_metrics(cluster.ports[i][2])["tandem"]["turns_running"] == 1], 5.0)
    a = running[0]
    name_a, name_b = cluster.names[a], cluster.names[1 - a]
    assert not box, "the long turn ended before the kill"
    t_kill = time.monotonic()
    cluster.kill(a)
    th.join(30)
    assert isinstance(box.get("err"), SessionLost), box
    lost_inflight = box["t"] - t_kill
    assert lost_inflight < 5.0
    lat = []
    for k, conv in enumerate(convs):
        prompt = tokenizer.chat_prompt(LATER[0], later=True)
        if on[k] == name_a:
            old, t0 = conv.sequence_id, time.monotonic()
            with pytest.raises(SessionLost, match=r"session lost"):
                conv.turn(prompt, 12)
            lat.append(time.monotonic() - t0)
            res = conv.turn(prompt, 12)  # the re-prime
            assert res["reprimed"] and res["sequence_id"] != old
        else:
            res = conv.turn(prompt, 12)
            assert not res["reprimed"]
        assert res["token_ids"] == refs[k][1], k
    assert lat and max(lat) < 5.0, lat
    for k, conv in enumerate(convs):
        assert conv.turn(tokenizer.chat_prompt(LATER[1], later=True), 12)["token_ids"] == refs[k][2], k
    s = streams(cluster)
    assert all(s[str(conv.sequence_id)][-1] == name_b for conv in convs)  # every live session now on B
    STATE.update(convs=convs, a=a)
    print(f"failover: in-flight stream lost after {lost_inflight:.2f} s, next turns of A's "
          f"{len(lat)} sessions after {max(lat):.3f} s at most")


def test_server_return_takes_new_sessions_only(cluster, tokenizer):
    """A restarts on its ports: the re-primed (and B's own) sessions stay on B; new sessions reach A,
    by HAProxy's log and A's own session counter."""
    if not STATE:
        pytest.skip("needs the server-loss test's sessions")
    a, convs = STATE["a"], STATE["convs"]
    name_a, name_b = cluster.names[a], cluster.names[1 - a]
    cluster.start(a)
    up = f"Server tandem_replicas/{name_a} is UP"  # HAProxy's checks see it ready (rise 2, 1 s apart while down)
    wait_for(lambda: up in cluster.proxy_log.read_text(errors="replace"), 10.0)
    old = [str(conv.sequence_id) for conv in convs]
    for conv in convs:
        conv.turn(tokenizer.chat_prompt("Thanks.", later=True), 4, end=True)
    new = [generate(tokenizer.chat_prompt(TEXTS[k]), 4, url=cluster.url)["sequence_id"] for k in range(6)]
    wait_for(lambda: all(str(s) in streams(cluster) for s in new), 5.0)
    s = streams(cluster)
    assert all(s[k][-1] == name_b and len(s[k]) >= 2 for k in old), {k: s[k] for k in old}
    got = {str(sid): s[str(sid)][0] for sid in new}
    assert sum(v == name_a for v in got.values()) >= 1, got
    n_a = sum(v == name_a for v in got.values())
    wait_for(lambda: counters(cluster, a)[0] == n_a, 5.0)
    print(f"return: new sessions {list(got.values())}")


def test_full_server_refuses_at_capacity_and_the_retry_goes_elsewhere(cluster, tokenizer):
    """Server 0 holds MAX_SESSIONS idle sessions (opened on its own port): a first turn there is
    refused "at capacity" (AtCapacity); through the proxy, first turns retried under new ids all
    complete, on server 1, and server 0 counts its refusals."""
    direct = f"127.0.0.1:{cluster.ports[0][1]}"
    held = [new_sequence_id() for _ in range(MAX_SESSIONS)]
    for sid in held:
        generate([5, 6, 7], 1, url=direct, sequence_id=sid, sequence_end=False, spec="off")
    with pytest.raises(AtCapacity, match=r"at capacity"):
        generate([5, 6, 7], 1, url=direct, spec="off")
    refused0 = tandem_metrics(cluster.ports[0][2])["tandem"].get("sessions_refused_full", 0)
    done = [generate(tokenizer.chat_prompt(TEXTS[k]), 4, url=cluster.url, start_retries=3) for k in range(4)]
    assert all(len(r["token_ids"]) >= 1 for r in done)
    s = streams(cluster)
    assert all(s[str(r["sequence_id"])] == [cluster.names[1]] for r in done)
    wait_for(lambda: tandem_metrics(cluster.ports[0][2])["tandem"].get("sessions_refused_full", 0) > refused0, 5.0)
    for sid in held:
        generate([], 1, url=direct, sequence_id=sid, sequence_start=False, sequence_end=True)


def test_serve_cluster_runs_in_the_foreground_and_ctrl_c_cleans_up(tokenizer):
    """``python -m tandem.serving.cluster serve`` (what ``make serve-cluster`` runs), one replica: it
    prints its ready line, a turn through its proxy works, and SIGINT stops the proxy and the server
    (every port free again) and removes the server's shared-memory files."""
    import re
    import signal
    import subprocess
    import sys

    from tandem.serving.host import busy_ports, free_ports, shm_files

    proxy = free_ports(1)[0]
    base = next(p for p in range(20000, 60000, 7) if busy_ports({str(q): q for q in range(p, p + 3)}) is None
                and proxy not in range(p, p + 3))
    proc = subprocess.Popen([sys.executable, "-m", "tandem.serving.cluster", "serve", "--replicas", "1", "--port",
                             str(proxy), "--base-port", str(base), "--checkpoint", str(CHECKPOINT)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "cluster ready" in line:
                break
        ready = "".join(lines)
        prefix = re.search(r"shared memory (\S+)\*", ready)
        assert prefix, ready[-3000:]
        assert shm_files(prefix.group(1))
        assert generate(tokenizer.chat_prompt("Hi!"), 4, url=f"127.0.0.1:{proxy}")["token_ids"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ports = {str(p): p for p in (proxy, base, base + 1, base + 2)}
    wait_for(lambda: busy_ports(ports) is None, 10.0)
    assert not shm_files(prefix.group(1))


def test_haproxy_config_is_valid_and_keys_on_the_routing_header(tmp_path):
    """The config ``make serve-cluster`` writes passes ``haproxy -c`` and holds what routing needs: h2
    on both sides, a stick table on the header, leastconn, health checks on each HTTP port, redispatch."""
    from tandem.serving.haproxy import ensure_haproxy, haproxy_config

    text = haproxy_config([("tandem0", 9101, 9100), ("tandem1", 9104, 9103)], 9001)
    (tmp_path / "haproxy.cfg").write_text(text)
    ensure_haproxy().check(tmp_path / "haproxy.cfg")
    for line in ("bind 127.0.0.1:9001 proto h2", f"stick on req.hdr({schema.ROUTING_HEADER})", "balance leastconn",
                 "option httpchk GET /v2/health/ready", "option redispatch",
                 "server tandem0 127.0.0.1:9101 proto h2 check port 9100",
                 "server tandem1 127.0.0.1:9104 proto h2 check port 9103"):
        assert line in text, line


def test_client_types_errors_by_marker_and_transport():
    """A broken stream (gRPC status set) and the session-lost marker give SessionLost, the at-capacity
    marker AtCapacity, any other server message a plain TandemClientError."""
    from tritonclient.utils import InferenceServerException

    from tandem_client.client import error_from

    broken = error_from(InferenceServerException("Socket closed", status="StatusCode.UNAVAILABLE"), "h:1", 7)
    assert type(broken) is SessionLost and "sequence 7" in str(broken) and schema.SESSION_LOST_MARKER in str(broken)
    lost = error_from(InferenceServerException(f"sequence_id: unknown sequence id 7 {schema.SESSION_LOST_MARKER}"),
                      "h:1", 7)
    assert type(lost) is SessionLost
    full = error_from(InferenceServerException(f"sequence_id: no free session {schema.AT_CAPACITY_MARKER}"), "h:1", 7)
    assert type(full) is AtCapacity
    other = error_from(InferenceServerException("MAX_TOKENS must be in [1, 4096], got 0"), "h:1", 7)
    assert type(other) is TandemClientError and str(other) == "server error: MAX_TOKENS must be in [1, 4096], got 0"


def test_conversation_keeps_the_sessions_context_and_reprimes_it(monkeypatch):
    """Conversation's transcript is what the server's session holds (a reply's final template stop
    token dropped, a user stop id or a length-cut reply kept), and after SessionLost the next turn is a
    first turn under a new id carrying transcript + prompt."""
    import tandem_client.conversation as conv_mod

    sent, answers = [], [([4, 5, 99], "stop", 11), ([6, 7], "length", 11), SessionLost("gone"), ([8], "length", 12)]

    def fake(ids, max_tokens, sequence_id=None, sequence_start=True, **kw):
        sent.append((list(ids), sequence_id, sequence_start))
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return {"token_ids": a[0], "finish_reason": a[1], "sequence_id": a[2]}
    monkeypatch.setattr(conv_mod, "generate", fake)
    conv = Conversation("h:1", stop_ids=(99,))
    conv.turn([1, 2], 8)
    assert conv.transcript == [1, 2, 4, 5] and conv.sequence_id == 11
    conv.turn([3], 8)
    assert conv.transcript == [1, 2, 4, 5, 3, 6, 7]
    with pytest.raises(SessionLost):
        conv.turn([9], 8)
    assert conv.sequence_id is None and conv.transcript == [1, 2, 4, 5, 3, 6, 7]
    res = conv.turn([9], 8)
    assert res["reprimed"] and conv.sequence_id == 12 and conv.reprimes == 1
    assert sent == [([1, 2], None, True), ([3], 11, False), ([9], 11, False), ([1, 2, 4, 5, 3, 6, 7, 9], None, True)]
