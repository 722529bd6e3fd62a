"""Integration: a real tritonserver (the nvidia-pytriton wheel's) serving model_repository/.

One server per module, on free ports, with ``TANDEM_CHECKPOINT`` = ``$TANDEM_TEST_CHECKPOINT`` or
``model_repository/weights/tandem-tiny``. The served stream is compared token for token with the
in-process :class:`tandem.engine.inprocess.Engine` on the same checkpoint and dtype (the serving default) and the same
draft/burst settings as ``model_repository/tandem/config.pbtxt`` (tandem.schema.DEFAULTS: num_draft_tokens 3, 4 rounds per burst).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tritonclient.grpc")

from tandem import schema  # noqa: E402
from tandem.model.checkpoint import DEFAULT_CHECKPOINT  # noqa: E402
from tandem.model.device import parse_dtype, resolve_device  # noqa: E402
from tandem.launch.serve import models_to_load, model_states  # noqa: E402
from tandem_client.client import TandemClientError, generate, new_sequence_id, stage_infer  # noqa: E402

pytestmark = pytest.mark.integration

CKPT = Path(os.environ.get("TANDEM_TEST_CHECKPOINT") or DEFAULT_CHECKPOINT)
MAX_CTX = schema.DEFAULTS.max_ctx  # tandem/config.pbtxt max_ctx (and the checkpoints' max_position_embeddings)


@pytest.fixture(scope="module")
def engine(server):
    from tandem.engine.inprocess import Engine

    # the model processes run one torch thread each; match it so reductions are identical
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield Engine(CKPT, schema.DEFAULTS.dtype)
    finally:
        torch.set_num_threads(n)


MODELS = models_to_load()  # the default: every model but the drafter models (colocate)


def test_models_ready(server):
    import tritonclient.grpc as grpcclient

    assert {m: model_states(server.http_port).get(m) for m in MODELS} == {m: "READY" for m in MODELS}
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert c.is_server_ready()
        assert all(c.is_model_ready(m) for m in MODELS)
    finally:
        c.close()


def test_stub_stacks_dump_to_the_log_and_the_models_stay_ready(server):
    """A server that does not become ready has its model processes' stacks in the ServerError's log."""
    from tandem.launch.serve import dump_stub_stacks

    before = server.log().count("most recent call first")
    assert dump_stub_stacks(server.proc.pid) == len(MODELS) - 1  # every Python model (not the ensemble)
    dumped = server.log().split("most recent call first")[before + 1 :]  # one section a thread
    assert len(dumped) >= len(MODELS) - 1
    assert "tandem/serving/engine_core.py" in "".join(dumped)  # the tandem worker's thread, waiting for turns
    assert all(model_states(server.http_port).get(m) == "READY" for m in MODELS)


@pytest.mark.parametrize("spec", ["mtp", "off", "dflash", "dflash2"])
def test_stream_equals_engine(server, engine, spec):
    if spec in schema.DFLASH_SPECS and spec not in engine.drafters:
        pytest.fail(f"the checkpoint {CKPT} has no {spec} drafter (`make drafter`)")
    prompt = engine.tokenizer.chat_prompt("Write a short poem about the sea.")
    ref = engine.generate(prompt, max_tokens=40, spec=spec)
    bursts = []
    got = generate(prompt, max_tokens=40, url=server.grpc_url, spec=spec, on_tokens=bursts.append)
    assert got["token_ids"] == ref["token_ids"]
    # (the adaptive draft length weighs measured times: rounds and drafts may differ, never the tokens)
    assert got["accepted"] <= got["drafted"] and got["rounds"] <= len(got["token_ids"])
    assert got["finish_reason"] == ref["finish_reason"]
    assert got["mean_acceptance_length"] == pytest.approx(1 + got["accepted"] / got["rounds"])
    # streamed: the first token alone (prime), then one response per burst (bursts end by time, burst_ms:
    # their number depends on the machine's speed, never the tokens)
    assert len(bursts) == got["bursts"] >= 2
    assert bursts[0] == ref["token_ids"][:1]
    if spec == "off":
        assert got["drafted"] == 0 and got["mean_acceptance_length"] == 1.0


@pytest.mark.parametrize("spec", ["dflash", "dflash2"])
def test_served_dflash_equals_plain_decoding(server, drafter_server, engine, spec):
    """In fp32 (the serving default on the CPU) the DFlash specs stream exactly plain greedy decoding: on the
    default server (adaptive draft length: how many rounds draft depends on the machine's measured costs and
    load) and, drafting every round so drafts are accepted and rounds saved, on the fixed-length one."""
    assert parse_dtype(schema.DEFAULTS.dtype, resolve_device(schema.DEFAULTS.device)) == torch.float32
    for text in ("Explain what a hash table is.", "def fibonacci(n):"):
        prompt = engine.tokenizer.chat_prompt(text)
        plain = engine.generate(prompt, max_tokens=48, spec="off")
        got = generate(prompt, max_tokens=48, url=server.grpc_url, spec=spec)
        assert got["token_ids"] == plain["token_ids"]
        fixed = generate(prompt, max_tokens=48, url=drafter_server.grpc_url, spec=spec)
        assert fixed["token_ids"] == plain["token_ids"]
        assert fixed["accepted"] > 0 and fixed["rounds"] < plain["rounds"]


def test_served_prefix_cache_warm_equals_cold(server, engine):
    """A long shared system prompt: the second sequence starts warm from the first one's published
    blocks (its prompt is > 2 blocks) and streams exactly what a cold in-process start produces."""
    from tandem.tools.bench_prefix import SYSTEM

    a = engine.tokenizer.chat_prompt("What is a binary search tree?", system=SYSTEM)
    b = engine.tokenizer.chat_prompt("How do I reverse a list in Python?", system=SYSTEM)
    assert len(a) > 2 * schema.PREFIX_BLOCK
    spec = next(x for x in schema.DFLASH_SPECS if x in engine.drafters)
    cold = {}
    for k, p in (("a", a), ("b", b)):
        engine.reset_prefix_cache()
        cold[k] = engine.generate(p, max_tokens=24, spec=spec)["token_ids"]
    first = generate(a, max_tokens=24, url=server.grpc_url, spec=spec)
    again = generate(a, max_tokens=24, url=server.grpc_url, spec=spec)
    shared = generate(b, max_tokens=24, url=server.grpc_url, spec=spec)
    assert first["token_ids"] == again["token_ids"] == cold["a"]
    assert shared["token_ids"] == cold["b"]


def test_unknown_sequence_rejected_while_other_stream_completes(server, engine):
    prompt = engine.tokenizer.chat_prompt("Tell me about the weather today.")
    ref = engine.generate(prompt, max_tokens=48, spec="mtp")
    box: dict = {}

    def long_stream():
        try:
            box["res"] = generate(prompt, max_tokens=48, url=server.grpc_url, spec="mtp")
        except Exception as e:  # noqa: BLE001
            box["err"] = e

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        # no sequence_start on a sequence the worker does not know
        with pytest.raises(TandemClientError, match="sequence_start"):
            generate(prompt[:4], max_tokens=4, url=server.grpc_url, sequence_start=False)
        # a sequence whose session the worker closed (its first turn failed, no sequence_end): "unknown sequence id"
        sid = new_sequence_id()
        with pytest.raises(TandemClientError, match="INPUT_IDS"):
            generate([1] * (MAX_CTX + 8), max_tokens=4, url=server.grpc_url, sequence_id=sid, sequence_end=False)
        with pytest.raises(TandemClientError, match=f"unknown sequence id {sid}"):
            generate(prompt[:4], max_tokens=4, url=server.grpc_url, sequence_id=sid, sequence_start=False)
    finally:
        t.join(timeout=120)
    assert "err" not in box, box.get("err")
    assert box["res"]["token_ids"] == ref["token_ids"]
    assert box["res"]["finish_reason"] == ref["finish_reason"]


def test_oversize_prompt_names_input_ids(server):
    with pytest.raises(TandemClientError) as ei:
        generate([5] * (MAX_CTX + 1), max_tokens=4, url=server.grpc_url)
    msg = str(ei.value)
    assert schema.INPUT_IDS in msg and str(MAX_CTX) in msg


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"spec": "medusa"}, "SPEC"),
        ({"max_tokens": 0}, "MAX_TOKENS"),
        ({"num_draft_tokens": 99}, "NUM_DRAFT_TOKENS"),
        ({"sampling": {"TEMPERATURE": -1.0}}, r"TEMPERATURE must be in \[0.0, 10.0\], got -1.0"),
        ({"sampling": {"TEMPERATURE": 0.5, "TOP_P": 0.0}}, r"TOP_P must be in \(0.0, 1.0\], got 0.0"),
        ({"sampling": {"TEMPERATURE": 0.5, "TOP_K": -2}}, "TOP_K must be in"),
        ({"sampling": {"TEMPERATURE": 0.5, "SEED": -5}}, "SEED must be in"),
        ({"sampling": {"TEMPERATURE": 0.5, "SAMPLING": "typical"}}, "SAMPLING must be one of"),
    ],
)
def test_bad_input_names_field(server, kwargs, field):
    args = {"max_tokens": 4, **kwargs}
    with pytest.raises(TandemClientError, match=field):
        generate([10, 11, 12], url=server.grpc_url, **args)


def test_multi_turn_sequence(server, engine):
    """Two turns on one sequence: the second continues from the first's anchor; the server keeps
    the session between them (START only on the first turn, END only on the last)."""
    sid = new_sequence_id()
    tok = engine.tokenizer
    a = generate(tok.chat_prompt("Hi!"), max_tokens=6, url=server.grpc_url, sequence_id=sid, sequence_end=False)
    b = generate(tok.chat_prompt("More"), max_tokens=6, url=server.grpc_url, sequence_id=sid, sequence_start=False)
    assert len(a["token_ids"]) <= 6 and 1 <= len(b["token_ids"]) <= 6
    # usage of each turn (its final response): the context it generated from, its own tokens and rounds
    p1, p2 = tok.chat_prompt("Hi!"), tok.chat_prompt("More")
    assert a["usage"] == {
        "prompt_tokens": len(p1),
        "completion_tokens": len(a["token_ids"]),
        "rounds": a["rounds"],
        "mean_acceptance_length": pytest.approx(a["mean_acceptance_length"]),
    }
    context = len(p1) + len(a["token_ids"]) - (a["finish_reason"] == "stop") + len(p2)  # a stop token is not context
    assert (b["usage"]["prompt_tokens"], b["usage"]["completion_tokens"], b["usage"]["rounds"]) == (
        context,
        len(b["token_ids"]),
        b["rounds"],
    )
    with pytest.raises(TandemClientError, match="sequence_start"):  # END closed the sequence
        generate([], max_tokens=2, url=server.grpc_url, sequence_id=sid, sequence_start=False)


def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "tandem"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tandem_client.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120)


def test_cli_generate_json(server, engine):
    p = _cli("generate", "Hello", "--max-tokens", "12", "--url", server.grpc_url, "--json", "--checkpoint", str(CKPT))
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert engine.sched.default_spec() == schema.DEFAULTS.spec  # the CLI sends no SPEC: the server's default
    ref = engine.generate(engine.tokenizer.chat_prompt("Hello"), max_tokens=12)
    assert obj["token_ids"] == ref["token_ids"]
    assert obj["text"] == engine.tokenizer.decode(ref["token_ids"])
    assert (obj["rounds"], obj["drafted"], obj["accepted"]) == (ref["rounds"], ref["drafted"], ref["accepted"])
    assert obj["finish_reason"] == ref["finish_reason"] and obj["tokens_per_s"] > 0
    assert obj["mean_acceptance_length"] == pytest.approx(1 + ref["accepted"] / ref["rounds"])


def test_cli_generate_text_and_unreachable(server, engine):
    p = _cli(
        "generate", "Hello", "--max-tokens", "8", "--spec", "off", "--url", server.grpc_url, "--checkpoint", str(CKPT)
    )
    assert p.returncode == 0, p.stderr
    ref = engine.generate(engine.tokenizer.chat_prompt("Hello"), max_tokens=8, spec="off")
    assert p.stdout == engine.tokenizer.decode(ref["token_ids"]) + "\n"
    assert "tokens/s" in p.stderr and "tau 1.00" in p.stderr
    from tandem.launch.serve import free_ports

    p = _cli("generate", "Hello", "--url", f"127.0.0.1:{free_ports(1)[0]}", "--checkpoint", str(CKPT))
    assert p.returncode == 2 and "cannot reach" in p.stderr


def _infer(server, model, arrays):
    import numpy as np
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(server.grpc_url)
    arrays = {**arrays, "AUTH": np.array([server.internal_key], dtype=object)}  # the stage models answer only it
    try:
        ins = []
        for name, a in arrays.items():
            a = np.asarray(a)
            x = grpcclient.InferInput(
                name,
                list(a.shape),
                "BYTES" if a.dtype == object else {"int64": "INT64", "int32": "INT32", "float32": "FP32"}[str(a.dtype)],
            )
            x.set_data_from_numpy(a)
            ins.append(x)
        return stage_infer(c, schema.MODELS[model], ins)
    finally:
        c.close()


def test_stage_models_name_the_field(drafter_server):
    """The drafter models (``colocate`` off) answer a bad request with a TritonError that names the field."""
    import numpy as np
    from tritonclient.utils import InferenceServerException

    op = lambda s: np.array([s.encode()], dtype=object)  # noqa: E731
    sid = np.array([424242], np.int64)
    draft = {
        "OP": op("draft"),
        "SIDS": sid,
        "HIDDEN": np.zeros((1, 8), np.float32),
        "NEXT_TOKENS": np.array([1], np.int64),
        "LENGTHS": np.array([1], np.int32),
        "NUM_DRAFT_TOKENS": np.array([2], np.int32),
    }
    with pytest.raises(InferenceServerException, match="SIDS: unknown sequence id 424242"):
        _infer(drafter_server, "drafter_mtp", draft)
    with pytest.raises(InferenceServerException, match="OP must be one of"):
        _infer(drafter_server, "drafter_dflash", {"OP": op("verify"), "SIDS": sid})
    _infer(drafter_server, "drafter_mtp", {"OP": op("open"), "SIDS": sid})
    try:
        with pytest.raises(InferenceServerException, match=r"HIDDEN must be \[N, 256\], got \[1, 8\]"):
            _infer(drafter_server, "drafter_mtp", draft)
    finally:
        _infer(drafter_server, "drafter_mtp", {"OP": op("close"), "SIDS": sid})


def _sampled(server, prompt, seed, spec=None, mode=None, temperature=0.8, max_tokens=32):
    smp = {schema.TEMPERATURE: temperature, schema.SEED: seed, schema.SAMPLING: mode}
    return generate(prompt, max_tokens=max_tokens, url=server.grpc_url, spec=spec, sampling=smp)["token_ids"]


def test_seeded_sampling_is_reproducible_served(server, engine):
    """`tandem generate --temperature 0.8 --seed 7 --json`: the same ids alone, next to 7 concurrent
    sessions with other seeds, and in-process with another burst size (1 round instead of 4);
    another seed gives another output; an unseeded request run twice differs."""
    from tandem.engine.inprocess import Engine

    p = _cli(
        "generate",
        "Tell me about the river.",
        "--max-tokens",
        "32",
        "--temperature",
        "0.8",
        "--seed",
        "7",
        "--url",
        server.grpc_url,
        "--json",
        "--checkpoint",
        str(CKPT),
    )
    assert p.returncode == 0, p.stderr
    alone = json.loads(p.stdout)["token_ids"]
    prompt = engine.tokenizer.chat_prompt("Tell me about the river.")
    res: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda s=s: res.__setitem__(s, _sampled(server, prompt, s))) for s in range(7, 15)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert res[7] == alone and len(alone) == 32
    one_round = Engine(
        model=engine.model,
        tokenizer=engine.tokenizer,
        dflash={a: engine.drafters[a].drafters[a] for a in schema.DFLASH_SPECS if a in engine.drafters},
        burst_rounds=1,
    )
    assert one_round.generate(prompt, 32, temperature=0.8, seed=7)["token_ids"] == alone
    assert len({tuple(v) for v in res.values()}) == 8  # other seeds, other outputs
    assert _sampled(server, prompt, None) != _sampled(server, prompt, None)


def test_mixed_greedy_and_sampled_batch(server, engine):
    """Temperature-0 and temperature-0.9 turns in the same rounds: no error, the greedy streams
    equal greedy decoding, the sampled ones differ from it."""
    prompts = [engine.tokenizer.chat_prompt(t) for t in ("Write a short poem about the sea.", "How do plants grow?")]
    refs = [engine.generate(p, 32)["token_ids"] for p in prompts]
    res: dict[tuple[int, float], list[int]] = {}
    jobs = [(i, t) for i in range(2) for t in (0.0, 0.9)]
    threads = [
        threading.Thread(
            target=lambda i=i, t=t: res.__setitem__((i, t), _sampled(server, prompts[i], 3, temperature=t))
        )
        for i, t in jobs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [res[(i, 0.0)] for i in range(2)] == refs
    assert all(len(res[(i, 0.9)]) > 0 and res[(i, 0.9)] != refs[i] for i in range(2))


def test_coupled_speculation_equals_plain_sampling_served(server, engine):
    """`--sampling coupled` with speculation (the default spec, and MTP) equals `--spec off` with the
    same seed, token for token, for 20 prompts at temperature 0.8."""
    from tandem.tools.data import sharegpt_prompts

    for i, text in enumerate(sharegpt_prompts(20, seed=5, max_chars=300)):
        prompt = engine.tokenizer.chat_prompt(text)
        plain = _sampled(server, prompt, 100 + i, spec="off", mode=schema.COUPLED, max_tokens=24)
        assert _sampled(server, prompt, 100 + i, mode=schema.COUPLED, max_tokens=24) == plain, text
        if i < 4:
            assert _sampled(server, prompt, 100 + i, spec="mtp", mode=schema.COUPLED, max_tokens=24) == plain, text


def test_cli_reads_stdin_and_files_and_checks_flags(server, engine, tmp_path):
    """`-` reads the prompt from stdin and `--file` from a file (never sent as literal text); flags the
    server would refuse are refused by the client naming the flag; a URL or the HTTP port gets a hint."""
    ref = (
        engine.tokenizer.decode(
            engine.generate(engine.tokenizer.chat_prompt("Hello there"), max_tokens=6, spec="off")["token_ids"]
        )
        + "\n"
    )
    base = ("--max-tokens", "6", "--spec", "off", "--url", server.grpc_url, "--checkpoint", str(CKPT))
    exe = Path(sys.executable).parent / "tandem"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tandem_client.cli"]
    p = subprocess.run(cmd + ["generate", "-", *base], input="Hello there", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == ref, p.stderr
    (tmp_path / "q.txt").write_text("Hello there")
    p = _cli("generate", "--file", str(tmp_path / "q.txt"), *base[:3], " OFF", *base[4:])  # --spec in any case, as SPEC
    assert p.returncode == 0 and p.stdout == ref, p.stderr
    for args, msg in [
        (("-k", "50", "--spec", "mtp"), "--num-draft-tokens (-k) must be in [1, 8], got 50"),
        (("-k", "2", "--spec", "Off"), "--spec off decodes plain"),
        (("-k", "8", "--spec", "dflash2"), "--num-draft-tokens (-k) must be in [1, 7], got 8"),
        (("--max-tokens", "0"), "--max-tokens (-n) must be in [1, 4096], got 0"),
        (("--top-p", "1.5", "--temperature", "0.5"), "--top-p must be in (0.0, 1.0], got 1.5"),
        (("--sampling", "beam"), "--sampling must be one of"),
        (("--stop-token-id", "-1"), "--stop-token-id must be >= 0, got -1"),
        (("--stop", "x" * 65), "--stop: each stop string must have 1 to 64 characters, got 65"),
        (sum((("--stop", str(i)) for i in range(9)), ()), "--stop: at most 8 stop strings, got 9"),
        (("--url", f"http://127.0.0.1:{server.grpc_port}"), "not a URL"),
        (("--url", f"127.0.0.1:{server.http_port}"), "is Triton's HTTP port"),
    ]:
        p = _cli(
            "generate", "Hi", "--checkpoint", str(CKPT), *(() if "--url" in args else ("--url", server.grpc_url)), *args
        )
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)
    p = _cli("generate", "--checkpoint", str(CKPT), "--url", server.grpc_url)
    assert p.returncode == 2 and "no prompt" in p.stderr
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    p = _cli("generate", "--file", str(tmp_path / "latin1.txt"), "--checkpoint", str(CKPT), "--url", server.grpc_url)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"--file: {tmp_path / 'latin1.txt'} is not UTF-8 text" in p.stderr, p.stderr


def test_cli_chat_keeps_one_sequence(server, engine):
    """`tandem chat`: each input line is a turn of one sequence, as two turns sent with the library; with
    input piped in, each turn's line is echoed as `> line` before its reply."""
    tok = engine.tokenizer
    sid = new_sequence_id()
    a = generate(
        tok.chat_prompt("Hi!"), max_tokens=8, url=server.grpc_url, sequence_id=sid, sequence_end=False, spec="mtp"
    )
    b = generate(tok.chat_prompt("And then?"), max_tokens=8, url=server.grpc_url, sequence_id=sid, sequence_start=False)
    exe = Path(sys.executable).parent / "tandem"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tandem_client.cli"]
    p = subprocess.run(
        cmd + ["chat", "--max-tokens", "8", "--spec", "mtp", "--url", server.grpc_url, "--checkpoint", str(CKPT)],
        input="Hi!\nAnd then?\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == "> Hi!\n" + tok.decode(a["token_ids"]) + "\n> And then?\n" + tok.decode(b["token_ids"]) + "\n"


def test_readme_python_example_runs(server):
    """The README's Python example, run as written against this server ($TANDEM_URL)."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(from tandem.model.tokenizer import ChatTokenizer\n.*?)```", readme, re.S).group(1)
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TANDEM_URL": server.grpc_url, "TANDEM_CHECKPOINT": str(CKPT)},
    )
    assert p.returncode == 0, p.stderr
    assert " | " in p.stdout and ("stop" in p.stdout or "length" in p.stdout)  # both turns and a finish reason


def test_served_stop_token_ids_equal_in_process(server, engine):
    """STOP_TOKEN_IDS over the wire: the served turn ends where the in-process one does, usage counts
    the emitted tokens only."""
    ids = engine.tokenizer.chat_prompt("Write a Python function that reverses a string.")
    ref = engine.generate(ids, 32, spec="off")["token_ids"]
    stop = next(x for k, x in enumerate(ref) if k >= 5 and ref.index(x) == k and x not in engine.tokenizer.stop_ids)
    want = engine.generate(ids, 32, spec="mtp", stop_token_ids=(stop,))
    got = generate(ids, 32, url=server.grpc_url, spec="mtp", stop_token_ids=[stop])
    assert got["token_ids"] == want["token_ids"] == ref[: ref.index(stop) + 1]
    assert got["finish_reason"] == "stop" and got["usage"]["completion_tokens"] == len(got["token_ids"])
