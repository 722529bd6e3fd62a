"""The one place that picks an op's implementation: torch, the CPU numba kernels (:mod:`tandem.ops.cpu`) or
the Triton kernels (:mod:`tandem.ops.triton`), from a model's :class:`~tandem.ops.settings.KernelSettings`
and the tensor the op runs on.

A model gets its settings at load (:func:`install`); its layers ask :func:`numba` or :func:`use_triton`
with them. This module imports no triton and no numba.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from .settings import AUTO, DEFAULT, REFERENCE, TORCH, TRITON, KernelSettings

__all__ = [
    "AUTO",
    "DEFAULT",
    "ENV",
    "REFERENCE",
    "TORCH",
    "TRITON",
    "KernelSettings",
    "KernelUnavailable",
    "available",
    "install",
    "interpreted",
    "numba",
    "use_triton",
]

ENV = "TANDEM_KERNELS"


class KernelUnavailable(RuntimeError):
    """Raised when ``triton`` is asked for where no kernel can run (no triton package, or CPU tensors
    without ``TRITON_INTERPRET=1``)."""


def interpreted() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_AVAILABLE = importlib.util.find_spec("triton") is not None


def available() -> bool:
    """True when the triton package is installed (looked up once, at import)."""
    return _AVAILABLE


def use_triton(k: KernelSettings, t: torch.Tensor) -> bool:
    """Whether the call whose main input is ``t`` takes its Triton kernel under settings ``k``.

    ``auto``: ``t`` on CUDA and triton installed; ``torch``: never; ``triton``: always, raising
    :class:`KernelUnavailable` when it cannot run there (``t`` on the CPU without ``TRITON_INTERPRET=1``,
    or no triton)."""
    if k.backend == TORCH:
        return False
    if k.backend == AUTO:
        return t.is_cuda and _AVAILABLE
    if not _AVAILABLE:
        raise KernelUnavailable(f"{ENV}=triton but the triton package is not installed")
    if not t.is_cuda and not interpreted():
        raise KernelUnavailable(
            f"{ENV}=triton on {t.device} tensors needs TRITON_INTERPRET=1 (Triton's "
            "interpreter), set before the kernels are imported"
        )
    return True


def numba(k: KernelSettings, t: torch.Tensor | None = None) -> bool:
    """Whether the CPU numba kernels serve the call under settings ``k``: ``k.numba``, the backend not
    ``triton`` (the model then takes the call sites that reach the Triton kernels), autograd off and,
    when given, ``t`` on the CPU."""
    return k.numba and k.backend != TRITON and not torch.is_grad_enabled() and (t is None or t.is_cpu)


def install(module: nn.Module, k: KernelSettings) -> nn.Module:
    """Give ``module`` and every module in it the settings ``k`` (their ``kernels`` attribute, read by the
    layers' calls here); a model's loader calls it once. The CPU kernels pack weights for the settings a
    layer has (:func:`tandem.ops.cpu.gemm.kernel_weight`). Returns ``module``."""
    if not isinstance(k, KernelSettings):
        raise TypeError(f"kernel settings must be a KernelSettings, got {type(k).__name__}")
    for m in module.modules():
        m.kernels = k
    return module
