"""HAProxy for tandem's replicas and for each server's bounded HTTP front (:mod:`tandem.serving.http_front`):
the binary (Debian's package, unpacked without root) and the replicas' config.

:func:`ensure_haproxy` fetches Debian 12's ``haproxy`` (2.6) with ``apt-get download``, plus each
library package it links that this machine lacks (found with ``ldd``), and unpacks them with
``dpkg-deb -x`` under ``triton_backends/haproxy`` (once: a stamp names the version); it runs with
``LD_LIBRARY_PATH`` pointing into that folder. :func:`haproxy_config` writes the config (README,
"Deploying replicas").
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .. import schema

HAPROXY_ROOT = Path(__file__).resolve().parents[3] / "triton_backends" / "haproxy"
#: the Debian 12 package's upstream version this repository is tested with
HAPROXY_VERSION = "2.6.12"
#: the Debian package that ships each library haproxy links but Debian 12 does not install by default
LIBRARY_PACKAGES = {"liblua5.3.so.0": "liblua5.3-0", "libopentracing-c-wrapper.so.0": "libopentracing-c-wrapper0",
                    "libopentracing.so.1": "libopentracing1"}
#: seconds between health checks of a server, and failed / passed checks before it is marked down / up
CHECK_INTER_S, CHECK_FALL, CHECK_RISE = 0.5, 2, 2
#: an idle session's stick-table entry lives this long (above the servers' ``idle_timeout_s``, 600 s)
STICK_EXPIRE_S = 1800


class HaproxyError(RuntimeError):
    """HAProxy could not be fetched, unpacked or run (the message says which step and why)."""


class Haproxy:
    """The unpacked binary: ``binary``, ``libdir`` (for ``LD_LIBRARY_PATH``), ``version``."""

    def __init__(self, root: Path = HAPROXY_ROOT) -> None:
        self.binary = root / "usr" / "sbin" / "haproxy"
        self.libdir = root / "usr" / "lib" / "x86_64-linux-gnu"

    def env(self) -> dict[str, str]:
        """The environment haproxy runs with (its libraries first on ``LD_LIBRARY_PATH``)."""
        env = os.environ.copy()
        env["LD_LIBRARY_PATH"] = ":".join(x for x in (str(self.libdir), env.get("LD_LIBRARY_PATH", "")) if x)
        return env

    def run(self, *args: str) -> subprocess.CompletedProcess:
        """``haproxy args...``, captured."""
        return subprocess.run([str(self.binary), *args], env=self.env(), capture_output=True, text=True)

    def check(self, config: Path) -> None:
        """``haproxy -c``: raise :class:`HaproxyError` with its output when ``config`` is not valid."""
        res = self.run("-c", "-f", str(config))
        if res.returncode != 0:
            raise HaproxyError(f"haproxy rejects {config}:\n{res.stdout}{res.stderr}")

    def popen(self, config: Path, log_path: Path | None) -> subprocess.Popen:
        """Start haproxy in the foreground (``-db``) on ``config``; its log (one line per request) goes to
        ``log_path``, or to this process's stdout when None. Raises :class:`HaproxyError` when the config
        is not valid."""
        self.check(config)
        argv = [str(self.binary), "-db", "-f", str(config)]
        with open(log_path, "wb") if log_path is not None else open(os.devnull, "wb") as f:
            return subprocess.Popen(argv, env=self.env(), stdout=f if log_path is not None else None,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _apt_download(packages: list[str], cwd: Path) -> None:
    cmd = ["apt-get", "download", *packages]
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True)
        res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise HaproxyError(f"`{' '.join(cmd)}` failed: {res.stderr[-2000:]}")


def _missing_libraries(h: Haproxy) -> list[str]:
    res = subprocess.run(["ldd", str(h.binary)], env=h.env(), capture_output=True, text=True)
    return re.findall(r"^\s*(\S+) => not found", res.stdout, flags=re.M)


def ensure_haproxy(root: Path = HAPROXY_ROOT) -> Haproxy:
    """HAProxy unpacked under ``root`` (fetched and unpacked on the first call; then a stamp check).
    Raises :class:`HaproxyError` when a download or unpack fails, a library has no known package
    (:data:`LIBRARY_PACKAGES`), or the binary is not version :data:`HAPROXY_VERSION`."""
    h, stamp = Haproxy(root), root / ".stamp"
    if stamp.exists() and stamp.read_text().strip() == HAPROXY_VERSION and h.binary.exists():
        return h
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        wanted, fetched = ["haproxy"], set()
        while wanted:
            _apt_download(wanted, Path(tmp))
            fetched.update(wanted)
            for deb in Path(tmp).glob("*.deb"):
                subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, capture_output=True)
                deb.unlink()
            missing = _missing_libraries(h)
            unknown = [lib for lib in missing if lib not in LIBRARY_PACKAGES]
            if unknown:
                raise HaproxyError(f"haproxy needs {', '.join(unknown)}, which no known Debian package provides "
                                   f"(tandem.serving.haproxy.LIBRARY_PACKAGES)")
            wanted = sorted({LIBRARY_PACKAGES[lib] for lib in missing} - fetched)
            if missing and not wanted:
                raise HaproxyError(f"haproxy still misses {', '.join(missing)} after unpacking {', '.join(fetched)}")
    version = h.run("-v")
    if f"version {HAPROXY_VERSION}" not in version.stdout:
        raise HaproxyError(f"expected HAProxy {HAPROXY_VERSION}, got: {(version.stdout + version.stderr)[:300]}")
    stamp.write_text(HAPROXY_VERSION + "\n")
    return h


def haproxy_config(servers: list[tuple[str, int, int]], port: int, host: str = "127.0.0.1",
                   header: str = schema.ROUTING_HEADER) -> str:
    """The HAProxy config for ``servers`` (``(name, gRPC port, HTTP port)`` each, on ``host``) behind
    ``host:port``: HTTP/2 cleartext on both sides (gRPC), a stick table keyed on the ``header`` value
    (a session's turns reach the server that took its first request), least connections for new
    keys, health checks of ``GET /v2/health/ready`` on each HTTP port every :data:`CHECK_INTER_S` s,
    and redispatch: a request whose server is down (or refuses the connection, which marks it down at
    once) goes to another, whose
    tandem then answers "session lost" for a sequence it does not hold. One log line per request
    (``session=<key> server=<name> status=<HTTP status> path=<gRPC method>``) goes to stdout."""
    lines = [f"    server {name} {host}:{grpc} proto h2 check port {http} check-proto h1" for name, grpc, http in servers]
    return f"""# tandem replicas behind HAProxy (generated by tandem.serving.haproxy.haproxy_config)
global
    log stdout format raw local0
    maxconn 4096

defaults
    mode http
    log global
    log-format "session=%[capture.req.hdr(0)] server=%s status=%ST path=%HP term=%tsc"
    # a request whose server refused the connection is retried on another (each retry redispatched)
    option redispatch 1
    retries 3
    timeout connect 1s
    timeout check 1s
    # a turn streams bursts; a session's connection may idle between turns
    timeout client 10m
    timeout server 10m

frontend tandem_grpc
    bind {host}:{port} proto h2
    http-request capture req.hdr({header}) len 32
    default_backend tandem_replicas

backend tandem_replicas
    balance leastconn
    stick-table type string len 32 size 1m expire {STICK_EXPIRE_S}s
    stick on req.hdr({header})
    option httpchk GET /v2/health/ready
    http-check expect status 200
    # a refused connection marks a server down at once (observe layer4), before its health checks do;
    # a server marked down has its streams cut, so their clients see the loss at once
    default-server inter {int(CHECK_INTER_S * 1000)}ms downinter 1s fall {CHECK_FALL} rise {CHECK_RISE} observe layer4 error-limit 1 on-error mark-down on-marked-down shutdown-sessions
{chr(10).join(lines)}
"""
