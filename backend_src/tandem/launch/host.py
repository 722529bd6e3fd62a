"""Host resources a tritonserver takes: TCP ports on 127.0.0.1 and the Python backend's shared memory.

The Python backend keeps each model instance's shared-memory region in ``<SHM_DIR>/<prefix><n>``. Each
server tandem starts gets a prefix of its own (:func:`new_shm_prefix`, passed as
``--backend-config=python,shm-region-prefix-name=``), so two servers on one host, or two test runs,
never share a region, and a server's cleanup (:func:`remove_shm`) deletes only its own files.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import socket

SHM_DIR = "/dev/shm"


def busy_ports(ports: dict[str, int]) -> str | None:
    """The first of ``ports`` (role -> port) that cannot be bound on 127.0.0.1, as a sentence
    (``"gRPC port 8001 on 127.0.0.1 is in use"``), or None when all are free."""
    for role, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to a server
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return f"{role} port {port} on 127.0.0.1 is in use"
    return None


def free_ports(n: int = 3) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (racy by nature; fine for tests)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def new_shm_prefix() -> str:
    """A shared-memory region prefix no other server uses: ``tandem_shm_<12 hex digits>_``."""
    return f"tandem_shm_{secrets.token_hex(6)}_"


def shm_files(prefix: str) -> set[str]:
    """The shared-memory files of one server's region prefix now."""
    return set(glob.glob(f"{SHM_DIR}/{glob.escape(prefix)}*"))


def remove_shm(prefix: str) -> None:
    """Remove the shared-memory files of one server's region prefix (call after it stopped)."""
    for f in shm_files(prefix):
        with contextlib.suppress(OSError):
            os.unlink(f)
