"""Where the stage models run: the serving parameters ``device`` and ``dtype``
(:attr:`tandem.schema.ServingConfig.device`, :attr:`~tandem.schema.ServingConfig.dtype`) resolved to
a torch device and dtype.

``device``: ``auto`` is ``cuda`` when ``torch.cuda.is_available()``, else ``cpu``; ``cuda`` /
``cuda:N`` are refused with a ``ValueError`` naming the parameter when torch sees no such GPU.
``dtype``: ``auto`` is fp32 on the CPU (measured faster there: README, "Serving") and bf16 on CUDA.
"""

from __future__ import annotations

import re

import torch

from .. import schema
from ..ops.settings import KernelSettings

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_device(name: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` (:data:`tandem.schema.DEVICES`) -> the torch device.

    Raises ``ValueError`` naming the ``device`` parameter (and ``$TANDEM_DEVICE``) for another value,
    for ``cuda`` when torch has no CUDA device (a CPU-only build, no driver, no GPU visible), and for
    ``cuda:N`` when ``N`` is not below the GPU count."""
    if not re.fullmatch(schema.DEVICE_PATTERN, name):
        raise ValueError(f"device must be one of {schema.DEVICES} (N a GPU index), got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} (model parameter 'device', $TANDEM_DEVICE): torch sees no CUDA device "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use 'cpu' or 'auto'"
            )
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(
                f"device {name!r} (model parameter 'device', $TANDEM_DEVICE): GPU index {dev.index} is "
                f"out of range, torch sees {n} GPU(s) (cuda:0 .. cuda:{n - 1})"
            )
    return dev


def parse_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """``"auto"`` / ``"bf16"`` / ``"fp32"`` (:data:`tandem.schema.DTYPES`) -> torch dtype; ``auto`` is
    bf16 on a CUDA ``device`` and fp32 elsewhere (with bfloat16 GEMM inputs: :func:`kernel_settings`). Raises ``ValueError`` naming ``dtype`` otherwise."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {schema.DTYPES}, got {name!r}") from None


def placement(cfg: schema.ServingConfig) -> tuple[torch.device, torch.dtype]:
    """A stage model's (device, compute dtype) from its serving config; a CUDA device becomes the process's
    current one (Triton kernels launch on the current device). Raises ``ValueError`` as
    :func:`resolve_device` does, or (:func:`check_kernels`) when the Triton kernels are asked for on the CPU
    without Triton's interpreter."""
    dev = resolve_device(cfg.device)
    check_kernels(cfg.kernels, dev)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    return dev, parse_dtype(cfg.dtype, dev)


def kernel_settings(cfg: schema.ServingConfig, dtype: str | None = None) -> KernelSettings:
    """The kernel settings a stage model loads its weights with (:func:`tandem.ops.dispatch.install`): the
    serving parameter ``kernels`` as the backend, ``amx``, and the CPU GEMM's inputs for the ``dtype``
    parameter (``dtype`` when given, else ``cfg.dtype``): ``fp32`` float32 inputs throughout, else
    bfloat16 inputs on bfloat16 weights (:mod:`tandem.ops.cpu.pairs`, the faster by measurement; ``bf16``
    computes in torch bf16). Raises ``ValueError`` for an unknown ``kernels`` mode."""
    name = cfg.dtype if dtype is None else dtype
    return KernelSettings(backend=cfg.kernels, gemm_inputs="fp32" if name == "fp32" else "bf16", amx=cfg.amx)


def invariant_prime(cfg: schema.ServingConfig) -> bool:
    """True when a prime's rows do not depend on how it is cut into pieces: ``batch_invariant`` with the
    CPU kernels in fp32 (:meth:`tandem.model.trunk.Trunk._invariant_rows`), so chunked prefill may cut a prompt
    anywhere, prefix cache or not (else, with the prefix cache, only at multiples of ``PREFIX_BLOCK``)."""
    dev = resolve_device(cfg.device)
    return (
        cfg.batch_invariant
        and cfg.kernels == "auto"
        and dev.type == "cpu"
        and parse_dtype(cfg.dtype, dev) == torch.float32
    )


def check_kernels(kernels: str, device: torch.device) -> None:
    """Refuse ``kernels=triton`` on the CPU unless ``TRITON_INTERPRET=1`` is set (Triton compiles for
    GPUs only; its interpreter runs kernels on CPU tensors, correctly but seconds a round). Raises
    ``ValueError`` naming the parameter and the ways out."""
    from ..ops import dispatch

    if kernels == dispatch.TRITON and device.type == "cpu" and not dispatch.interpreted():
        raise ValueError(
            "kernels=triton ($TANDEM_KERNELS) on the CPU needs TRITON_INTERPRET=1 (Triton's interpreter: "
            "correctness only, seconds a round); use kernels=auto (the default: Triton on CUDA, torch / "
            "numba on the CPU) or kernels=torch"
        )


def free_bytes(device: str | torch.device = "cpu") -> int:
    """Bytes free for weights on ``device``: the CUDA driver's free memory of that GPU
    (``torch.cuda.mem_get_info``) on CUDA, ``MemAvailable`` of ``/proc/meminfo`` on the CPU.
    Raises ``OSError`` when ``/proc/meminfo`` has no ``MemAvailable``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def _size(n: int) -> str:
    """Bytes as GiB with one decimal (MiB below 0.1 GiB, so that a small load does not read 0.0)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"


def check_bytes(need: int, free: int, what: str, device: str | torch.device, detail: str = "") -> None:
    """Refuse a load of ``need`` bytes onto ``device`` with ``free`` bytes free: raises ``MemoryError``
    giving both numbers and what to do; ``what`` names the load, ``detail`` says what was counted."""
    if need > free:
        dev = torch.device(device)
        hint = (
            "another GPU (device=cuda:N), a larger one, or bf16"
            if dev.type == "cuda"
            else "a larger machine, a GPU (device=cuda), or bf16"
        )
        raise MemoryError(
            f"{what} needs about {_size(need)} for its weights{detail}, but {dev} has only {_size(free)} free; "
            f"serve it on {hint}"
        )
