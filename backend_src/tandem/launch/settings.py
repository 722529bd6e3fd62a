"""Model parameters given to ``tandem serve`` / ``tandem cluster`` (``--set NAME=VALUE`` and the flags),
checked in the launcher and passed to the server's model processes as ``$TANDEM_<NAME>`` variables
(:func:`tandem.schema.env_name`)."""

from __future__ import annotations

import os

from .. import schema
from ..schema import env_name


def parameter_overrides(settings: dict[str, object]) -> dict[str, str]:
    """Model parameters given on the command line (name -> value; None: not given) as the environment
    variables the models read (:func:`tandem.schema.env_name`), checked first: raises
    ``ValueError`` naming an unknown parameter or a bad value, also of a ``$TANDEM_<NAME>`` already in the
    environment (the whole config is validated; a
    CUDA ``device`` torch does not see, and ``kernels=triton`` on the CPU without ``TRITON_INTERPRET=1``,
    are refused here too, before anything starts)."""
    given = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items() if v is not None}
    taken = {p for m in schema.MODELS.values() for p in m.parameters}
    for k in given:
        if k not in taken:
            raise ValueError(f"no model takes parameter {k!r} (model parameters: {sorted(taken)})")
    from_env = {k: os.environ[env_name(k)] for k in taken - {"checkpoint"} - set(given) if os.environ.get(env_name(k))}
    for k, v in from_env.items():  # the shell's $TANDEM_* reach the models too: check them now, naming the variable
        try:
            schema.ServingConfig.from_parameters({k: v})
        except ValueError as e:
            raise ValueError(f"${env_name(k)} (from the environment): {e}") from None
    given_env = {**from_env, **given}
    schema.ServingConfig.from_parameters({k: v for k, v in given_env.items() if k != "checkpoint"})
    if given_env.get("device", "auto") not in ("auto", "cpu") or given_env.get("kernels") == "triton":
        from ..model.device import check_kernels, resolve_device  # torch: only when a GPU or the kernels are named

        check_kernels(given_env.get("kernels", "auto"), resolve_device(given_env.get("device", "auto")))
    return {env_name(k): v for k, v in given.items()}


def parse_settings(pairs: list[str]) -> dict[str, str]:
    """``["name=value", ...]`` (``tandem serve --set``) as a dict. Raises ``ValueError`` on a malformed pair."""
    out = {}
    for p in pairs:
        name, sep, value = p.partition("=")
        if not sep or not name:
            raise ValueError(f"--set takes NAME=VALUE (a model parameter, e.g. burst_rounds=1), got {p!r}")
        out[name.strip()] = value.strip()
    return out
