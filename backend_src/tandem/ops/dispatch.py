"""The one switch between tandem's Triton kernels and the pure-torch path.

``TANDEM_KERNELS`` (the serving parameter ``kernels``, :attr:`tandem.schema.ServingConfig.kernels`):

* ``auto`` (default): Triton kernels for CUDA tensors, the torch path (and on the CPU the numba
  serving kernels of :mod:`tandem.ops.cpu.kernels`) otherwise;
* ``triton``: the Triton kernels everywhere: on CPU tensors they run in Triton's interpreter, which
  needs ``TRITON_INTERPRET=1`` set before the kernels are first imported (correctness only: ~ms per
  program); the numba kernels are off so the model takes the call sites that dispatch here;
* ``torch``: the pure-torch reference path everywhere (also on CUDA).

This module imports no triton (only :mod:`tandem.schema`, where the modes are written).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Iterator

import torch
from tandem.schema import KERNEL_MODES as MODES

ENV = "TANDEM_KERNELS"
AUTO, TRITON, TORCH = MODES

_forced: str | None = None


def _checked(m: str, where: str) -> str:
    if m not in MODES:
        raise ValueError(f"{where} must be one of {MODES}, got {m!r}")
    return m


#: the configured mode: ``$TANDEM_KERNELS`` when this module is imported, then :func:`configure`
#: (a stage model's start-up); read on every dispatch, so it is a plain variable, not the environment
_mode: str = _checked(os.environ.get(ENV) or AUTO, ENV)


class KernelUnavailable(RuntimeError):
    """Raised when ``triton`` is forced where no kernel can run (no triton package, or CPU tensors
    without ``TRITON_INTERPRET=1``)."""


def configure(m: str) -> None:
    """Set the mode (a stage model's ``kernels`` parameter). Raises ``ValueError`` for an unknown one."""
    global _mode
    _mode = _checked(m, "kernels")


def mode() -> str:
    """The switch's value: :func:`force` if inside one, else the configured mode (:func:`configure`,
    at import ``$TANDEM_KERNELS``, default ``auto``)."""
    return _forced or _mode


def interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_AVAILABLE = importlib.util.find_spec("triton") is not None


def available() -> bool:
    """True when the triton package is installed (looked up once, at import)."""
    return _AVAILABLE


def use_triton(t: torch.Tensor) -> bool:
    """Whether the call whose main input is ``t`` should take its Triton kernel.

    ``auto``: ``t`` on CUDA and triton installed; ``torch``: never; ``triton``: always, raising
    :class:`KernelUnavailable` when it cannot run there (``t`` on the CPU without ``TRITON_INTERPRET=1``,
    or no triton)."""
    m = _forced or _mode
    if m == TORCH:
        return False
    if m == AUTO:
        return t.is_cuda and _AVAILABLE
    if not available():
        raise KernelUnavailable(f"{ENV}=triton but the triton package is not installed")
    if not t.is_cuda and not interpreted():
        raise KernelUnavailable(
            f"{ENV}=triton on {t.device} tensors needs TRITON_INTERPRET=1 (Triton's "
            "interpreter), set before the kernels are imported"
        )
    return True


def numba_allowed() -> bool:
    """False when ``triton`` is forced: the CPU model then takes the call sites that dispatch here
    instead of the fused numba kernels (which replace whole stretches of the row path)."""
    return (_forced or _mode) != TRITON


@contextlib.contextmanager
def force(m: str) -> Iterator[None]:
    """Within this block :func:`mode` is ``m`` (tests, A/B benches). Raises ``ValueError`` for an unknown mode."""
    global _forced
    old, _forced = _forced, _checked(m, "kernel mode")
    try:
        yield
    finally:
        _forced = old
