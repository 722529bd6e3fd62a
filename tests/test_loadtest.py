"""The Locust load test (``loadtest/``): its helpers and workload, the report arithmetic on a
hand-made raw file, sampled traffic only where the model takes TEMPERATURE, and (integration) a
very short real ramp 1 -> 2 users against a server the runner starts itself (the shared test server),
and a short soak against a server of its own."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import report
from loadtest.common import model_max_ctx, ramp_levels, sampling_input, split_host
from loadtest.workload import build_sessions, describe, exchanges, load_workload, save_workload
from tandem.launch.serve import REPO_ROOT

CKPT = Path(os.environ.get("TANDEM_TEST_CHECKPOINT") or REPO_ROOT / "model_repository" / "weights" / "tandem-tiny")


def test_ramp_levels_and_host_checks():
    assert ramp_levels(8) == list(range(1, 9))
    assert ramp_levels(8, 3) == [1, 4, 7, 8]
    assert ramp_levels(1) == [1]
    assert split_host("127.0.0.1:8001") == "127.0.0.1:8001"
    assert split_host("grpc://localhost:9/") == "localhost:9"
    with pytest.raises(ValueError, match="loopback"):
        split_host("192.0.2.1:8001")
    assert split_host("192.0.2.1:8001", allow_remote=True) == "192.0.2.1:8001"
    with pytest.raises(ValueError, match="host:port"):
        split_host("127.0.0.1")


def test_model_metadata_helpers():
    greedy = {"inputs": [{"name": "INPUT_IDS", "datatype": "INT32", "shape": ["-1"]}]}
    assert sampling_input(greedy) is None
    s = sampling_input({"inputs": greedy["inputs"] + [{"name": "TEMPERATURE", "datatype": "FP32", "shape": ["1"]}]})
    assert s == {"name": "TEMPERATURE", "datatype": "FP32", "shape": [1], "numpy": "float32"}
    assert model_max_ctx({"config": {"parameters": {"max_ctx": {"string_value": "2048"}}}}) == 2048
    assert model_max_ctx({"config": {}}) == 4096


class _CharTok:
    """A stand-in tokenizer: one id per character; the template's control ids 2 (user) and 3 (assistant)."""

    user_id = 2

    def encode(self, text):
        return [ord(c) for c in text]

    def message(self, role, text):
        return [{"user": 2, "assistant": 3}[role]] + self.encode("\n" + text)

    def chat_prompt(self, text):
        return self.message("user", text) + self.message("assistant", "")


def test_workload_shape_and_budget(tmp_path):
    convs = [
        [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x" * 50}],
        [
            {"from": "human", "value": "a" * 100},
            {"from": "gpt", "value": "y" * 5},
            {"from": "human", "value": "b" * 10},
            {"from": "gpt", "value": "z" * 500},
            {"from": "human", "value": "c"},
            {"from": "gpt", "value": "w"},
        ],
        [{"from": "gpt", "value": "lead"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}],
    ]
    assert exchanges(convs[2]) == [("q", "r")]
    s = build_sessions(
        _CharTok(),
        n_sessions=200,
        max_output_tokens=20,
        max_prompt_tokens=40,
        multi_turn_share=0.5,
        max_turns=3,
        sampled_share=0.25,
        max_context_tokens=4096,
        seed=1,
        conversations=convs,
    )
    d = describe(s)
    assert 0.35 < d["multi_turn_share"] < 0.65 and 0.1 < d["sampled_share"] < 0.4
    for sess in s:
        assert 1 <= len(sess.turns) <= 3
        for t in sess.turns:
            assert len(t.input_ids) <= 40 and 1 <= t.max_tokens <= 20
            assert t.input_ids[0] == 2 and t.input_ids[-2:] == [3, ord("\n")]  # <|user|> ... <|assistant|>\n
    multi = next(x for x in s if len(x.turns) == 3)
    assert [t.max_tokens for t in multi.turns] == [5, 20, 1]  # reply lengths, capped
    # a tight context budget drops later turns instead of overflowing
    tight = build_sessions(_CharTok(), 50, 20, 40, 1.0, 3, 0.0, max_context_tokens=80, seed=0, conversations=convs)
    for sess in tight:
        assert sum(len(t.input_ids) + t.max_tokens for t in sess.turns) + 8 <= 80
    p = save_workload(tmp_path / "w.json", s)
    assert [x.turns for x in load_workload(p)] == [x.turns for x in s]


def test_workload_from_sharegpt():
    if not (CKPT / "tokenizer.json").exists():
        pytest.skip(f"{CKPT} has no tokenizer.json")
    from tandem.model.tokenizer import ChatTokenizer

    tok = ChatTokenizer(CKPT / "tokenizer.json")
    s = build_sessions(tok, n_sessions=64, max_output_tokens=32, max_prompt_tokens=256, seed=3, scan=500)
    d = describe(s)
    assert d["sessions"] == 64 and 0 < d["multi_turn_share"] < 1
    assert d["prompt_tokens"]["p90"] > d["prompt_tokens"]["p50"] > 4  # real, varied prompt lengths
    later = [t for x in s for t in x.turns[1:]]
    assert later and all(t.input_ids[0] == tok.user_id for t in later)


def test_summarize_per_level(tmp_path):
    t0 = 1000.0
    recs = [
        {"kind": "stage", "users": 1, "t": t0},
        # 1 user: TTFT 100 ms; then bursts of 4 tokens 200 ms later (50 ms/token) and 2 tokens 40 ms later
        {
            "kind": "turn",
            "t0": t0 + 1,
            "ttft_ms": 100.0,
            "e2e_ms": 340.0,
            "error": None,
            "bursts": [[t0 + 1.1, 1, 0, 0, 0], [t0 + 1.3, 4, 2, 2, 6], [t0 + 1.34, 2, 1, 1, 3]],
        },
        {"kind": "stage", "users": 2, "t": t0 + 10},
        {
            "kind": "turn",
            "t0": t0 + 11,
            "ttft_ms": 300.0,
            "e2e_ms": 700.0,
            "error": None,
            "bursts": [[t0 + 11.3, 1, 0, 0, 0], [t0 + 11.7, 4, 4, 0, 12]],
        },
        {"kind": "turn", "t0": t0 + 12, "e2e_ms": 50.0, "error": "server error: boom", "bursts": []},
        {"kind": "end", "t": t0 + 20},
    ]
    raw = tmp_path / "raw.jsonl"
    raw.write_text("\n".join(json.dumps(r) for r in recs) + '\n{"kind": "tu')  # torn last line
    s = report.summarize(raw)
    one, two = s["levels"]
    assert (one["users"], one["requests"], one["failures"], one["tokens"]) == (1, 1, 0, 7)
    assert one["tokens_per_s"] == pytest.approx(0.7) and one["ttft_p50_ms"] == pytest.approx(100.0)
    # per-token ITL values: 4 x 50 ms and 2 x 20 ms
    assert one["itl_p50_ms"] == pytest.approx(50.0) and one["itl_p99_ms"] == pytest.approx(50.0)
    assert one["tau"] == pytest.approx(1 + 3 / 3)
    assert (two["users"], two["requests"], two["failures"], two["tokens"]) == (2, 2, 1, 5)
    assert two["itl_p50_ms"] == pytest.approx(100.0) and two["tau"] == pytest.approx(1.0)
    assert s["all"]["failures"] == 1 and s["all"]["requests"] == 3
    x, tau, toks = report.tau_over_time(raw, 5.0)
    assert tau[0] == pytest.approx(2.0) and toks.sum() == 12
    report.write_summary(s, tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert [r["users"] for r in rows] == ["1", "2", "all"]
    pngs = report.plot_all(s, raw, tmp_path)
    assert all(p.stat().st_size > 10_000 for p in pngs)


def test_sampled_share_needs_a_temperature_input():
    """The served model takes the sampling inputs; a model without TEMPERATURE (metadata) is refused."""
    from loadtest import run

    assert run._local_model_takes_temperature()
    assert sampling_input({"inputs": [{"name": "INPUT_IDS", "datatype": "INT32", "shape": ["-1"]}]}) is None


def test_a_locust_stuck_after_quit_exits_with_its_code():
    """The locustfile's exit guard: a process stuck after Locust's quit (as it once was after
    "Shutting down (exit code 0)") exits with the code it was given, even with gevent's hub blocked."""
    code = (
        "from gevent import monkey\nmonkey.patch_all()\nfrom loadtest.common import exit_after\n"
        "exit_after(0.5, 3)\n"
        "monkey.get_original('time', 'sleep')(50)\n"
    )  # the main thread (and gevent's hub) stuck
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3, p.stderr[-2000:]


@pytest.mark.integration
def test_short_ramp_zero_failures(tmp_path, server, monkeypatch):
    """The runner starts its own tritonserver (:func:`running_server`, here yielding the shared test
    server: the runner's start, use and stop of it are checked without another server start), ramps
    1 -> 2 users (5 s per step, 8 tokens per turn, half the sessions sampled) and leaves Locust's
    CSV/HTML, the PNG plots and a summary with both user levels and tau for greedy and sampled turns
    apart. (The ``--url`` path: the soak below.)"""
    import contextlib
    import signal

    from typer.testing import CliRunner

    import tandem.launch.serve as serve_mod
    from loadtest import run

    out = tmp_path / "report"
    started: dict = {}

    @contextlib.contextmanager
    def own_server(**kwargs):
        started["kwargs"] = kwargs
        yield server
        started["files_at_stop"] = sorted(f.name for f in out.iterdir())

    monkeypatch.setattr(serve_mod, "running_server", own_server)
    term = signal.getsignal(signal.SIGTERM)  # (the runner makes SIGTERM unwind like Ctrl-C)
    try:
        res = CliRunner().invoke(
            run.app,
            [
                "--users",
                "2",
                "--step-seconds",
                "5",
                "--max-tokens",
                "8",
                "--sessions",
                "64",
                "--max-prompt-tokens",
                "256",
                "--sampled-share",
                "0.5",
                "--checkpoint",
                str(CKPT),
                "--report-dir",
                str(out),
                "--quiet",
                "--stop-timeout",
                "20",
            ],
        )
    finally:
        signal.signal(signal.SIGTERM, term)
    assert res.exit_code == 0, res.output[-4000:] + repr(res.exception)
    assert started["kwargs"] == {
        "env": {"TANDEM_CHECKPOINT": str(CKPT.resolve())},
        "ready_timeout_s": 300.0,
        "log_path": out.resolve() / "tritonserver.log",
    }
    assert f"loadtest: server ready at {server.grpc_url}" in res.output
    assert "locust_stats.csv" in started["files_at_stop"]  # stopped once Locust had finished
    for name in (
        "locust_stats.csv",
        "locust_stats_history.csv",
        "locust_failures.csv",
        "locust.html",
        "throughput.png",
        "ttft.png",
        "itl.png",
        "acceptance.png",
        "summary.csv",
        "summary.json",
    ):
        assert (out / name).stat().st_size > 0, name
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stats = {r["Name"]: r for r in csv.DictReader(open(out / "locust_stats.csv"))}
    assert {"TTFT", "ITL", "E2E", "tokens/s"} <= set(stats)
    assert stats["Aggregated"]["Failure Count"] == "0" and int(stats["E2E"]["Request Count"]) > 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["users"] for r in summary["levels"]] == [1, 2]
    assert summary["all"]["failures"] == 0
    # every turn Locust counted is in the raw records the summary was built from
    assert summary["all"]["requests"] == int(stats["E2E"]["Request Count"])
    for r in summary["levels"]:
        assert r["requests"] > 0 and r["tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0 and r["tau"] >= 1.0
    assert "TTFT p50 ms" in res.output and "all" in res.output
    bs = summary["by_sampling"]
    assert bs["greedy"]["requests"] > 0 and bs["sampled"]["requests"] > 0
    assert bs["greedy"]["requests"] + bs["sampled"]["requests"] == summary["all"]["requests"]
    assert bs["greedy"]["tau"] >= 1.0 and bs["sampled"]["tau"] >= 1.0 and "loadtest: tau greedy" in res.output


def test_soak_fault_mix_is_judged():
    """Each bad request of the soak names the field its refusal must mention; an acceptance, an
    error naming another field, or an internal error is a failure; the raw file's fault records count."""
    import random

    from loadtest.faults import bad_request, judge_bad

    rng = random.Random(3)
    seen = {bad_request(rng).name: bad_request(rng) for _ in range(60)}
    assert len(seen) == 7
    r = bad_request(random.Random(1))
    assert judge_bad(r, f"{r.expect} must be ...") is None
    assert "was accepted" in judge_bad(r, None)
    assert "does not name" in judge_bad(r, "internal error: KeyError")
    assert ramp_levels(8, 1, start_users=8) == [8]


def test_soak_judges_every_state_gauge_at_baseline():
    """The soak's state gauges: the trunk's sequences are the ``tandem`` model's ``trunk_sequences``; a drafter
    model's ``stage_sequences`` count only when the server loads it (``colocate`` off); any of them or of the
    session gauges (open sessions, running or waiting turns, cache rows, state bytes) above 0, or missing, is
    off baseline; the prefix cache's blocks are not state."""
    from loadtest.soak import off_baseline, served_drafters, stage_sequences

    assert served_drafters({"TANDEM_COLOCATE": "true"}) == ()
    both = served_drafters({"TANDEM_COLOCATE": "false"})
    assert both == ("drafter_mtp", "drafter_dflash")
    idle = {"trunk_sequences": 0.0, "session_slots_free": 16.0, "prefix_cache_blocks": 5.0}
    idle.update(dict.fromkeys(("sessions_open", "turns_running", "turns_waiting", "cache_rows", "state_bytes"), 0.0))

    def off(metrics, drafters=()):
        return off_baseline({"tandem": metrics.get("tandem", {}), "stages": stage_sequences(metrics, drafters)})

    assert stage_sequences({"tandem": idle}, ()) == {"trunk": 0.0} and off({"tandem": idle}) == {}
    assert off({"tandem": {**idle, "trunk_sequences": 2.0}}) == {"trunk": 2.0}
    held = {"sessions_open": 1.0, "turns_running": 1.0, "cache_rows": 40.0, "state_bytes": 9e5}
    assert off({"tandem": {**idle, **held}}) == held and off({"tandem": {**idle, "turns_waiting": 2.0}})
    drafters_idle = {
        "tandem": idle,
        "drafter_mtp": {"stage_sequences": 0.0},
        "drafter_dflash": {"stage_sequences": 0.0},
    }
    assert off(drafters_idle, both) == {} and off(drafters_idle) == {}
    assert off({**drafters_idle, "drafter_mtp": {"stage_sequences": 3.0}}, both) == {"drafter_mtp": 3.0}
    gone = off({"tandem": idle, "drafter_mtp": {"stage_sequences": 0.0}}, both)  # (drafter_dflash not reporting)
    assert list(gone) == ["drafter_dflash"] and gone["drafter_dflash"] != gone["drafter_dflash"]  # NaN
    assert list(off({"tandem": {k: v for k, v in idle.items() if k != "trunk_sequences"}})) == ["trunk"]
    assert list(off({"tandem": {k: v for k, v in idle.items() if k != "state_bytes"}})) == ["state_bytes"]


@pytest.mark.integration
def test_short_soak_passes(tmp_path):
    """`make soak` in miniature: 4 users for 9 s with cancellations and bad requests; no unexpected
    failure, gauges back at baseline, and the report with its plot (memory tolerance loose: 9 s
    does not get past the warm-up)."""
    argv = [
        sys.executable,
        "-m",
        "loadtest.soak",
        "--minutes",
        "0.15",
        "--users",
        "4",
        "--sample-s",
        "1",
        "--warmup-s",
        "2",
        "--rss-tolerance",
        "0.5",
        "--cancel-share",
        "0.2",
        "--bad-share",
        "0.1",
        "--report-dir",
        str(tmp_path),
    ]
    p = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    md = (tmp_path / "soak.md").read_text()
    assert "PASSED" in md and "0 unexpected failures" in md and "state gauges after the run: baseline" in md
    assert "server stop: clean" in md  # (a client cancelling a stream after its error response: see locustfile)
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    faults = report.fault_counts(tmp_path / "raw.jsonl")
    assert faults["cancelled"] > 0 and faults["bad"] > 0 and faults["bad_wrong"] == 0
