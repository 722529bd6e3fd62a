"""Run the real ``tritonserver`` shipped in the ``nvidia-pytriton`` wheel on tandem's model repository.

The wheel ships ``tritonserver`` 2.51.0, the Python backend and one backend stub per Python
version, but not laid out as a backend folder. :func:`ensure_backend_dir` assembles
``triton_backends/python/`` (repo root, gitignored) from it; :func:`server_command_and_env` builds
the argv and environment (README, "Running tritonserver from the wheel"); :func:`running_server` starts a server for tests and
always stops it; ``python -m tandem.launch.serve serve`` runs one in the foreground. Both put the bounded
HTTP front (:mod:`tandem.launch.http_front`) on the public HTTP and metrics ports: Triton 2.51 crashes on
an HTTP request body of ~4.2 MB, so its own HTTP and metrics services listen on loopback behind it.
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

import typer

from .. import schema, schema_text
from .. import internal_key
from .haproxy import HaproxyError
from .host import busy_ports, free_ports, new_shm_prefix, remove_shm
from .http_front import MAX_BODY_BYTES, Front, FrontError, start_front, wait_front

REPO_ROOT = Path(__file__).resolve().parents[3]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
BACKEND_ROOT = REPO_ROOT / "triton_backends"
#: every model of the repository: the session models, then the text front (ensemble last: its steps load first)
MODELS = tuple(schema.MODELS) + tuple(schema_text.MODELS)
#: the drafter models: loaded only with ``colocate`` off (else the drafters run in the ``tandem`` model's process)
DRAFTER_MODELS = (schema.DRAFTER_MTP.name, schema.DRAFTER_DFLASH.name)


def models_to_load(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The models a server loads (explicit model control: ``model_repository/weights`` is not a model):
    every model but the drafter models, which only ``colocate`` off loads (``$TANDEM_COLOCATE`` in ``env``, then
    in this process's environment; else the default). Raises ``ValueError`` for a bad ``$TANDEM_COLOCATE``."""
    name = schema.env_name("colocate")
    value = (env or {}).get(name) or os.environ.get(name)
    colocate = schema.ServingConfig.from_parameters({"colocate": value}).colocate if value else schema.DEFAULTS.colocate
    return tuple(m for m in MODELS if not colocate or m not in DRAFTER_MODELS)


class ServerError(RuntimeError):
    """The server could not be prepared, did not become ready, or exited early (message carries its log)."""


def wheel_paths() -> dict[str, Path]:
    """Paths inside the installed ``nvidia-pytriton`` wheel.

    Returns ``root`` (``pytriton/tritonserver``), ``tritonserver`` (binary), ``python_backend``
    (``backends/python``), ``stub`` (the stub for this interpreter's ``major.minor``) and ``libs``
    (``nvidia_pytriton.libs``). Raises :class:`ServerError` when the wheel or a part is missing.
    """
    try:
        import pytriton
    except ImportError as e:
        raise ServerError("nvidia-pytriton is not installed in this environment (run `make setup`)") from e
    pkg = Path(pytriton.__file__).resolve().parent
    root = pkg / "tritonserver"
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    p = {
        "root": root,
        "tritonserver": root / "bin" / "tritonserver",
        "python_backend": root / "backends" / "python",
        "stub": root / "python_backend_stubs" / ver / "triton_python_backend_stub",
        "libs": pkg.parent / "nvidia_pytriton.libs",
    }
    for k, v in p.items():
        if not v.exists():
            raise ServerError(f"nvidia-pytriton wheel lacks {k}: {v} (python {ver})")
    return p


def ensure_backend_dir(dest: str | Path = BACKEND_ROOT) -> Path:
    """Assemble ``<dest>/python/`` = the wheel's ``backends/python/*`` + the matching
    ``triton_python_backend_stub``. Idempotent: files already identical (size + mtime, or
    content) are left alone, so a second call costs a few ``stat`` calls.

    Returns ``dest`` (the value for ``--backend-directory``). Raises :class:`ServerError` if the
    wheel is missing.
    """
    p = wheel_paths()
    out = Path(dest) / "python"
    out.mkdir(parents=True, exist_ok=True)
    sources = [f for f in p["python_backend"].iterdir() if f.is_file()] + [p["stub"]]
    for src in sources:
        dst = out / src.name
        if dst.exists() and filecmp.cmp(src, dst, shallow=True):
            continue
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    stub = out / p["stub"].name
    stub.chmod(stub.stat().st_mode | 0o111)
    return Path(dest)


def server_command_and_env(
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    model_repository: str | Path = MODEL_REPOSITORY,
    models: tuple[str, ...] | None = None,
    exit_timeout_s: int = 10,
    log_verbose: int = 0,
    env_overrides: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    shm_prefix: str | None = None,
    http_host: str | None = None,
    metrics_host: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The ``tritonserver`` argv and environment for ``model_repository``.

    Binds HTTP/gRPC/metrics to ``host`` (127.0.0.1 unless told; ``http_host`` / ``metrics_host`` override it for
    HTTP / metrics: the bounded front's internal ports) on the given ports, loads ``models`` explicitly, passes
    ``--exit-timeout-secs``; ``LD_LIBRARY_PATH`` gets the wheel's ``nvidia_pytriton.libs`` and the
    interpreter's ``LIBDIR`` (for ``libpython``) in front, ``PATH`` the virtual environment's
    ``bin`` first (the stub's embedded interpreter finds the venv from it). ``env_overrides``
    (e.g. ``TANDEM_CHECKPOINT``) are applied last; ``shm_prefix`` names the Python backend's shared-memory
    regions (``shm-region-prefix-name``; None: Triton's default). Assembles the backend folder if needed.
    """
    p = wheel_paths()
    backend_dir = ensure_backend_dir()
    models = models_to_load(env_overrides) if models is None else models
    argv = [
        str(p["tritonserver"]),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--backend-directory={backend_dir}",
        "--model-control-mode=explicit",
        *[f"--load-model={m}" for m in models],
        f"--http-address={http_host or host}",
        f"--http-port={http_port}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
        f"--metrics-address={metrics_host or host}",
        f"--metrics-port={metrics_port}",
        "--allow-gpu-metrics=false",
        f"--exit-timeout-secs={exit_timeout_s}",
        f"--log-verbose={log_verbose}",
        *([f"--backend-config=python,shm-region-prefix-name={shm_prefix}"] if shm_prefix else []),
    ]
    env = os.environ.copy()
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ld = [str(p["libs"]), libdir] + [x for x in env.get("LD_LIBRARY_PATH", "").split(":") if x]
    env["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(x for x in ld if x))
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = ":".join([venv_bin] + [x for x in env.get("PATH", "").split(":") if x and x != venv_bin])
    env.setdefault("OMP_NUM_THREADS", "1")
    env[internal_key.ENV] = internal_key.new_key()  # a key of this server's own: its stage models answer only it
    env.update(env_overrides or {})
    return argv, env


def _http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def model_states(http_port: int) -> dict[str, str]:
    """``{model: state}`` from the repository index (``POST /v2/repository/index``); {} if unreachable."""
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/index", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=2.0) as r:
            return {m["name"]: m.get("state", "") for m in json.loads(r.read())}
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def wait_ready(
    proc: subprocess.Popen,
    http_port: int,
    models: tuple[str, ...],
    timeout_s: float,
    log_path: Path | None = None,
    metrics_port: int | None = None,
) -> float:
    """Poll until ``/v2/health/ready`` is 200, every model in ``models`` is READY and (``metrics_port``)
    ``/metrics`` answers: Triton starts its metrics service after the HTTP one (42 ms later in one run,
    where a test's first metrics read found the port closed).

    Returns seconds waited. Raises :class:`ServerError` (with the log tail) on timeout or if the
    process exits first.
    """
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise ServerError(f"tritonserver exited with code {proc.returncode} before ready\n{_log_tail(log_path)}")
        code, _ = _http_get(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=1.0)
        if code == 200:
            st = model_states(http_port)
            if all(st.get(m) == "READY" for m in models) and (
                metrics_port is None or _http_get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1.0)[0] == 200
            ):
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            dumped = dump_stub_stacks(proc.pid)
            raise ServerError(
                f"tritonserver not ready after {timeout_s:.0f} s (models: {model_states(http_port)}; "
                f"Python stacks of {dumped} model processes in the log)\n{_log_tail(log_path)}"
            )
        time.sleep(0.25)


def dump_stub_stacks(root_pid: int, settle_s: float = 1.0) -> int:
    """Send :data:`tandem.schema.STACK_DUMP_SIGNAL` to every Python-backend stub process under
    ``root_pid`` (each writes its threads' stacks to the server log), wait ``settle_s`` seconds for the
    writes; ``tritonserver`` itself is never signalled. Returns how many processes were signalled."""
    from ..schema import STACK_DUMP_SIGNAL
    from .observe import stub_pids

    pids = stub_pids(root_pid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACK_DUMP_SIGNAL)
    if pids:
        time.sleep(settle_s)
    return len(pids)


def _log_tail(path: Path | None, n: int = 12000) -> str:
    if path is None or not path.exists():
        return "(no server log)"
    text = path.read_text(errors="replace")
    return "--- server log (tail) ---\n" + text[-n:]


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> int | None:
    """SIGINT (Triton's graceful shutdown, bounded by ``--exit-timeout-secs``), then SIGKILL of the
    process group if it does not exit within ``timeout_s``. Returns the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    # stubs are children in the same process group; make sure none outlives the server
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


class RunningServer:
    """Handle yielded by :func:`running_server`: ``http_port``, ``grpc_port``, ``metrics_port`` (the public
    ports: HTTP and metrics are the bounded front's, gRPC is Triton's own), ``internal_http_port`` /
    ``internal_metrics_port`` (Triton's own HTTP / metrics on 127.0.0.1, behind the front), ``front`` (the
    :class:`~tandem.launch.http_front.Front`), ``grpc_url`` (``127.0.0.1:port``), ``proc`` (tritonserver),
    ``log_path``, ``ready_s``, ``shm_prefix``, ``internal_key`` (bytes: what a call to a stage model must
    carry as ``AUTH``)."""

    def __init__(
        self,
        proc: subprocess.Popen,
        ports: tuple[int, int, int],
        log_path: Path,
        ready_s: float,
        shm_prefix: str = "",
        internal_ports: tuple[int, int] = (0, 0),
        front: Front | None = None,
    ) -> None:
        self.proc, self.shm_prefix, self.front = proc, shm_prefix, front
        self.http_port, self.grpc_port, self.metrics_port = ports
        self.internal_http_port, self.internal_metrics_port = internal_ports
        self.log_path = log_path
        self.ready_s = ready_s
        self.internal_key = b""

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        """The server log so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextlib.contextmanager
def running_server(
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    model_repository: str | Path = MODEL_REPOSITORY,
    env: dict[str, str] | None = None,
    models: tuple[str, ...] | None = None,
    ready_timeout_s: float = 180.0,
    log_path: str | Path | None = None,
    shm_prefix: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    exit_timeout_s: int = 10,
) -> Iterator[RunningServer]:
    """Start ``tritonserver`` (free ports where not given) behind its bounded HTTP front
    (:mod:`tandem.launch.http_front`: HAProxy on the public HTTP and metrics ports, refusing a request
    body over ``max_body_bytes`` with 413; Triton's HTTP and metrics on 127.0.0.1 at internal free ports),
    wait until ready and every model is READY, yield a :class:`RunningServer`, then always stop both
    (tritonserver: SIGINT, then SIGKILL of its process group; the front after it) and remove the
    shared-memory files of its own prefix (``shm_prefix``, default a new one). A tritonserver that exits
    takes the front down with it. The server log goes to ``log_path`` (default: a temporary file, deleted
    after a clean run and kept, with its path in ``RunningServer.log_path``, after a failure).

    ``env``: environment overrides (e.g. ``{"TANDEM_CHECKPOINT": "/tmp/ckpt"}``); ``exit_timeout_s``: Triton's
    ``--exit-timeout-secs``, the longest its graceful stop waits for in-flight work. Raises
    :class:`ServerError` (with the server log) when it does not become ready within
    ``ready_timeout_s`` seconds or the front does not start.
    """
    picked = free_ports(7)
    ports = (http_port or picked[0], grpc_port or picked[1], metrics_port or picked[2])
    internal = tuple([p for p in picked[3:] if p not in ports][:2])
    shm_prefix = shm_prefix or new_shm_prefix()
    models = models_to_load(env) if models is None else models
    argv, full_env = server_command_and_env(
        internal[0],
        ports[1],
        internal[1],
        model_repository=model_repository,
        models=models,
        exit_timeout_s=exit_timeout_s,
        env_overrides=env,
        shm_prefix=shm_prefix,
        http_host="127.0.0.1",
        metrics_host="127.0.0.1",
    )
    try:
        front = start_front(
            [("http", ports[0], internal[0]), ("metrics", ports[2], internal[1])], max_body_bytes=max_body_bytes
        )
    except HaproxyError as e:
        raise ServerError(f"the HTTP front did not start: {e}") from e
    own_log = log_path is None
    if own_log:
        fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    log_path = Path(log_path)
    try:
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                argv,
                env=full_env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
    except BaseException:
        front.stop()
        raise
    front.follow(proc)
    clean = False
    try:
        ready_s = wait_ready(proc, internal[0], models, ready_timeout_s, log_path, metrics_port=internal[1])
        try:
            wait_front(front, ports[0])
        except FrontError as e:
            raise ServerError(str(e)) from e
        srv = RunningServer(proc, ports, log_path, ready_s, shm_prefix, internal, front)
        srv.internal_key = bytes.fromhex(full_env[internal_key.ENV])  # what a test calling a stage model must send
        yield srv
        clean = True
    finally:
        stop_server(proc)
        front.stop()
        remove_shm(shm_prefix)
        if own_log and clean:  # keep the log of a failed run for inspection
            with contextlib.suppress(OSError):
                log_path.unlink()


def start_openai_front(
    grpc_url: str, port: int, host: str = "127.0.0.1", checkpoint: str = "", max_body_bytes: int = MAX_BODY_BYTES
) -> subprocess.Popen:
    """Start the OpenAI-compatible front (:mod:`tandem.front.openai_api`, uvicorn) on ``host:port`` against the
    ``tandem`` model at gRPC ``grpc_url``, with ``checkpoint``'s tokenizer (default: ``$TANDEM_CHECKPOINT`` or the
    shipped one), refusing a body over ``max_body_bytes`` with 413. Returns its process (:func:`stop_openai_front`
    stops it)."""
    argv = [sys.executable, "-m", "tandem.front.openai_api", "--grpc-url", grpc_url, "--host", host]
    argv += ["--max-body-bytes", str(max_body_bytes)]
    argv += ["--port", str(port)] + (["--checkpoint", checkpoint] if checkpoint else [])
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)


def wait_openai_front(proc: subprocess.Popen, host: str, port: int, timeout_s: float = 60.0) -> None:
    """Wait until the front answers ``GET /health``. Raises :class:`ServerError` when it exits or does not answer
    within ``timeout_s`` seconds."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise ServerError(f"the OpenAI front exited with code {proc.returncode} (is port {port} free?)")
        with contextlib.suppress(OSError):
            if _http_get(f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/health")[0] == 200:
                return
        time.sleep(0.2)
    raise ServerError(f"the OpenAI front did not answer on {host}:{port} within {timeout_s:.0f} s")


def stop_openai_front(proc: subprocess.Popen | None) -> None:
    """Stop the front (SIGTERM, then SIGKILL after 10 s); None: nothing to stop."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


app = typer.Typer(add_completion=False, help="Run tandem's Triton model repository on the wheel's tritonserver.")


@app.command()
def serve(
    http_port: int = typer.Option(8000, help="HTTP port"),
    grpc_port: int = typer.Option(8001, help="gRPC port"),
    metrics_port: int = typer.Option(8002, help="Prometheus metrics port"),
    openai_port: int = typer.Option(8003, help="OpenAI-compatible API port (/v1/chat/completions; 0: none)"),
    host: str = typer.Option(
        "127.0.0.1",
        help="address every port binds; anything but loopback exposes an "
        "unauthenticated server (README, 'Deploying safely')",
    ),
    max_body_bytes: int = typer.Option(
        MAX_BODY_BYTES,
        help="largest HTTP request body (Content-Length, bytes) "
        "the HTTP and metrics ports pass on; a larger one is answered 413 "
        "(tritonserver 2.51 crashes on bodies of ~4.2 MB)",
    ),
    model_repository: Path = typer.Option(MODEL_REPOSITORY, help="Triton model repository"),
    checkpoint: str = typer.Option("", help="checkpoint folder; default: config.pbtxt's (weights/tandem-tiny)"),
    dflash2_checkpoint: str = typer.Option(
        "", help="a DFlash2 drafter folder of its own (config.json + model.safetensors); default: CHECKPOINT/dflash2"
    ),
    spec: Optional[str] = typer.Option(None, help=f"default spec of a new sequence [{schema.DEFAULTS.spec}]"),
    num_draft_tokens: Optional[int] = typer.Option(
        None, help=f"MTP drafts per round when a request says none [{schema.DEFAULTS.num_draft_tokens}]"
    ),
    burst_rounds: Optional[int] = typer.Option(
        None,
        help=f"verify rounds per streamed response at most "
        f"(also ended after burst_ms, --set) [{schema.DEFAULTS.burst_rounds}]",
    ),
    max_ctx: Optional[int] = typer.Option(None, help=f"tokens per session [{schema.DEFAULTS.max_ctx}]"),
    dtype: Optional[str] = typer.Option(
        None,
        help=f"stage compute dtype: {' | '.join(schema.DTYPES)} "
        f"(auto: fp32 on the CPU, bf16 on CUDA) [{schema.DEFAULTS.dtype}]",
    ),
    device: Optional[str] = typer.Option(
        None,
        help=f"where the stage models run: {' | '.join(schema.DEVICES)} "
        f"(auto: cuda when torch sees a GPU, else cpu) [{schema.DEFAULTS.device}]",
    ),
    tensor_parallel: Optional[int] = typer.Option(
        None,
        help="split the trunk over this many ranks (torch.distributed: gloo on the CPU, NCCL on CUDA; torch path, "
        f"no MTP spec; docs/deploying.md) [{schema.DEFAULTS.tensor_parallel}]",
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="any other model parameter, NAME=VALUE (repeatable; README, 'Serve options')"
    ),
    ready_timeout_s: float = typer.Option(300.0, help="seconds to wait for every model READY"),
    log_verbose: int = typer.Option(0, help="tritonserver --log-verbose"),
) -> None:
    """Run tritonserver in the foreground (server log on stdout) behind its bounded HTTP front (HAProxy on
    the HTTP and metrics ports, :mod:`tandem.launch.http_front`); Ctrl-C stops both, and either one
    exiting stops the other."""
    from .settings import parameter_overrides, parse_settings

    try:
        overrides = parameter_overrides(
            {
                "spec": spec,
                "num_draft_tokens": num_draft_tokens,
                "burst_rounds": burst_rounds,
                "max_ctx": max_ctx,
                "dtype": dtype,
                "device": device,
                "tensor_parallel": tensor_parallel,
                **parse_settings(set_),
                "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None,
                "dflash2_checkpoint": str(Path(dflash2_checkpoint).resolve()) if dflash2_checkpoint else None,
            }
        )
    except ValueError as e:
        print(f"tandem: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(2)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"tandem: WARNING: binding {host}: the server has no authentication; put an authenticating TLS "
            f"proxy in front (README, 'Deploying safely')",
            file=sys.stderr,
            flush=True,
        )
    if max_body_bytes < 1:
        print(f"tandem: --max-body-bytes must be >= 1, got {max_body_bytes}", file=sys.stderr, flush=True)
        raise typer.Exit(2)
    shm_prefix = new_shm_prefix()
    # Triton's own HTTP and metrics services: loopback, internal free ports, behind the front
    internal = [p for p in free_ports(4) if p not in (http_port, grpc_port, metrics_port)][:2]
    argv, env = server_command_and_env(
        internal[0],
        grpc_port,
        internal[1],
        model_repository,
        log_verbose=log_verbose,
        env_overrides=overrides,
        host=host,
        shm_prefix=shm_prefix,
        http_host="127.0.0.1",
        metrics_host="127.0.0.1",
    )
    models = models_to_load(overrides)
    busy = busy_ports(
        {
            "HTTP": http_port,
            "gRPC": grpc_port,
            "metrics": metrics_port,
            **({"OpenAI": openai_port} if openai_port else {}),
        }
    )
    if busy:  # before loading anything: a second server would load every model, then fail to bind
        print(
            f"tandem: {busy} (is another tandem / tritonserver running? stop it, or pass other --*-port values)",
            file=sys.stderr,
            flush=True,
        )
        raise typer.Exit(2)

    def _on_term(signum, frame):  # SIGTERM (`kill`, a supervisor) and SIGHUP (the terminal closed) stop it like Ctrl-C
        raise KeyboardInterrupt

    # SIGINT too: a job started in the background by a shell inherits SIGINT ignored, so Ctrl-C (or
    # `kill -INT`) would otherwise leave tritonserver running
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_term)
    try:
        front = start_front(
            [("http", http_port, internal[0]), ("metrics", metrics_port, internal[1])],
            host=host,
            max_body_bytes=max_body_bytes,
        )
    except HaproxyError as e:
        print(f"tandem: the HTTP front did not start: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(1)
    try:
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
    except BaseException:
        front.stop()
        raise
    asked_to_stop = front_died = False
    openai_front = None
    try:
        waited = wait_ready(proc, internal[0], models, ready_timeout_s, metrics_port=internal[1])
        wait_front(front, http_port, host=host)
        if openai_port:
            openai_front = start_openai_front(
                f"127.0.0.1:{grpc_port}",
                openai_port,
                host,
                overrides.get(schema.env_name("checkpoint"), ""),
                max_body_bytes,
            )
            wait_openai_front(openai_front, host, openai_port)
        print(
            f"tandem: ready in {waited:.1f} s — gRPC {host}:{grpc_port}, HTTP {host}:{http_port}, "
            f"metrics {host}:{metrics_port}"
            + (f", OpenAI http://{host}:{openai_port}/v1" if openai_port else "")
            + f", models {', '.join(models)}"
            + (f"; parameters {', '.join(f'{k}={v}' for k, v in overrides.items())}" if overrides else ""),
            flush=True,
        )
        while proc.poll() is None:
            if front.proc.poll() is not None:
                front_died = True
                print(
                    f"tandem: the HTTP front (haproxy) exited with code {front.proc.returncode}; stopping "
                    f"tritonserver\n{front.output()}",
                    file=sys.stderr,
                    flush=True,
                )
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        asked_to_stop = True
    except (ServerError, FrontError) as e:
        print(f"tandem: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(1)
    finally:
        stop_openai_front(openai_front)
        stop_server(proc)
        front.stop()
        remove_shm(shm_prefix)
    if front_died:
        raise typer.Exit(1)
    if asked_to_stop:
        # the stop was ours and everything is cleaned up: report success whatever Triton's exit code
        if proc.returncode:
            print(f"tandem: tritonserver stopped (exit {proc.returncode})", flush=True)
        raise typer.Exit(0)
    raise typer.Exit(proc.returncode or 0)


@app.command("backend-dir")
def backend_dir() -> None:
    """Assemble ``triton_backends/python`` from the nvidia-pytriton wheel and print its path."""
    print(ensure_backend_dir())


@app.command("command")
def command(http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002) -> None:
    """Print the tritonserver command line (environment additions first)."""
    argv, env = server_command_and_env(http_port, grpc_port, metrics_port)
    print(f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']} PATH={env['PATH'].split(':')[0]}:... " + " ".join(argv))


if __name__ == "__main__":
    app()
