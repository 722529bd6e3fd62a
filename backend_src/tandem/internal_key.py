"""The server's internal key: what tandem's own models carry on every call to an internal model.

The stage models (``trunk``, ``drafter_mtp``, ``drafter_dflash``) sit on Triton's public ports like every
model of the repository, and their ops (``open``, ``close``, ``evict``, ``prime``, ``draft_verify``...) act
on any sequence id or prefix key they are given. So each server start makes a random key of
:data:`KEY_BYTES` bytes; the ``tandem`` model sends it as the ``AUTH`` input of every stage call
(:class:`tandem.serving.proxies.BLSTransport`), and a stage model refuses any request without it before
the request touches state (:func:`tandem.serving.stage_io.stage_response`).

The key reaches every model process of one server through the environment (:data:`ENV`), which
:func:`tandem.launch.serve.server_command_and_env` sets for each server it starts. A ``tritonserver``
started by hand without it gets one per server process instead: the first model process to load writes
a fresh key to a file only root and the server's user can read (``/dev/shm/tandem-key-<server pid>``,
created exclusively), and the others read it.
"""

from __future__ import annotations

import functools
import hmac
import os
import secrets
import time
from pathlib import Path

import numpy as np

#: the environment variable that carries the key (hex) to a server's model processes
ENV = "TANDEM_INTERNAL_KEY"
#: key length: 256 bits
KEY_BYTES = 32
#: the stage input that carries it
AUTH = "AUTH"


class Unauthorized(PermissionError):
    """A request to an internal model that does not carry this server's key."""


def new_key() -> str:
    """A fresh key, hex (``2 * KEY_BYTES`` digits)."""
    return secrets.token_hex(KEY_BYTES)


def _key_file(server_pid: int) -> Path:
    return Path("/dev/shm") / f"tandem-key-{server_pid}"


def _shared_file_key(path: Path, wait_s: float = 5.0) -> str:
    """The key in ``path``, written first by whichever process gets there first (``O_EXCL``, mode 0600)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        deadline = time.monotonic() + wait_s
        while True:  # the writer may not have written yet
            text = path.read_text().strip()
            if len(text) == 2 * KEY_BYTES or time.monotonic() > deadline:
                return text
            time.sleep(0.01)
    key = new_key()
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return key


@functools.lru_cache(maxsize=1)
def server_key() -> bytes:
    """This server's key (bytes): from ``$TANDEM_INTERNAL_KEY``, else shared through a file per server
    process (a model process's parent is the ``tritonserver`` that started it). Raises ``ValueError`` when
    the variable is set but is not ``2 * KEY_BYTES`` hex digits."""
    text = os.environ.get(ENV) or _shared_file_key(_key_file(os.getppid()))
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"${ENV} must be {2 * KEY_BYTES} hex digits (a {KEY_BYTES * 8}-bit key)")
    return key


def key_array(key: bytes) -> np.ndarray:
    """``AUTH [1]`` (TYPE_STRING) carrying ``key``."""
    return np.array([key], dtype=np.object_)


def check(arrays: dict, model: str, key: bytes) -> None:
    """Refuse a request to internal model ``model`` whose ``AUTH`` is absent or not ``key`` (compared in
    constant time). Raises :class:`Unauthorized` naming the model."""
    got = arrays.get(AUTH)
    value = b""
    if got is not None and np.asarray(got).size == 1:
        v = np.asarray(got).reshape(-1)[0]
        value = v if isinstance(v, bytes) else str(v).encode()
    if not hmac.compare_digest(value, key):
        raise Unauthorized(
            f"model '{model}' is internal: it answers only tandem's own models (send requests to "
            f"'tandem' or 'ensemble')"
        )
