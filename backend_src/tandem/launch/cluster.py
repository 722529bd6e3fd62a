"""Replicas of the whole model repository behind HAProxy, with session-affine routing.

Each tritonserver keeps its sessions in process memory, so every turn of a session must reach the
server that holds it. The client sends the sequence id as gRPC metadata on every turn's stream
(:data:`tandem.schema.ROUTING_HEADER`); HAProxy (Debian's 2.6 package, unpacked by
:func:`ensure_haproxy` under ``triton_backends/haproxy``) routes each header value by a consistent hash
over the live servers, so any proxy with the same config (a second one, a restarted one) sends a session
to the same server; it health-checks each server's ``/v2/health/ready`` (tolerating a stall as long as a
long prime) and redispatches a dead server's sessions; the server that gets them answers "unknown sequence
id ... [tandem: session lost]", which the client types as ``SessionLost``.

:func:`haproxy_config` writes the config, :func:`running_cluster` runs N servers and the proxy (tests;
servers can be killed and restarted, the proxy restarted, more proxies added),
``python -m tandem.launch.cluster serve`` runs them in the foreground (``make serve-cluster``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import typer

from .. import schema
from .haproxy import HaproxyError, ensure_haproxy, haproxy_config
from .serve import RunningServer, ServerError, busy_ports, free_ports, running_server

#: the proxy's default address (``make serve-cluster``)
PROXY_PORT = 9001
#: server i of ``make serve-cluster`` listens on HTTP ``BASE_PORT + 3 i``, gRPC ``+ 1``, metrics ``+ 2``
BASE_PORT = 9100
#: one HAProxy log line per request (written when its stream ends): session key, server, status, path
_LOG = re.compile(r"session=(?P<key>\S*) server=(?P<server>\S+) status=(?P<status>-?\d+) path=(?P<path>\S+)")


def parse_routed(log_path: Path) -> list[dict]:
    """Every stream and call a proxy logged to ``log_path`` so far, in order: ``key`` (the routing header,
    "" or "-" when absent), ``server`` (HAProxy's server name, ``<NOSRV>`` when none took it), ``status``
    (HTTP status) and ``path`` (the gRPC method). No file: an empty list."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    return [m.groupdict() for m in _LOG.finditer(text)]


class Proxy:
    """One more HAProxy instance in front of a cluster's servers (:meth:`Cluster.add_proxy`): ``proc``,
    ``url`` (its gRPC ``host:port``), ``log_path``."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path) -> None:
        self.proc, self.url, self.log_path = proc, url, log_path

    def routed(self) -> list[dict]:
        """What this proxy has routed so far (:func:`parse_routed`)."""
        return parse_routed(self.log_path)

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL); a no-op when stopped."""
        _stop(self.proc)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class Cluster:
    """Handle yielded by :func:`running_cluster`: ``url`` (the proxy's gRPC ``host:port``), ``ports``
    (per server: HTTP, gRPC, metrics), ``servers`` (a :class:`~tandem.launch.serve.RunningServer` per
    index, None while stopped), ``names`` (HAProxy's server names), ``proxy`` (the HAProxy process),
    ``proxy_log`` (its log file; a restarted proxy appends to it), ``extra`` (proxies added by
    :meth:`add_proxy`)."""

    def __init__(
        self,
        ports: list[tuple[int, int, int]],
        proxy_port: int,
        env: dict[str, str] | None,
        models: tuple[str, ...],
        ready_timeout_s: float,
        log_dir: Path,
    ) -> None:
        self.ports, self.env, self.models, self.ready_timeout_s = ports, env, models, ready_timeout_s
        self.url = f"127.0.0.1:{proxy_port}"
        self.names = [f"tandem{i}" for i in range(len(ports))]
        self.servers: list[RunningServer | None] = [None] * len(ports)
        self._cms: list = [None] * len(ports)
        self.log_dir = log_dir
        self.proxy: subprocess.Popen | None = None
        self.proxy_log = log_dir / "haproxy.log"
        self.proxy_port = proxy_port
        self.extra: list[Proxy] = []

    def start(self, i: int) -> RunningServer:
        """Start server ``i`` on its ports (a fresh shared-memory prefix) and wait until every model is
        READY. Raises :class:`~tandem.launch.serve.ServerError`."""
        if self.servers[i] is not None:
            raise ServerError(f"server {i} is already running")
        cm = running_server(
            *self.ports[i],
            env=self.env,
            models=self.models,
            ready_timeout_s=self.ready_timeout_s,
            log_path=self.log_dir / f"{self.names[i]}-{time.time_ns()}.log",
        )
        self.servers[i] = cm.__enter__()
        self._cms[i] = cm
        return self.servers[i]

    def stop(self, i: int) -> None:
        """Stop server ``i`` gracefully (SIGINT) and remove its shared memory; a no-op when stopped."""
        cm, self._cms[i], self.servers[i] = self._cms[i], None, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def kill(self, i: int) -> None:
        """Kill server ``i`` and its model processes at once (SIGKILL of its process group: a machine
        lost), then remove its shared memory."""
        srv = self.servers[i]
        if srv is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait(timeout=30)
        self.stop(i)

    def routed(self) -> list[dict]:
        """Every stream and call the main proxy has finished so far, in order (:func:`parse_routed`)."""
        return parse_routed(self.proxy_log)

    def config(self, port: int) -> str:
        """The HAProxy config of a proxy on 127.0.0.1:``port`` in front of every server (the same servers,
        ids and weights for every port, hence the same routing)."""
        return haproxy_config([(n, p[1], p[0]) for n, p in zip(self.names, self.ports)], port)

    def start_proxy(self, echo_log: bool = False, append: bool = False) -> None:
        """Start the main proxy on its port (its log written to :attr:`proxy_log`, appended to when
        ``append``; on stdout when ``echo_log``) and wait until it routes a call. Raises
        :class:`~tandem.launch.haproxy.HaproxyError` or :class:`~tandem.launch.serve.ServerError`."""
        if self.proxy is not None and self.proxy.poll() is None:
            raise ServerError(f"the proxy on {self.url} is already running")
        cfg = self.log_dir / "haproxy.cfg"
        cfg.write_text(self.config(self.proxy_port))
        self.proxy = ensure_haproxy().popen(cfg, None if echo_log else self.proxy_log, append=append)
        wait_proxy(self.proxy, self.url, self.proxy_log)

    def restart_proxy(self) -> None:
        """Stop the main proxy (SIGTERM: its stick table is gone) and start a new one on the same port, its
        log appended to :attr:`proxy_log`, waiting until it routes a call."""
        _stop(self.proxy)
        self.start_proxy(append=True)

    def add_proxy(self, port: int | None = None) -> Proxy:
        """Start another HAProxy on 127.0.0.1:``port`` (a free one when None) with the same servers, its
        own log, and wait until it routes a call; :meth:`close` stops it. Raises like :meth:`start_proxy`."""
        port = port if port is not None else free_ports(1)[0]
        k = len(self.extra) + 1
        cfg, log = self.log_dir / f"haproxy-{k}.cfg", self.log_dir / f"haproxy-{k}.log"
        cfg.write_text(self.config(port))
        proxy = Proxy(ensure_haproxy().popen(cfg, log), f"127.0.0.1:{port}", log)
        self.extra.append(proxy)
        wait_proxy(proxy.proc, proxy.url, log)
        return proxy

    def sessions_by_server(self) -> dict[str, set[str]]:
        """Server name -> the routing keys of the turn streams (``ModelStreamInfer``) it served."""
        out: dict[str, set[str]] = {}
        for r in self.routed():
            if r["path"].endswith("/ModelStreamInfer") and r["key"] not in ("", "-"):
                out.setdefault(r["server"], set()).add(r["key"])
        return out

    def close(self) -> None:
        """Stop every proxy and every server (always; errors of one do not keep the others running)."""
        for proc in [self.proxy, *(p.proc for p in self.extra)]:
            with contextlib.suppress(Exception):
                _stop(proc)
        for i in range(len(self.servers)):
            with contextlib.suppress(Exception):
                self.stop(i)


def wait_proxy(proc: subprocess.Popen | None, url: str, log_path: Path, timeout_s: float = 30.0) -> None:
    """Wait until the proxy ``proc`` on ``url`` accepts connections and answers a readiness call routed to a
    server. Raises :class:`~tandem.launch.serve.ServerError` with the proxy's log (``log_path``)."""
    import tritonclient.grpc as grpcclient

    t0 = time.monotonic()
    host, port = url.rsplit(":", 1)
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"haproxy exited with code {proc.returncode}\n{_tail(log_path)}")
        with contextlib.suppress(Exception):
            with socket.create_connection((host, int(port)), timeout=1.0):
                pass
            c = grpcclient.InferenceServerClient(url)
            try:
                if c.is_server_ready(client_timeout=2.0):
                    return
            finally:
                c.close()
        if time.monotonic() - t0 > timeout_s:
            raise ServerError(f"haproxy on {url} not answering after {timeout_s:.0f} s\n{_tail(log_path)}")
        time.sleep(0.2)


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no haproxy log)"


@contextlib.contextmanager
def running_cluster(
    replicas: int = 2,
    proxy_port: int | None = None,
    base_port: int | None = None,
    env: dict[str, str] | None = None,
    models: tuple[str, ...] | None = None,
    ready_timeout_s: float = 300.0,
    log_dir: str | Path | None = None,
    echo_proxy_log: bool = False,
) -> Iterator[Cluster]:
    """Start ``replicas`` tritonservers (in parallel; server i on ``base_port + 3 i`` .. ``+ 2``, or free
    ports when ``base_port`` is None), each with its own shared-memory prefix, then HAProxy on
    127.0.0.1:``proxy_port`` (free when None) in front of their gRPC ports; yield a :class:`Cluster`; always
    stop everything. ``env``: the servers' environment overrides (``TANDEM_*`` model parameters).
    ``echo_proxy_log``: HAProxy's log goes to stdout instead of ``Cluster.proxy_log`` (``make serve-cluster``).

    Logs (each server's, HAProxy's, its config) go to ``log_dir`` (default: a temporary folder, removed
    after a clean run). Raises ``ValueError`` when ``replicas`` < 1 or a fixed port is in use,
    :class:`~tandem.launch.haproxy.HaproxyError` when HAProxy cannot be installed or rejects its config,
    and :class:`~tandem.launch.serve.ServerError` when a server or the proxy does not come up.
    """
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if base_port is None:
        flat = free_ports(3 * replicas + (proxy_port is None))
        ports = [tuple(flat[3 * i : 3 * i + 3]) for i in range(replicas)]
        proxy_port = proxy_port or flat[-1]
    else:
        ports = [(http, grpc, http + 2) for _, grpc, http in _ports(replicas, base_port)]
    wanted = {
        "proxy": proxy_port,
        **{f"server {i} {role}": p for i, ps in enumerate(ports) for role, p in zip(("HTTP", "gRPC", "metrics"), ps)},
    }
    if busy := busy_ports(wanted):
        raise ValueError(f"{busy} (another tandem / tritonserver / cluster? pass other --port / --base-port values)")
    ensure_haproxy()
    own_dir = log_dir is None
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-cluster-") if own_dir else log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(list(ports), proxy_port, env, models, ready_timeout_s, log_dir)
    clean = False
    try:
        with ThreadPoolExecutor(replicas) as pool:
            for f in [pool.submit(cluster.start, i) for i in range(replicas)]:
                f.result()
        cluster.start_proxy(echo_log=echo_proxy_log)
        yield cluster
        clean = True
    finally:
        cluster.close()
        if own_dir and clean:  # keep the logs of a failed run for inspection
            shutil.rmtree(log_dir, ignore_errors=True)


def serve_cluster(replicas: int, proxy_port: int, base_port: int, env: dict[str, str]) -> int:
    """Run ``replicas`` servers and the proxy in the foreground until Ctrl-C / SIGTERM / SIGHUP, or until
    the proxy exits; a server that dies is reported and not restarted (its sessions fail over). Returns
    the exit status (0 after a requested stop)."""

    def _on_term(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_term)
    try:
        with running_cluster(
            replicas,
            proxy_port,
            base_port,
            env=env,
            echo_proxy_log=True,
            log_dir=Path(tempfile.mkdtemp(prefix="tandem-cluster-")),
        ) as c:
            print(
                f"tandem: cluster ready — proxy gRPC {c.url} (route by the {schema.ROUTING_HEADER!r} header); "
                + "; ".join(
                    f"{n}: HTTP {p[0]}, gRPC {p[1]}, metrics {p[2]}, shared memory {s.shm_prefix}*"
                    for n, p, s in zip(c.names, c.ports, c.servers)
                )
                + f"; logs in {c.log_dir}",
                flush=True,
            )
            reported: set[int] = set()
            while c.proxy.poll() is None:
                for i, srv in enumerate(c.servers):
                    if srv is not None and srv.proc.poll() is not None and i not in reported:
                        reported.add(i)
                        print(
                            f"tandem: {c.names[i]} exited with code {srv.proc.returncode}; its sessions fail "
                            f"over (log: {srv.log_path})",
                            flush=True,
                        )
                time.sleep(0.5)
            print(f"tandem: haproxy exited with code {c.proxy.returncode}", flush=True)
            return 1
    except KeyboardInterrupt:
        return 0
    except (ValueError, ServerError, HaproxyError) as e:
        print(f"tandem: {e}", flush=True)
        return 2 if isinstance(e, ValueError) else 1


app = typer.Typer(
    add_completion=False, help="Replicas of tandem's model repository behind HAProxy (docs/deploying.md, 'Replicas')."
)


def _ports(replicas: int, base_port: int) -> list[tuple[str, int, int]]:
    return [(f"tandem{i}", base_port + 3 * i + 1, base_port + 3 * i) for i in range(replicas)]


@app.command()
def serve(
    replicas: int = typer.Option(2, help="tritonservers to start"),
    port: int = typer.Option(PROXY_PORT, help="the proxy's gRPC port on 127.0.0.1"),
    base_port: int = typer.Option(
        BASE_PORT, help="server i listens on HTTP base+3i, gRPC base+3i+1, metrics base+3i+2"
    ),
    checkpoint: str = typer.Option("", help="checkpoint folder; default: config.pbtxt's (weights/tandem-tiny)"),
    set_: list[str] = typer.Option(
        [], "--set", help="a model parameter for every server, NAME=VALUE (repeatable; README, 'Serve options')"
    ),
) -> None:
    """Run REPLICAS tritonservers and HAProxy on 127.0.0.1:PORT in the foreground; Ctrl-C stops everything
    and removes each server's shared memory."""
    from .settings import parameter_overrides, parse_settings

    try:
        env = parameter_overrides(
            {**parse_settings(set_), "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None}
        )
    except ValueError as e:
        print(f"tandem: {e}", flush=True)
        raise typer.Exit(2)
    raise typer.Exit(serve_cluster(replicas, port, base_port, env))


@app.command("install-haproxy")
def install_haproxy() -> None:
    """Fetch and unpack HAProxy under triton_backends/haproxy (once) and print its version."""
    try:
        print(ensure_haproxy().run("-v").stdout.splitlines()[0])
    except HaproxyError as e:
        print(f"tandem: {e}", flush=True)
        raise typer.Exit(1)


@app.command()
def config(replicas: int = 2, port: int = PROXY_PORT, base_port: int = BASE_PORT) -> None:
    """Print the HAProxy config ``serve`` writes for these ports."""
    print(haproxy_config(_ports(replicas, base_port), port), end="")


if __name__ == "__main__":
    app()
