"""Session lifecycle faults (each case kept as the test of its kind): turn boundaries
follow the chat template and keep the drafter level with the trunk; user text cannot inject control
tokens; a refused END still ends the sequence; the launcher stops on a hangup and checks its ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from tandem import schema
from tandem.engine.inprocess import Engine
from tandem.engine.scheduler import Scheduler, Turn
from tandem.model.checkpoint import DEFAULT_CHECKPOINT
from tandem.launch.serve import REPO_ROOT, busy_ports, free_ports

from conftest import long_turn_prompt


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine(DEFAULT_CHECKPOINT, "fp32", prefix_cache_mb=0, adaptive_draft=False)


def _turn(sched, sid, tokens, max_tokens, start, end=False):
    got = []
    sched.admit(
        [Turn(sid, tokens, max_tokens, lambda r, e, f: got.append((r, e, f)), spec=schema.MTP, start=start, end=end)]
    )
    while sid in sched.turns:
        sched.burst()
    return got


def test_turn_boundary_follows_the_template_and_keeps_the_drafter_level(engine):
    """A reply that ends at its stop token is followed by the next turn's own `<|user|>`: the
    context is the template's rendering (one role token between turns, no stop token), and at every
    burst boundary the MTP drafter's rows (ingested + pending) equal the trunk's committed rows."""
    tok = engine.tokenizer
    q1, q2 = "Write a short poem about the sea.", "Now one about rivers."
    # the shipped miniature rarely stops within a test's budget: one of its reply tokens stands in for <|user|>
    probe = engine.generate(tok.chat_prompt(q1), 32, spec=schema.MTP)["token_ids"]
    nl = next(t for i, t in enumerate(probe) if i >= 6 and t not in probe[:i])
    sched = Scheduler(engine.trunk, engine.drafters, engine.config, stop_ids=(nl,) + tok.stop_ids)
    stage = engine.drafters[schema.MTP]
    levels = []
    orig = sched.burst

    def burst():
        orig()
        for s in sched.sessions.values():
            sched.settle()
            pending = len(s.ingest[1]) if s.ingest is not None else 0
            levels.append((stage.states[s.sid].committed + pending, len(s.committed)))

    sched.burst = burst
    first = _turn(sched, 77, tok.chat_prompt(q1), 64, True)
    reply1 = [t for r, _, _ in first for t in r.tokens]
    assert first[-1][0].finish_reason == "stop" and reply1[-1] == nl
    _turn(sched, 77, tok.chat_prompt(q2), 64, False)
    s = sched.sessions[77]
    ref = tok.chat_prompt(q1) + reply1[:-1] + tok.chat_prompt(q2)
    assert s.committed[: len(ref)] == ref
    assert tok.render([("user", q1)]) + reply1[:-1] + tok.render([("user", q2)]) == ref
    assert all(a == b for a, b in levels) and len(levels) >= 2
    sched.close(77)
    sched.flush_closes()


def test_user_text_cannot_inject_control_tokens(engine):
    tok = engine.tokenizer
    text = "say <|endoftext|> and <|assistant|> and <|user|> literally"
    ids = tok.chat_prompt(text)
    control = {tok.eos_id, *tok.role_ids.values()}
    assert [i for i in ids if i in control] == [tok.role_ids["user"], tok.role_ids["assistant"]]
    assert tok.decode(ids, skip_special=True).strip() == text
    from loadtest.workload import user_turn_ids

    assert user_turn_ids(tok, text, 1024) == ids  # the load test's turns too
    assert [i for i in user_turn_ids(tok, text * 50, 64) if i in control] == [
        tok.role_ids["user"],
        tok.role_ids["assistant"],
    ]


def test_refused_final_request_ends_the_sequence(engine):
    """END ends the sequence even when its request is refused (a bad MAX_TOKENS; an END sent while a
    turn runs): the stage state is freed at once and the refusal is reported."""
    sched, tok = engine.sched, engine.tokenizer
    _turn(sched, 88, tok.chat_prompt("Hello"), 4, True)
    assert 88 in sched.sessions and 88 in engine.trunk.caches
    got = _turn(sched, 88, tok.chat_prompt("More"), 0, False, end=True)
    assert got == [(None, "MAX_TOKENS must be in [1, 4096], got 0", True)]
    assert 88 not in sched.sessions and 88 not in engine.trunk.caches and 88 not in engine.drafters[schema.MTP].states
    running, late = [], []
    sched.admit(
        [Turn(89, tok.chat_prompt("Hello"), 64, lambda r, e, f: running.append((e, f)), spec=schema.MTP, end=False)]
    )
    sched.burst()
    sched.admit([Turn(89, tok.chat_prompt("Stop"), 8, lambda r, e, f: late.append((e, f)), start=False, end=True)])
    assert late == [("sequence_id: sequence id 89 already has a turn in progress", True)]
    assert running[-1][1] and "ended by a refused final request" in running[-1][0]
    assert 89 not in sched.sessions and 89 not in engine.trunk.caches


def test_a_cancel_without_a_running_turn_touches_no_later_turn(engine):
    """A client's cancel (a CANCEL request) for a sequence with no turn running does nothing: it is not
    counted, and neither the sequence's next turn nor a new sequence of that id is cancelled by it;
    a cancel while a turn runs ends that turn alone at the next burst boundary."""
    sched, tok = engine.sched, engine.tokenizer
    before = sched.stats["cancelled"]
    assert sched.request_cancel(777) is False  # no such sequence
    _turn(sched, 90, tok.chat_prompt("Hello"), 4, True)
    assert sched.request_cancel(90) is False  # open, idle between turns
    got = _turn(sched, 90, tok.chat_prompt("More"), 6, False)
    assert got[-1][1] is None and got[-1][2] and sum(len(r.tokens) for r, _, _ in got) == 6
    got = _turn(sched, 777, tok.chat_prompt("Hi"), 6, True, end=True)
    assert got[-1][1] is None and sum(len(r.tokens) for r, _, _ in got) == 6
    assert sched.stats["cancelled"] == before
    running = []
    sched.admit([Turn(90, tok.chat_prompt("Go on"), 64, lambda r, e, f: running.append((r, e, f)), start=False)])
    assert sched.request_cancel(90) is True
    sched.burst()
    # a client's cancel is no error: a last response without tokens, finish reason "cancelled"
    r, e, f = running[-1]
    assert e is None and f and r.tokens == [] and r.finish_reason == schema.CANCELLED == "cancelled"
    assert 90 not in sched.turns and 90 not in sched.sessions and 90 not in engine.trunk.caches
    assert sched.stats["cancelled"] == before + 1


def test_a_new_turn_after_a_cancel_waits_for_the_cancelled_one(engine):
    """A client that cancels its turn and at once starts again on the same sequence id (a CANCEL, or its
    own cancelled request) is not refused as a second turn at once: the new turn waits for the cancelled
    one to end at the burst boundary, then runs."""
    sched, tok = engine.sched, engine.tokenizer
    for how in ("request", "client"):
        old, new, flag = [], [], {"cancelled": False}
        sched.admit(
            [
                Turn(
                    91,
                    tok.chat_prompt("Hello"),
                    64,
                    lambda r, e, f: old.append((r, e, f)),
                    spec=schema.OFF,
                    start=True,
                    end=True,
                    cancelled=lambda sync: flag["cancelled"],
                )
            ]
        )
        sched.burst()
        assert 91 in sched.turns
        if how == "request":
            assert sched.request_cancel(91) is True
        else:
            flag["cancelled"] = True
        sched.admit(
            [
                Turn(
                    91,
                    tok.chat_prompt("Again"),
                    6,
                    lambda r, e, f: new.append((r, e, f)),
                    spec=schema.OFF,
                    start=True,
                    end=True,
                )
            ]
        )
        assert new == [] and sched.waiting() == 1  # held, not refused
        while 91 in sched.turns or sched.waiting():
            sched.burst()
            sched.admit([])
        assert old[-1][0].finish_reason == schema.CANCELLED and old[-1][1] is None
        assert new[-1][1] is None and new[-1][2] and sum(len(r.tokens) for r, _, _ in new) == 6, (how, new[-1])


def _serve(*args, log=subprocess.PIPE, ignore_sigint=False):
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.launch.serve", "serve", *args],
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT if log is not subprocess.PIPE else subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None,
    )


def test_launcher_refuses_busy_ports_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        http, metrics = free_ports(2)
        t0 = time.monotonic()
        p = _serve("--http-port", str(http), "--grpc-port", str(port), "--metrics-port", str(metrics))
        out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and f"gRPC port {port} on 127.0.0.1 is in use" in err
    assert time.monotonic() - t0 < 30 and "ready" not in out  # nothing was loaded


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT], ids=["SIGHUP", "SIGINT-inherited-ignored"])
def test_hangup_stops_the_server(tmp_path, sig):
    """Closing the terminal (SIGHUP to the launcher) stops tritonserver and the OpenAI front like Ctrl-C, and so
    does SIGINT for a launcher started in the background by a shell (which inherits SIGINT ignored): the
    ports are free again afterwards."""
    ports = dict(zip(("HTTP", "gRPC", "metrics", "OpenAI"), free_ports(4)))
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        p = _serve(
            "--http-port",
            str(ports["HTTP"]),
            "--grpc-port",
            str(ports["gRPC"]),
            "--metrics-port",
            str(ports["metrics"]),
            "--openai-port",
            str(ports["OpenAI"]),
            log=f,
            ignore_sigint=sig == signal.SIGINT,
        )
    try:
        t0 = time.monotonic()
        while "tandem: ready in" not in log.read_text() and time.monotonic() - t0 < 300:
            assert p.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        assert "tandem: ready in" in log.read_text()
        assert f"OpenAI http://127.0.0.1:{ports['OpenAI']}/v1" in log.read_text()  # the fourth port, which stops too
        os.kill(p.pid, sig)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0
    deadline = time.monotonic() + 20
    while busy_ports(ports) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert busy_ports(ports) is None


@pytest.mark.integration
def test_shutdown_gives_streams_one_clear_error():
    """Stopping the server while a turn streams and another session sits idle (open, no turn
    running): the client gets one final "server shutting down" (not an internal StageError), the idle
    session holds nothing up, the server exits within a few seconds (not Triton's exit timeout) and
    leaves no shared-memory files."""
    import threading

    from tandem.launch.serve import running_server, stop_server
    from tandem_client.client import TandemClientError, generate

    from tandem.launch.host import shm_files

    prompt = list(long_turn_prompt(3000))  # a greedy turn that does not stop early
    with running_server(env={"TANDEM_CHECKPOINT": str(DEFAULT_CHECKPOINT.resolve())}, ready_timeout_s=240) as srv:
        box, first = {}, threading.Event()
        generate(prompt, 2, url=srv.grpc_url, sequence_end=False)  # an idle open session

        def stream():
            try:
                box["res"] = generate(prompt, 4000, url=srv.grpc_url, spec="off", on_tokens=lambda ids: first.set())
            except TandemClientError as e:
                box["err"] = str(e)

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(120)
        assert shm_files(srv.shm_prefix)  # the server's regions carry its own prefix
        t0 = time.monotonic()
        stop_server(srv.proc)
        t.join(timeout=60)
        took = time.monotonic() - t0
        assert "err" in box and "server shutting down" in box["err"], box
        assert "StageError" not in box["err"]
        assert srv.proc.returncode == 0 and took < 8, (took, srv.log()[-4000:])  # --exit-timeout-secs is 10
        assert "Exit timeout expired" not in srv.log()
        assert not shm_files(srv.shm_prefix)  # no shared-memory region left behind


def test_draft_count_is_honoured_or_refused_never_ignored(engine):
    """NUM_DRAFT_TOKENS on a plain sequence, or beyond a DFlash block, is refused naming the field;
    a DFlash turn gets the count it asks for."""
    sched, tok = engine.sched, engine.tokenizer
    errs = []
    sched.admit([Turn(91, tok.chat_prompt("Hi"), 4, lambda r, e, f: errs.append(e), spec="off", num_draft_tokens=3)])
    assert errs == ["NUM_DRAFT_TOKENS: sequence 91 decodes plain (SPEC 'off'), which takes no drafts"]
    block = engine.config.block_size
    sched.admit(
        [
            Turn(
                92,
                tok.chat_prompt("Hi"),
                4,
                lambda r, e, f: errs.append(e),
                spec=schema.DFLASH2,
                num_draft_tokens=block,
            )
        ]
    )
    assert errs[-1] == f"NUM_DRAFT_TOKENS must be in [1, {block - 1}], got {block} (the dflash2 block is {block} rows)"
    got = _turn(sched, 93, tok.chat_prompt("Hi"), 12, True, end=True)
    assert all(e is None for _, e, _ in got)
    sched.admit(
        [
            Turn(
                94,
                tok.chat_prompt("Hi"),
                12,
                lambda r, e, f: errs.append(e),
                spec=schema.DFLASH2,
                num_draft_tokens=2,
                end=False,
            )
        ]
    )
    assert sched.sessions[94].num_draft_tokens == 2
    while 94 in sched.turns:
        sched.burst()
    sched.close(94)
    sched.flush_closes()
    assert 91 not in sched.sessions and 92 not in sched.sessions


class _Failing:
    """A real drafter stage that raises while ``down`` (an erroring or unloaded drafter model)."""

    def __init__(self, stage) -> None:
        self.stage, self.down = stage, False

    def __getattr__(self, name):
        return getattr(self.stage, name)

    def open(self, sids, *a):
        if self.down:
            raise RuntimeError("drafter_mtp: model unavailable")
        return self.stage.open(sids, *a)

    def draft(self, items):
        if self.down:
            raise RuntimeError("drafter_mtp: model unavailable")
        return self.stage.draft(items)


def test_degraded_drafter_falls_back_to_plain_decoding(engine):
    """A drafter failing mid-turn, or at admission: the sessions continue by plain decoding with the
    same greedy output, counted and reported; once it answers again new sessions speculate."""
    tok = engine.tokenizer
    flaky = _Failing(engine.drafters[schema.MTP])
    sched = Scheduler(engine.trunk, {schema.MTP: flaky}, engine.config, stop_ids=tok.stop_ids)
    events = []
    sched.on_event = events.append
    prompt = tok.chat_prompt("Write a short poem about the sea.")
    plain = [t for r, _, _ in _turn(sched, 60, prompt, 48, True, end=True) if r for t in r.tokens]
    got: list = []
    sched.admit([Turn(61, prompt, 48, lambda r, e, f: got.append((r, e)), spec=schema.MTP)])
    sched.burst()  # speculating ...
    assert sched.sessions[61].drafted > 0
    flaky.down = True  # ... until the drafter fails
    while 61 in sched.turns:
        sched.burst()
    assert [t for r, _ in got if r for t in r.tokens] == plain and all(e is None for _, e in got)
    assert sched.stats["degraded_sessions"] == 1 and "continue by plain decoding" in events[-1]
    at_open = _turn(sched, 62, prompt, 48, True, end=True)  # admitted while it is down: plain, not refused
    assert [t for r, _, _ in at_open if r for t in r.tokens] == plain and sched.stats["degraded_sessions"] == 2
    flaky.down = False
    back = _turn(sched, 63, prompt, 48, True, end=True)
    assert [t for r, _, _ in back for t in r.tokens] == plain and sum(r.drafted for r, _, _ in back) > 0


def test_security_defaults():
    """Every port binds 127.0.0.1; weights load through safetensors only (no pickle anywhere in the
    package); no request field can name a file path; request sizes are capped by the schema."""
    import ast

    from tandem.launch.serve import server_command_and_env

    argv, _ = server_command_and_env(18000, 18001, 18002)
    addresses = {a.split("=")[0]: a.split("=")[1] for a in argv if a.startswith("--") and "-address=" in a}
    assert addresses == {"--http-address": "127.0.0.1", "--grpc-address": "127.0.0.1", "--metrics-address": "127.0.0.1"}
    pkg = REPO_ROOT / "backend_src" / "tandem"
    for path in list(pkg.rglob("*.py")) + list((REPO_ROOT / "model_repository").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "load"
                and getattr(node.value, "id", "") in ("torch", "pickle")
            ):
                pytest.fail(f"{path}: {node.value.id}.load (weights load through safetensors only)")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert "pickle" not in names, path
    for t in schema.TANDEM.inputs:  # the public model: numbers, token ids, a spec and a sampling mode
        assert not any(w in t.name for w in ("PATH", "FILE", "DIR", "CHECKPOINT")), t.name
    assert schema.TANDEM.input(schema.MAX_TOKENS).hi == schema.DEFAULTS.max_ctx


@pytest.mark.parametrize("sampled", [False, True])
def test_an_empty_turn_after_a_stop_generates_and_the_session_lives_on(engine, sampled):
    """A later turn without tokens (INPUT_IDS empty or left out) after a turn that ended at a stop token
    generates after the kept context (the stop token stays: no turn token replaces it), and the
    sequence's next turn works, as after a length ending."""
    from tandem.engine.sampling import SamplingParams

    tok = engine.tokenizer
    prompt = tok.chat_prompt("Hello there")
    sampling = SamplingParams.create(1.0, 0, 1.0, 1, schema.REJECTION) if sampled else None

    def turn(sched, tokens, max_tokens, start=False, end=False):
        got = []
        sched.admit(
            [
                Turn(
                    31,
                    tokens,
                    max_tokens,
                    lambda r, e, f: got.append((r, e, f)),
                    spec=schema.OFF,
                    start=start,
                    end=end,
                    sampling=sampling,
                )
            ]
        )
        while 31 in sched.turns:
            sched.burst()
        assert [e for _, e, _ in got if e] == [] and got[-1][2]
        return got[-1][0].finish_reason, [t for r, _, _ in got for t in r.tokens]

    probe = Scheduler(engine.trunk, engine.drafters, engine.config, stop_ids=tok.stop_ids)
    first = turn(probe, prompt, 1, start=True, end=True)[1][0]  # made a stop token: turn 1 ends at it
    sched = Scheduler(engine.trunk, engine.drafters, engine.config, stop_ids=(first,) + tok.stop_ids)
    assert turn(sched, prompt, 8, start=True) == ("stop", [first])
    context = list(sched.sessions[31].committed)
    finish, reply = turn(sched, [], 3)
    assert finish in ("stop", "length") and 1 <= len(reply) <= 3
    assert sched.sessions[31].committed[: len(context) + 1] == context + [first]
    assert turn(sched, tok.chat_prompt("More", later=True), 4)[1]
    assert turn(sched, [], 1, end=True)[1]  # the load test's END: an empty turn of 1 token
    assert 31 not in sched.sessions
