"""Integration: two tritonservers behind HAProxy on loopback (``running_cluster``).

Which server served a request is read from two independent places: HAProxy's log (one line per
stream: the ``x-tandem-session`` key and the server name) and each server's own Prometheus counters
(sessions opened, turns finished). Affinity: 8 sessions x 3 turns, each session's turns on one server,
both servers used. Deterministic routing: a second proxy and a restarted one send 8 of 8 live sessions
to the servers holding them. A client without the routing header gets an error naming it. A stall: a
server's tritonserver paused (SIGSTOP) for 3.2 s keeps every stream and session. Server loss: server
A killed (SIGKILL of its process group) cuts its streaming turn with ``SessionLost`` and answers its
sessions' next turns with ``SessionLost`` within 5 s, while B's sessions stream on; re-primed
conversations equal an uninterrupted run token for token. Server return: A restarted; re-primed
sessions stay on B (the proxy's stick table), new sessions reach A. Capacity: a full server refuses a
first turn "at capacity"; the client retries under a new id, which may hash to the other server.
``make serve-cluster``'s command stops everything on SIGINT. Without a server: the HAProxy config, the
client's error typing and Conversation's transcript.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import pytest

pytest.importorskip("tritonclient.grpc")

from tandem import schema  # noqa: E402
from tandem.launch.observe import scrape, tandem_metrics  # noqa: E402
from tandem_client.client import AtCapacity, SessionLost, TandemClientError, generate, new_sequence_id  # noqa: E402
from tandem_client.conversation import Conversation  # noqa: E402

from conftest import CHECKPOINT, long_turn_prompt  # noqa: E402
from test_faults_served import wait_for  # noqa: E402

pytestmark = pytest.mark.integration

MAX_SESSIONS = 8
ENV = {"TANDEM_MAX_SESSIONS": str(MAX_SESSIONS), "TANDEM_ADMISSION_WAIT_S": "0.5"}
TEXTS = [
    "Write a haiku about the sea.",
    "What is a hash table?",
    "Name three rivers.",
    "Explain recursion.",
    "Give me a recipe for bread.",
    "Why is the sky blue?",
]
LATER = ["Tell me more.", "Now say it in one line."]
STATE: dict = {}


@pytest.fixture(scope="module")
def cluster():
    from tandem.launch.cluster import running_cluster

    if not (CHECKPOINT / "model.safetensors").exists():
        pytest.skip(f"{CHECKPOINT} has no model.safetensors")
    with running_cluster(
        2,
        env={"TANDEM_CHECKPOINT": str(CHECKPOINT.resolve()), **ENV},
        models=(schema.TANDEM.name,),
        ready_timeout_s=300,
    ) as c:
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


def probe(url: str, sid: int) -> None:
    """One liveness call through the proxy at ``url`` carrying ``sid`` as the routing header."""
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(url)
    try:
        assert c.is_server_live(headers={schema.ROUTING_HEADER: str(sid)}, client_timeout=5.0)
    finally:
        c.close()


def sids_per_server(c, n: int) -> dict[str, list[int]]:
    """``n`` fresh sequence ids per server of cluster ``c``, each sorted by where the proxy routes its header
    (one liveness call per candidate id: routing depends on the header value alone)."""
    got: dict[str, list[int]] = {name: [] for name in c.names}
    for _ in range(64 * n):
        if min(len(v) for v in got.values()) >= n:
            return got
        sid = new_sequence_id()
        probe(c.url, sid)
        server, _ = wait_for(lambda: next((r["server"] for r in c.routed() if r["key"] == str(sid)), None), 5.0)
        if len(got[server]) < n:
            got[server].append(sid)
    raise AssertionError(f"no {n} ids per server after {64 * n} tries: {got}")


def test_each_session_stays_on_one_server(cluster, tokenizer):
    """8 sessions x 3 turns at once through the proxy (4 whose ids route to each server): HAProxy routed
    every turn of a session (and its liveness calls) to one server, and each server's own counters show
    exactly the sessions and turns the log gives it."""
    picked = sids_per_server(cluster, 4)
    before = [counters(cluster, i) for i in range(2)]
    sids, errors = [sid for name in cluster.names for sid in picked[name]], []

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
    assert len(live) == 24 + 8 and all({r["server"]} == per[r["key"]] for r in live)  # (8: the probes)
    count = {n: sum(per[k] == {n} for k in keys) for n in cluster.names}
    assert count == {n: 4 for n in cluster.names}, count
    assert all(per[str(sid)] == {name} for name in cluster.names for sid in picked[name])
    for i, name in enumerate(cluster.names):  # the servers' own view (published once a second)
        want = (before[i][0] + count[name], before[i][1] + 3 * count[name])
        wait_for(lambda: counters(cluster, i) == want, 5.0)
    print(f"affinity: sessions per server {count}")


def test_a_second_proxy_and_a_restarted_one_route_every_live_session_to_its_server(cluster, tokenizer):
    """8 sessions open through the proxy (first turn); their second turns through a second HAProxy with
    the same config and their third turns through the first proxy restarted (its stick table gone) all
    complete: 8 of 8 reach the server that holds them, none is lost."""
    sids = [new_sequence_id() for _ in range(8)]
    for k, sid in enumerate(sids):
        generate(tokenizer.chat_prompt(TEXTS[k % len(TEXTS)]), 4, url=cluster.url, sequence_id=sid, sequence_end=False)
    keys = [str(sid) for sid in sids]
    wait_for(lambda: all(k in streams(cluster) for k in keys), 5.0)
    home = {k: streams(cluster)[k][0] for k in keys}
    second = cluster.add_proxy()
    try:
        lost = []
        for sid in sids:
            try:
                generate(
                    tokenizer.chat_prompt(LATER[0], later=True),
                    4,
                    url=second.url,
                    sequence_id=sid,
                    sequence_start=False,
                    sequence_end=False,
                )
            except TandemClientError as e:
                lost.append(str(e))
        assert not lost

        def via_second() -> dict[str, str]:
            return {r["key"]: r["server"] for r in second.routed() if r["path"].endswith("/ModelStreamInfer")}

        wait_for(lambda: all(k in via_second() for k in keys), 5.0)
        assert {k: via_second()[k] for k in keys} == home
    finally:
        second.stop()
    cluster.restart_proxy()
    for sid in sids:
        generate(
            tokenizer.chat_prompt(LATER[1], later=True),
            4,
            url=cluster.url,
            sequence_id=sid,
            sequence_start=False,
            sequence_end=True,
        )
    wait_for(lambda: all(len(streams(cluster)[k]) == 2 for k in keys), 5.0)
    s = streams(cluster)
    assert all(s[k] == [home[k]] * 2 for k in keys), {k: s[k] for k in keys}  # turns 1 and 3 (turn 2: second)
    print(f"second proxy and restarted proxy: 8 of 8 sessions on their servers ({sorted(home.values())})")


def raw_turn(url: str, ids: list[int], sid: int, start: bool, end: bool, max_tokens: int = 4) -> str | None:
    """One turn of the ``tandem`` model over tritonclient's stream without the routing header (a client
    that does not know it); returns the server's error text, None when the turn completed."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    c, q = grpcclient.InferenceServerClient(url), queue.Queue()
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        inputs = []
        arrays = {schema.INPUT_IDS: np.asarray(ids, np.int32), schema.MAX_TOKENS: np.array([max_tokens], np.int32)}
        for name, arr in arrays.items():
            x = grpcclient.InferInput(name, list(arr.shape), "INT32")
            x.set_data_from_numpy(arr)
            inputs.append(x)
        c.async_stream_infer(
            schema.TANDEM.name,
            inputs,
            sequence_id=sid,
            sequence_start=start,
            sequence_end=end,
            enable_empty_final_response=True,
        )
        while True:
            result, error = q.get(timeout=60)
            if error is not None:
                return str(error)
            params = result.get_response().parameters
            if "triton_final_response" in params and params["triton_final_response"].bool_param:
                return None
    finally:
        c.stop_stream()
        c.close()


def close_anywhere(c, sid: int) -> None:
    """Ends session ``sid`` on whichever server of cluster ``c`` holds it (each server's own port)."""
    for i in range(len(c.names)):
        try:
            generate([], 1, url=f"127.0.0.1:{c.ports[i][1]}", sequence_id=sid, sequence_start=False, sequence_end=True)
            return
        except SessionLost:
            continue
    raise AssertionError(f"no server holds session {sid}")


def all_slots_free(c) -> None:
    """Waits until every server of cluster ``c`` holds no session (an earlier test's walked-away stream may
    still be ending); fails naming each server's free slots."""
    free = lambda: [tandem_metrics(c.ports[i][2])["tandem"].get("session_slots_free") for i in range(2)]  # noqa: E731
    try:
        wait_for(lambda: free() == [MAX_SESSIONS] * 2, 15.0)
    except AssertionError:
        raise AssertionError(f"sessions left open by earlier tests: free slots per server {free()}") from None


def test_a_client_without_the_routing_header_is_told_to_send_it(cluster, tokenizer):
    """4 two-turn conversations over plain tritonclient streams, no routing header: the proxy spreads
    them round robin, so second turns reach a server that does not hold the session; each such turn's
    error names the header (and carries the session-lost marker the client types on)."""
    errors = []
    for k in range(4):
        sid = new_sequence_id()
        assert raw_turn(cluster.url, tokenizer.chat_prompt(TEXTS[k]), sid, True, False) is None
        err = raw_turn(cluster.url, tokenizer.chat_prompt(LATER[0], later=True), sid, False, True)
        if err is not None:
            errors.append(err)
            close_anywhere(cluster, sid)  # its first server still holds it (until idle_timeout_s)
    assert errors, "no second turn reached another server"
    for err in errors:
        assert "unknown sequence id" in err and schema.ROUTING_HEADER in err and schema.SESSION_LOST_MARKER in err
    print(f"no header: {len(errors)} of 4 second turns on another server, each told: {errors[0]}")


def test_a_stall_cuts_no_stream(cluster, tokenizer):
    """Each server streams a long turn and holds an idle session; server A's tritonserver is paused
    (SIGSTOP) for 3.2 s, and a turn of A's idle session is sent meanwhile. After SIGCONT both streams go
    on, the waiting turn completes on A (its session kept), and the proxy never marked A down."""
    picked = sids_per_server(cluster, 2)
    name_a = cluster.names[0]
    for name in cluster.names:
        generate(tokenizer.chat_prompt(TEXTS[0]), 4, url=cluster.url, sequence_id=picked[name][1], sequence_end=False)
    prompt, walk_away = list(long_turn_prompt(3000)), threading.Event()
    got = {name: [] for name in cluster.names}
    box: dict = {}

    class Enough(Exception):
        pass

    def stream(name: str) -> None:
        def on_tokens(ids):
            got[name].append(time.monotonic())
            if walk_away.is_set():
                raise Enough

        try:
            generate(prompt, 3000, url=cluster.url, sequence_id=picked[name][0], spec="off", on_tokens=on_tokens)
            box[name] = "ended before the client walked away"
        except Enough:
            pass
        except TandemClientError as e:
            box[name] = str(e)

    threads = [threading.Thread(target=stream, args=(name,)) for name in cluster.names]
    for th in threads:
        th.start()
    wait_for(lambda: all(got.values()), 60.0)
    log_before = cluster.proxy_log.read_text(errors="replace")
    later: dict = {}

    def later_turn() -> None:
        try:
            later["res"] = generate(
                tokenizer.chat_prompt(LATER[0], later=True),
                4,
                url=cluster.url,
                sequence_id=picked[name_a][1],
                sequence_start=False,
                sequence_end=True,
            )
        except TandemClientError as e:
            later["err"] = str(e)

    pid = cluster.servers[0].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        lt = threading.Thread(target=later_turn)
        lt.start()
        time.sleep(3.2)
    finally:
        os.kill(pid, signal.SIGCONT)
    t_cont = time.monotonic()
    done = "ended before the client walked away"

    def went_on(name: str) -> bool:  # streaming 1 s past SIGCONT, or ended as a turn ends (never cut)
        ts = got[name]
        return box.get(name) == done if name in box else ts[-1] > t_cont + 1.0

    try:  # both streams go on; the paused server's resumes after SIGCONT
        wait_for(lambda: all(went_on(n) for n in got) and got[name_a][-1] > t_cont, 20.0)
    except AssertionError:
        raise AssertionError(
            f"streams stopped: {box}, later turn {later}, last token at "
            f"{ {n: round(ts[-1] - t_cont, 2) if ts else None for n, ts in got.items()} } s "
            f"after SIGCONT"
        ) from None
    lt.join(30)
    assert later.get("res") and not later.get("err"), later
    walk_away.set()
    for th in threads:
        th.join(60)
    assert all(v == done for v in box.values()), box
    generate(
        tokenizer.chat_prompt("Thanks.", later=True),
        1,
        url=cluster.url,
        sequence_id=picked[cluster.names[1]][1],
        sequence_start=False,
    )
    log = cluster.proxy_log.read_text(errors="replace")[len(log_before) :]
    assert " is DOWN" not in log, log[-2000:]
    wait_for(lambda: len(streams(cluster).get(str(picked[name_a][1]), [])) == 2, 5.0)
    assert streams(cluster)[str(picked[name_a][1])] == [name_a, name_a]
    gap = max(b - a for a, b in zip(got[name_a], got[name_a][1:]))
    print(f"stall: 3.2 s SIGSTOP of {name_a}; its stream's longest gap {gap:.2f} s, no stream cut, not marked down")


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
    all_slots_free(cluster)  # B takes every conversation: it needs all its slots
    refs = [_reference(cluster.url, tokenizer, text) for text in TEXTS]
    convs, texts, on = [], [], {}
    while len(convs) < len(TEXTS) or set(on.values()) != set(cluster.names):  # (ids hash: both servers hold some)
        assert len(convs) < 4 * len(TEXTS), on
        k = len(convs)
        conv = Conversation(cluster.url, stop_ids=tokenizer.stop_ids)
        assert conv.turn(tokenizer.chat_prompt(TEXTS[k % len(TEXTS)]), 12)["token_ids"] == refs[k % len(TEXTS)][0]
        convs.append(conv)
        texts.append(k % len(TEXTS))
        on[k] = wait_for(lambda: streams(cluster).get(str(conv.sequence_id)), 5.0)[0][0]
    refs = [refs[t] for t in texts]
    # a long turn streaming when its server dies; its server (by the servers' own turns_running gauge) is A
    box, first = {}, threading.Event()

    def stream() -> None:
        for _ in range(
            8
        ):  # a new sequence id each try: one that hashes to a server holding all its sessions is refused
            try:
                box["res"] = generate(
                    list(long_turn_prompt(3000)), 4000, url=cluster.url, spec="off", on_tokens=lambda ids: first.set()
                )
                return
            except AtCapacity:
                continue
            except TandemClientError as e:
                box["err"], box["t"] = e, time.monotonic()
                return

    th = threading.Thread(target=stream)
    th.start()
    assert first.wait(60), box  # (a client error other than TandemClientError ends the thread: its traceback)
    running, _ = wait_for(
        lambda: [i for i in range(2) if tandem_metrics(cluster.ports[i][2])["tandem"]["turns_running"] == 1], 5.0
    )
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
    print(
        f"failover: in-flight stream lost after {lost_inflight:.2f} s, next turns of A's "
        f"{len(lat)} sessions after {max(lat):.3f} s at most"
    )


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
    while not any(streams(cluster).get(str(sid)) == [name_a] for sid in new):  # (ids hash: some reach A)
        assert len(new) < 24, "no new session reached the returned server"
        new.append(generate(tokenizer.chat_prompt(TEXTS[len(new) % len(TEXTS)]), 4, url=cluster.url)["sequence_id"])
        wait_for(lambda: str(new[-1]) in streams(cluster), 5.0)
    s = streams(cluster)
    assert all(s[k][-1] == name_b and len(s[k]) >= 2 for k in old), {k: s[k] for k in old}
    got = {str(sid): s[str(sid)][0] for sid in new}
    assert sum(v == name_a for v in got.values()) >= 1, got
    n_a = sum(v == name_a for v in got.values())
    wait_for(lambda: counters(cluster, a)[0] == n_a, 5.0)
    print(f"return: new sessions {list(got.values())}")


def test_full_server_refuses_at_capacity_and_the_retry_goes_elsewhere(cluster, tokenizer):
    """Server 0 holds MAX_SESSIONS idle sessions (opened on its own port): a first turn there is
    refused "at capacity" (AtCapacity); through the proxy, first turns retried under new ids (each id
    hashed afresh, so half of them route to server 0) all complete, on server 1, and server 0 counts its
    refusals."""
    direct = f"127.0.0.1:{cluster.ports[0][1]}"

    def gauges() -> dict:
        return tandem_metrics(cluster.ports[0][2])["tandem"]

    wait_for(lambda: gauges().get("turns_running", 0) == 0, 15.0)  # an earlier test's turns may still be ending
    time.sleep(1.2)  # (the gauges are published once a second)
    free = int(gauges().get("session_slots_free", MAX_SESSIONS))
    held = [new_sequence_id() for _ in range(free)]  # every slot left (an earlier test's idle session may hold one)
    for sid in held:
        generate([5, 6, 7], 1, url=direct, sequence_id=sid, sequence_end=False, spec="off")
    refused0 = tandem_metrics(cluster.ports[0][2])["tandem"].get("sessions_refused_full", 0)
    with pytest.raises(AtCapacity, match=r"at capacity"):  # counted (whatever the retries below hash to)
        generate([5, 6, 7], 1, url=direct, spec="off")
    done = [generate(tokenizer.chat_prompt(TEXTS[k]), 4, url=cluster.url, start_retries=12) for k in range(4)]
    assert all(len(r["token_ids"]) >= 1 for r in done)
    s = streams(cluster)
    assert all(s[str(r["sequence_id"])] == [cluster.names[1]] for r in done)
    wait_for(lambda: tandem_metrics(cluster.ports[0][2])["tandem"].get("sessions_refused_full", 0) > refused0, 5.0)
    for sid in held:
        generate([], 1, url=direct, sequence_id=sid, sequence_start=False, sequence_end=True)


def test_serve_cluster_runs_in_the_foreground_and_ctrl_c_cleans_up(tokenizer):
    """``python -m tandem.launch.cluster serve`` (what ``make serve-cluster`` runs), one replica: it
    prints its ready line, a turn through its proxy works, and SIGINT stops the proxy and the server
    (every port free again) and removes the server's shared-memory files."""
    import re
    import signal
    import subprocess
    import sys

    from tandem.launch.host import busy_ports, free_ports, shm_files

    proxy = free_ports(1)[0]
    base = next(
        p
        for p in range(20000, 60000, 7)
        if busy_ports({str(q): q for q in range(p, p + 3)}) is None and proxy not in range(p, p + 3)
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.launch.cluster",
            "serve",
            "--replicas",
            "1",
            "--port",
            str(proxy),
            "--base-port",
            str(base),
            "--checkpoint",
            str(CHECKPOINT),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
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
    on both sides, a consistent hash of the header (fixed server ids and weights, so every proxy builds the
    same ring), a stick table on it, health checks on each HTTP port that tolerate a stall of 10 s or more
    and leave a server's streams alone when it is marked down, redispatch."""
    from tandem.launch.haproxy import check_tolerance_s, ensure_haproxy, haproxy_config

    text = haproxy_config([("tandem0", 9101, 9100), ("tandem1", 9104, 9103)], 9001)
    (tmp_path / "haproxy.cfg").write_text(text)
    ensure_haproxy().check(tmp_path / "haproxy.cfg")
    for line in (
        "bind 127.0.0.1:9001 proto h2",
        f"balance hdr({schema.ROUTING_HEADER})\n",
        "hash-type consistent sdbm avalanche\n",
        f"stick on req.hdr({schema.ROUTING_HEADER})",
        "option httpchk GET /v2/health/ready",
        "option redispatch",
        "observe layer4 error-limit 1 on-error mark-down",
        "server tandem0 127.0.0.1:9101 id 1 weight 100 proto h2 check port 9100",
        "server tandem1 127.0.0.1:9104 id 2 weight 100 proto h2 check port 9103",
    ):
        assert line in text, line
    assert "shutdown-sessions" not in text and "leastconn" not in text
    assert check_tolerance_s() >= 10.0


def test_client_types_errors_by_marker_and_transport():
    """A broken stream (gRPC status set) and the session-lost marker give SessionLost, the at-capacity
    marker AtCapacity, any other server message a plain TandemClientError."""
    from tritonclient.utils import InferenceServerException

    from tandem_client.client import error_from

    broken = error_from(InferenceServerException("Socket closed", status="StatusCode.UNAVAILABLE"), "h:1", 7)
    assert type(broken) is SessionLost and "sequence 7" in str(broken) and schema.SESSION_LOST_MARKER in str(broken)
    lost = error_from(
        InferenceServerException(f"sequence_id: unknown sequence id 7 {schema.SESSION_LOST_MARKER}"), "h:1", 7
    )
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
