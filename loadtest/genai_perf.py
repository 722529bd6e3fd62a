"""``make genai-perf``: NVIDIA's GenAI-Perf profiles the ``ensemble`` (text in, text out) over gRPC
streaming, as it profiles a TensorRT-LLM Triton deployment, or with ``--target openai`` the OpenAI-compatible
front's streaming ``/v1/chat/completions`` (``--endpoint-type chat``), as it profiles vLLM or SGLang.

Steps: set up its own virtual environment (``--venv``, default ``.venv-genai``; genai-perf pins
numpy 2 and transformers 5, which tandem's environment does not take) with ``genai-perf`` and the
``perf_analyzer`` binary it drives; start ``tritonserver`` on free 127.0.0.1 ports unless ``--url``
is given (and for ``--target openai`` the front beside it unless ``--openai-url`` is); run ``genai-perf profile -m
ensemble --backend tensorrtllm --streaming`` (or ``-m tandem --endpoint-type chat --streaming``) with synthetic
prompts counted in the checkpoint's own tokenizer; print its table (TTFT, inter-token latency,
throughput) and keep its artifacts in ``--report-dir`` (default ``reports/genai-perf-<UTC time>/``).

Measured facts behind the setup (2026-12, Debian 12, Python 3.11): the PyPI ``perf-analyzer``
package holds no binary; ``perf_analyzer`` ships inside the ``tritonclient`` wheels, where 2.60 and
newer need glibc 2.38 (Debian 12 has 2.36) and 2.51.0 runs once ``libb64.so.0d`` (Debian
``libb64-0d``) and ``libcudart.so.12`` (PyPI ``nvidia-cuda-runtime-cu12``) are on its library path.
genai-perf's tensorrtllm requests carry ``text_input``, ``max_tokens``, ``stream`` and
``exclude_input_in_output`` (the ensemble declares all four); it reads ``text_output``.

Exit status: 0 when the profile completed, 1 when genai-perf failed, 2 when the setup failed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import typer

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tandem import schema_text  # noqa: E402

GENAI_PERF = "genai-perf==0.0.16"
CUDART = "nvidia-cuda-runtime-cu12==12.9.79"
#: the newest tritonclient wheel whose perf_analyzer runs on glibc 2.36
PERF_ANALYZER_WHEEL = "tritonclient==2.51.0"
MODEL = schema_text.ENSEMBLE.name

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])


class SetupError(RuntimeError):
    """The profiling environment could not be built (the message says which step and why)."""


def _run(argv: list, what: str, **kw) -> subprocess.CompletedProcess:
    print(f"genai-perf setup: {what}", flush=True)
    res = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise SetupError(f"{what} failed (exit {res.returncode}): {(res.stderr or res.stdout)[-2000:]}")
    return res


def ensure_env(venv: Path) -> Path:
    """Build ``venv`` (once: a ``.stamp`` file marks it done) with genai-perf and a runnable
    ``perf_analyzer`` wrapper in its ``bin``. Returns the ``bin`` folder. Raises :class:`SetupError`."""
    venv = venv.resolve()
    bindir, stamp = venv / "bin", venv / ".stamp"
    if stamp.exists() and stamp.read_text() == f"{GENAI_PERF} {CUDART} {PERF_ANALYZER_WHEEL}":
        return bindir
    if not (bindir / "python").exists():
        _run([sys.executable, "-m", "venv", venv], f"virtual environment {venv}")
    pip = [bindir / "python", "-m", "pip", "install", "-q"]
    _run(pip + [GENAI_PERF, CUDART], f"pip install {GENAI_PERF} {CUDART}")
    opt = venv / "opt" / "perf_analyzer"
    (opt / "lib").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _run(
            pip[:3] + ["download", "-q", "--no-deps", "-d", tmp, PERF_ANALYZER_WHEEL], f"download {PERF_ANALYZER_WHEEL}"
        )
        wheel = next(Path(tmp).glob("tritonclient-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith("/data/bin/perf_analyzer"))
            (opt / "perf_analyzer").write_bytes(z.read(member))
        (opt / "perf_analyzer").chmod(0o755)
        if not _have_lib("libb64.so.0d"):
            try:
                _run(["apt-get", "download", "libb64-0d"], "apt-get download libb64-0d (Debian)", cwd=tmp)
            except SetupError:  # a fresh machine may have no package lists yet
                _run(["apt-get", "update", "-q"], "apt-get update")
                _run(["apt-get", "download", "libb64-0d"], "apt-get download libb64-0d (Debian)", cwd=tmp)
            deb = next(Path(tmp).glob("libb64-0d_*.deb"))
            _run(["dpkg-deb", "-x", deb, Path(tmp) / "deb"], f"unpack {deb.name}")
            for lib in (Path(tmp) / "deb").rglob("libb64.so.0d*"):
                shutil.copy2(lib, opt / "lib" / lib.name, follow_symlinks=True)
    cudart = next((venv / "lib").glob("python3*/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"), None)
    if cudart is None:
        raise SetupError(f"{CUDART} installed no libcudart.so.12 under {venv}")
    dst = opt / "lib" / "libcudart.so.12"
    if not dst.exists():
        dst.symlink_to(cudart)
    wrapper = bindir / "perf_analyzer"
    wrapper.write_text(
        f"#!/bin/sh\n# perf_analyzer from {PERF_ANALYZER_WHEEL} with its libraries (loadtest/genai_perf.py)\n"
        f'LD_LIBRARY_PATH="{opt / "lib"}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" exec "{opt / "perf_analyzer"}" "$@"\n'
    )
    wrapper.chmod(0o755)
    res = subprocess.run([wrapper, "--version"], capture_output=True, text=True)
    if "Perf Analyzer" not in res.stdout + res.stderr:
        raise SetupError(f"perf_analyzer does not run: {(res.stderr or res.stdout)[-1500:]}")
    stamp.write_text(f"{GENAI_PERF} {CUDART} {PERF_ANALYZER_WHEEL}")
    return bindir


def _have_lib(name: str) -> bool:
    res = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True)
    return name in res.stdout


def summary(artifact_dir: Path) -> dict:
    """TTFT, inter-token latency (ms: avg / p50 / p90) and throughput (output tokens/s, requests/s)
    from genai-perf's ``profile_export_genai_perf.json`` under ``artifact_dir``. Raises
    ``FileNotFoundError`` when genai-perf wrote none."""
    path = next(artifact_dir.rglob("profile_export_genai_perf.json"))
    data = json.loads(path.read_text())
    pick = lambda k: {s: round(float(data[k][s]), 2) for s in ("avg", "p50", "p90") if s in data.get(k, {})}  # noqa: E731
    return {
        "time_to_first_token_ms": pick("time_to_first_token"),
        "inter_token_latency_ms": pick("inter_token_latency"),
        "output_token_throughput_per_s": round(float(data["output_token_throughput"]["avg"]), 1),
        "request_throughput_per_s": round(float(data["request_throughput"]["avg"]), 3),
        "request_count": int(data["request_count"]["avg"]),
    }


@app.command()
def main(
    url: str = typer.Option("", "--url", help="gRPC host:port of a running server (default: start one here)"),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="requests in flight"),
    requests: int = typer.Option(24, "--requests", min=1, help="requests measured (after the warm-up)"),
    input_tokens: int = typer.Option(64, "--input-tokens", min=1, help="synthetic prompt length (tokens)"),
    output_tokens: int = typer.Option(128, "--output-tokens", min=1, help="max_tokens per request"),
    venv: Path = typer.Option(REPO_ROOT / ".venv-genai", "--venv", help="genai-perf's own virtual environment"),
    report_dir: Path = typer.Option(None, "--report-dir", help="artifacts [default: reports/genai-perf-<UTC time>]"),
    target: str = typer.Option("ensemble", "--target", help="ensemble (gRPC streaming) | openai (the OpenAI front)"),
    openai_url: str = typer.Option("", "--openai-url", help="host:port of a running OpenAI front (--target openai)"),
) -> None:
    """Profile the ensemble over gRPC streaming, or the OpenAI front's chat completions, with genai-perf and
    print TTFT, ITL and throughput."""
    if target not in ("ensemble", "openai"):
        typer.echo(f"error: --target must be ensemble or openai, got {target!r}", err=True)
        raise typer.Exit(2)
    try:
        bindir = ensure_env(venv)
    except (SetupError, StopIteration, OSError) as e:
        typer.echo(f"error: genai-perf setup: {e}", err=True)
        raise typer.Exit(2)
    report_dir = report_dir or REPO_ROOT / "reports" / f"genai-perf-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}"
    report_dir.mkdir(parents=True, exist_ok=True)
    from tandem_client.client import default_checkpoint

    tok_dir = report_dir / "tokenizer"  # the tokenizer alone: AutoTokenizer reads tokenizer.json offline
    tok_dir.mkdir(exist_ok=True)
    shutil.copy2(default_checkpoint() / "tokenizer.json", tok_dir / "tokenizer.json")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1"}

    def profile(url: str) -> int:
        endpoint = ["-m", MODEL, "--backend", "tensorrtllm"] if target == "ensemble" else ["-m", "tandem"]
        endpoint += [] if target == "ensemble" else ["--endpoint-type", "chat"]
        argv = [
            bindir / "genai-perf",
            "profile",
            *endpoint,
            "--streaming",
            "-u",
            url,
            "--tokenizer",
            tok_dir,
            "--concurrency",
            concurrency,
            "--request-count",
            requests,
            "--warmup-request-count",
            min(4, requests),
            "--num-prompts",
            requests,
            "--synthetic-input-tokens-mean",
            input_tokens,
            "--synthetic-input-tokens-stddev",
            0,
            "--output-tokens-mean",
            output_tokens,
            "--random-seed",
            0,
            "--artifact-dir",
            report_dir / "artifacts",
        ]
        print("running:", " ".join(str(a) for a in argv), flush=True)
        return subprocess.run([str(a) for a in argv], env=env).returncode

    if target == "openai" and openai_url:
        rc = profile(openai_url)
    elif url and target == "ensemble":
        rc = profile(url)
    else:
        from tandem.launch.host import free_ports
        from tandem.launch.serve import running_server, start_openai_front, stop_openai_front, wait_openai_front

        def front(grpc_url: str) -> int:
            (port,) = free_ports(1)
            proc = start_openai_front(grpc_url, port)
            try:
                wait_openai_front(proc, "127.0.0.1", port)
                return profile(f"127.0.0.1:{port}")
            finally:
                stop_openai_front(proc)

        if url:
            rc = front(url)
        else:
            print("starting tritonserver on free 127.0.0.1 ports ...", flush=True)
            with running_server(ready_timeout_s=240) as srv:
                rc = profile(srv.grpc_url) if target == "ensemble" else front(srv.grpc_url)
    if rc != 0:
        typer.echo(f"error: genai-perf exited {rc}", err=True)
        raise typer.Exit(1)
    s = summary(report_dir / "artifacts")
    (report_dir / "summary.json").write_text(json.dumps(s, indent=2))
    print(json.dumps(s, indent=2))
    print(f"artifacts: {report_dir}")


if __name__ == "__main__":
    app()
