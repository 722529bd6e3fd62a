"""Helpers shared by the runner and the locustfile: the ramp's user levels, the target URL check,
and what the served model's metadata / config say (sampling input, context limit)."""

from __future__ import annotations

import ipaddress
import os
import sys

from tandem import schema

TEMPERATURE_INPUT = schema.TEMPERATURE
_NUMPY = {"FP32": "float32", "FP16": "float16", "FP64": "float64", "BF16": "float32"}


def ramp_levels(max_users: int, step_users: int = 1, start_users: int = 1) -> list[int]:
    """User counts of the ramp: ``start_users``, + step, ... and always ``max_users`` last.

    >>> ramp_levels(8, 3)
    [1, 4, 7, 8]
    >>> ramp_levels(8, 1, start_users=8)
    [8]
    """
    if max_users < 1 or step_users < 1 or not 1 <= start_users <= max_users:
        raise ValueError(
            f"max users and step users must be >= 1 and start users in [1, max users], got "
            f"{max_users}, {step_users}, {start_users}"
        )
    levels = list(range(start_users, max_users + 1, step_users))
    if levels[-1] != max_users:
        levels.append(max_users)
    return levels


def split_host(url: str, allow_remote: bool = False) -> str:
    """``host:port`` of a Triton gRPC endpoint given as ``host:port`` or ``grpc://host:port``.

    Raises ``ValueError`` when it is malformed, or names a host other than 127.0.0.1 / localhost /
    ::1 and ``allow_remote`` is False (load is only sent to this machine unless asked).
    """
    u = url.strip()
    for scheme in ("grpc://", "http://"):
        if u.startswith(scheme):
            u = u[len(scheme) :]
    u = u.rstrip("/")
    host, sep, port = u.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected a gRPC URL host:port (e.g. 127.0.0.1:8001), got {url!r}")
    bare = host.strip("[]")
    if not allow_remote and bare != "localhost":
        try:
            loop = ipaddress.ip_address(bare).is_loopback
        except ValueError:
            loop = False
        if not loop:
            raise ValueError(
                f"refusing to send load to {host} (only loopback addresses; pass --allow-remote "
                f"to target another machine)"
            )
    return u


def parse_specs(spec: str) -> list[str]:
    """The specs of a ``--spec`` value: one spec or a comma list (each new session picks one at random).

    >>> parse_specs("mtp,dflash2")
    ['mtp', 'dflash2']

    Raises ``ValueError`` naming an unknown spec.
    """
    specs = [a.strip() for a in spec.split(",") if a.strip()]
    bad = [a for a in specs if a not in schema.SPECS]
    if bad or not specs:
        raise ValueError(f"--spec takes specs from {schema.SPECS} (comma list), got {spec!r}")
    return specs


def sampling_input(metadata: dict) -> dict | None:
    """The ``TEMPERATURE`` input of a model, from ``get_model_metadata(..., as_json=True)``:
    ``{"name", "datatype", "shape" (dims, -1 -> 1), "numpy" (dtype name)}``; None when the model
    has no such input (greedy-only server)."""
    for inp in metadata.get("inputs", []):
        if inp.get("name") == TEMPERATURE_INPUT:
            dt = inp.get("datatype", "FP32")
            shape = [max(1, int(d)) for d in inp.get("shape", [1])] or [1]
            return {"name": TEMPERATURE_INPUT, "datatype": dt, "shape": shape, "numpy": _NUMPY.get(dt, "float32")}
    return None


def model_max_ctx(config: dict, default: int = schema.DEFAULTS.max_ctx) -> int:
    """The ``max_ctx`` parameter (tokens) from ``get_model_config(..., as_json=True)``; ``default``
    when the model does not declare one."""
    cfg = config.get("config", config)
    try:
        return int(cfg["parameters"]["max_ctx"]["string_value"])
    except (KeyError, TypeError, ValueError):
        return default


#: seconds Locust may take to exit after its ``quit`` event (stats, CSVs and reports are written by then)
EXIT_GRACE_S = 15.0


def exit_after(seconds: float, code: int) -> None:
    """Exit the process with Locust's own exit ``code`` if it is still alive ``seconds`` from now: an
    OS thread (not a greenlet), so it runs while the interpreter's shutdown waits. Seen once in a full
    test run: Locust logged "Shutting down (exit code 0)", printed its stats, and the process never
    exited (the interpreter's shutdown stuck, presumably on gRPC's threads under gevent)."""
    from gevent import monkey

    sleep = monkey.get_original("time", "sleep")

    def watch() -> None:
        sleep(seconds)
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001 - exiting regardless
                pass
        os._exit(code)

    monkey.get_original("_thread", "start_new_thread")(watch, ())
