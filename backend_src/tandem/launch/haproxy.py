"""HAProxy for tandem's replicas and for each server's bounded HTTP front (:mod:`tandem.launch.http_front`):
the binary (Debian's package, unpacked without root) and the replicas' config.

:func:`ensure_haproxy` fetches Debian 12's ``haproxy`` (2.6) with ``apt-get download``, plus each
library package it links that this machine lacks (found with ``ldd``), and unpacks them with
``dpkg-deb -x`` under ``triton_backends/haproxy`` (once: a stamp names the version); it runs with
``LD_LIBRARY_PATH`` pointing into that folder. :func:`haproxy_config` writes the replicas' config
(docs/deploying.md, "Replicas").
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
LIBRARY_PACKAGES = {
    "liblua5.3.so.0": "liblua5.3-0",
    "libopentracing-c-wrapper.so.0": "libopentracing-c-wrapper0",
    "libopentracing.so.1": "libopentracing1",
}
#: health checks of a server: one every CHECK_INTER_S s, each allowed CHECK_TIMEOUT_S s to answer once connected;
#: CHECK_FALL failed checks in a row mark it down, CHECK_RISE passed ones up again. A server that does not answer
#: (a stall: a long prime keeps its trunk busy, a paused process) stays up for at least
#: ``CHECK_FALL * (CHECK_TIMEOUT_S + CHECK_INTER_S) - CHECK_INTER_S`` s (:func:`check_tolerance_s`), about three
#: times the longest prime (a 4,096-token context) on a 2-core CPU host; a refused connection (its process is
#: gone) marks it down at once instead (``observe layer4``).
CHECK_INTER_S, CHECK_TIMEOUT_S, CHECK_FALL, CHECK_RISE = 1.0, 2.0, 4, 2
#: a server's weight on the consistent-hash ring (HAProxy places ``16 x weight`` points per server): all servers
#: equal; 100 rather than 1 spreads keys evenly (two servers: 50/50 within a few percent, against 40/60 at 1)
HASH_WEIGHT = 100
#: an idle session's stick-table entry lives this long (above the servers' ``idle_timeout_s``, 600 s)
STICK_EXPIRE_S = 1800


def check_tolerance_s(
    inter_s: float = CHECK_INTER_S, timeout_s: float = CHECK_TIMEOUT_S, fall: int = CHECK_FALL
) -> float:
    """Seconds a server may answer no health check before HAProxy marks it down (the shortest case: its
    first missed check starts as the stall does): ``fall`` checks, each waiting ``timeout_s``, with
    ``inter_s`` between them."""
    return fall * timeout_s + (fall - 1) * inter_s


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

    def popen(self, config: Path, log_path: Path | None, append: bool = False) -> subprocess.Popen:
        """Start haproxy in the foreground (``-db``) on ``config``; its log (one line per request) goes to
        ``log_path`` (appended to when ``append``, else truncated), or to this process's stdout when None.
        Raises :class:`HaproxyError` when the config is not valid."""
        self.check(config)
        argv = [str(self.binary), "-db", "-f", str(config)]
        mode = "ab" if append else "wb"
        with open(log_path, mode) if log_path is not None else open(os.devnull, "wb") as f:
            return subprocess.Popen(
                argv,
                env=self.env(),
                stdout=f if log_path is not None else None,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )


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
                raise HaproxyError(
                    f"haproxy needs {', '.join(unknown)}, which no known Debian package provides "
                    f"(tandem.launch.haproxy.LIBRARY_PACKAGES)"
                )
            wanted = sorted({LIBRARY_PACKAGES[lib] for lib in missing} - fetched)
            if missing and not wanted:
                raise HaproxyError(f"haproxy still misses {', '.join(missing)} after unpacking {', '.join(fetched)}")
    version = h.run("-v")
    if f"version {HAPROXY_VERSION}" not in version.stdout:
        raise HaproxyError(f"expected HAProxy {HAPROXY_VERSION}, got: {(version.stdout + version.stderr)[:300]}")
    stamp.write_text(HAPROXY_VERSION + "\n")
    return h


def haproxy_config(
    servers: list[tuple[str, int, int]], port: int, host: str = "127.0.0.1", header: str = schema.ROUTING_HEADER
) -> str:
    """The HAProxy config for ``servers`` (``(name, gRPC port, HTTP port)`` each, on ``host``; server i gets
    HAProxy id i + 1) behind ``host:port``: HTTP/2 cleartext on both sides (gRPC).

    Routing is a function of the ``header`` value and the set of live servers only, so every proxy built
    from the same ``servers`` list (a second instance, a restarted one) sends a session to the same server:
    ``balance hdr(header)`` with ``hash-type consistent`` (sdbm + avalanche; equal ids and weights on every
    proxy give equal rings). A request without the header is spread round robin (HAProxy's fallback for
    ``balance hdr``); tandem's client always sends it. A stick table on the header sits in front of the
    hash: within one proxy, a session re-primed on another server while its own was down stays there when
    that server returns; a proxy that never saw the session falls back on the hash.

    Health checks: ``GET /v2/health/ready`` on each HTTP port (:data:`CHECK_INTER_S` etc.); a server that
    stalls keeps its streams and its sessions for :func:`check_tolerance_s` s; one marked down by its
    checks keeps its running streams too (no ``on-marked-down shutdown-sessions``) while new requests go
    elsewhere. A refused connection marks a server down at once (``observe layer4``) and redispatches the
    request; the server that takes a session it does not hold answers "unknown sequence id ... [tandem:
    session lost]". One log line per request (``session=<key> server=<name> status=<HTTP status>
    path=<gRPC method>``) goes to stdout."""
    lines = [
        f"    server {name} {host}:{grpc} id {i + 1} weight {HASH_WEIGHT} proto h2 check port {http} check-proto h1"
        for i, (name, grpc, http) in enumerate(servers)
    ]
    checks = (
        f"inter {_ms(CHECK_INTER_S)} downinter 1s fall {CHECK_FALL} "
        f"rise {CHECK_RISE} observe layer4 error-limit 1 on-error mark-down"
    )
    return f"""# tandem replicas behind HAProxy (generated by tandem.launch.haproxy.haproxy_config)
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
    # a health check may wait this long for its answer: a server priming a long prompt answers late
    timeout check {_ms(CHECK_TIMEOUT_S)}
    # a turn streams bursts; a session's connection may idle between turns
    timeout client 10m
    timeout server 10m

frontend tandem_grpc
    bind {host}:{port} proto h2
    http-request capture req.hdr({header}) len 32
    default_backend tandem_replicas

backend tandem_replicas
    # the same session key reaches the same live server through any proxy with this config;
    # no header: round robin
    balance hdr({header})
    hash-type consistent sdbm avalanche
    # where this proxy has seen a session live (wins over the hash: a failed-over session stays put
    # when its first server returns)
    stick-table type string len 32 size 1m expire {STICK_EXPIRE_S}s
    stick on req.hdr({header})
    option httpchk GET /v2/health/ready
    http-check expect status 200
    # a stall shorter than about {check_tolerance_s():g} s keeps a server up; a refused connection (its
    # process is gone) marks it down at once; a server marked down keeps its running streams
    default-server {checks}
{chr(10).join(lines)}
"""


def _ms(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"
