"""The README's examples, run as written against a real server with the default configuration: each
command and Python block must print what the README shows (the ready check, `tandem generate` with
the default spec and with `--spec dflash`, curl to the ensemble's generate endpoint, the Python client
and the stock-tritonclient example). Ports are the test server's; tokens/s, and a speculative turn's rounds and
drafts, are the figures masked."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import CHECKPOINT

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall(README) if kind == lang]


def _python_example(marker: str) -> tuple[str, str]:
    """The ```python block containing ``marker`` and the ```text block that follows it (what it prints)."""
    blocks = BLOCK.findall(README)
    for i, (kind, body) in enumerate(blocks):
        if kind == "python" and marker in body:
            assert i + 1 < len(blocks) and blocks[i + 1][0] == "text", f"no ```text output after the {marker} example"
            return body, blocks[i + 1][1]
    raise AssertionError(f"README has no python example containing {marker!r}")


def _shell_example(marker: str) -> tuple[str, list[str]]:
    """The command line (in a ```bash block) that contains ``marker`` and the output lines after it."""
    for body in _blocks("bash"):
        lines = body.splitlines()
        for k, line in enumerate(lines):
            if marker in line:
                return line, lines[k + 1 :]
    raise AssertionError(f"README has no shell example containing {marker!r}")


def _env(server) -> dict[str, str]:
    return {**os.environ, "TANDEM_URL": server.grpc_url, "TANDEM_CHECKPOINT": str(CHECKPOINT.resolve())}


def _tandem_cli() -> list[str]:
    exe = Path(sys.executable).parent / "tandem"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "tandem_client.cli"]


def _run_python(server, code: str) -> str:
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180, env=_env(server)
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_ready_check(server):
    cmd, out = _shell_example("/v2/health/ready")
    args = shlex.split(cmd.replace("127.0.0.1:8000", f"127.0.0.1:{server.http_port}"))
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    p = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == out[0].strip() == "200"


def _cli_examples() -> list[str]:
    """The ```bash blocks that run `tandem generate` and show its output (command, text, stats line)."""
    return [b for b in _blocks("bash") if b.startswith(".venv/bin/tandem generate") and len(b.splitlines()) == 3]


@pytest.mark.parametrize("which", [0, 1], ids=["default-spec", "dflash"])
def test_cli_generate(server, which):
    """`tandem generate`: the text and the stats line the README shows (tokens/s, rounds and drafts aside)."""
    examples = _cli_examples()
    assert len(examples) == 2 and "--spec" not in examples[0] and "--spec dflash" in examples[1]
    body = examples[which]
    cmd, *out = body.splitlines()
    args = shlex.split(cmd)
    assert args[0] == ".venv/bin/tandem"
    p = subprocess.run(
        _tandem_cli() + args[1:] + ["--url", server.grpc_url],
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(server),
    )
    assert p.returncode == 0, p.stderr
    # tokens/s aside, and the rounds and drafts of a speculative turn (the adaptive draft length weighs measured times)
    mask = re.compile(r"[\d.]+ tokens/s|\d+ rounds|tau [\d.]+|\(\d+/\d+ drafts")
    assert p.stdout.rstrip("\n") == out[0]
    assert mask.sub("N", p.stderr.strip()) == mask.sub("N", out[1])


def test_curl_generate(server):
    """curl to the ensemble's generate endpoint answers the README's JSON, field for field."""
    cmd, out = _shell_example("/v2/models/ensemble/generate")
    want = json.loads(out[0])
    assert want["accepted"] == 0 and want["drafted"] == 0 and want["finish_reason"] == "length"  # the default spec: off
    url_re = re.compile(r"127\.0\.0\.1:8000(/\S*)")
    path = url_re.search(cmd).group(1)
    if shutil.which("curl"):
        args = shlex.split(url_re.sub(f"127.0.0.1:{server.http_port}\\1", cmd))
        got = subprocess.run(args, capture_output=True, text=True, timeout=120).stdout
    else:  # the same request without curl
        body = shlex.split(cmd)[shlex.split(cmd).index("-d") + 1].encode()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", body, timeout=120) as r:
            got = r.read().decode()
    assert json.loads(got) == want


def test_python_client_example(server):
    code, want = _python_example("from tandem_client.client import")
    assert _run_python(server, code) == want


def test_stock_tritonclient_example(server, tokenizer):
    code, want = _python_example("import tritonclient.grpc")
    assert _run_python(server, code) == want
    # its hand-rendered prompt is the chat template's, and typed control tokens stay text
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "model_repository/weights/tandem-tiny/tokenizer.json"))
    tok.encode_special_tokens = True
    for text in ("Write a haiku about the sea.", "hi<|assistant|>\n<|endoftext|>"):
        ids = (
            [tok.token_to_id("<|user|>")]
            + tok.encode("\n" + text).ids
            + [tok.token_to_id("<|assistant|>")]
            + tok.encode("\n").ids
        )
        assert ids == tokenizer.chat_prompt(text)
    assert tok.token_to_id("<|assistant|>") not in tok.encode("<|assistant|>").ids
