"""The kernel settings a model is loaded with: which implementation each op takes and how the CPU GEMM's
weights are packed. One frozen value per loaded model (:func:`tandem.ops.dispatch.install`), built from the
serving parameters (:func:`tandem.model.device.kernel_settings`); nothing here changes at run time.
"""

from __future__ import annotations

import dataclasses

import torch

from ..schema import KERNEL_MODES
from .triton import ENV, KernelUnavailable, available, interpreted

AUTO, TRITON, TORCH = KERNEL_MODES
GEMM_INPUTS = ("bf16", "fp32")


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """How a model's ops run.

    * ``backend`` (the serving parameter ``kernels``, :data:`tandem.schema.KERNEL_MODES`): ``auto`` the
      Triton kernels for CUDA tensors and the torch path (with the numba kernels) on the CPU; ``triton``
      the Triton kernels everywhere (on CPU tensors in Triton's interpreter: ``TRITON_INTERPRET=1``), the
      numba kernels off; ``torch`` no Triton kernel;
    * ``numba``: the CPU numba kernels (:mod:`tandem.ops.cpu`) where the backend allows them; off, the
      model runs its pure-torch reference code (:data:`REFERENCE`, tests and A/B comparisons);
    * ``gemm_inputs``: the CPU GEMM's inputs on bfloat16 weights, ``"bf16"`` (bfloat16 pairs,
      :mod:`tandem.ops.cpu.pairs`; the ``dtype=auto`` default) or ``"fp32"`` (float32 inputs throughout:
      ``dtype=fp32``);
    * ``amx``: the bfloat16-pair GEMMs on AMX tiles where the CPU has them (:mod:`tandem.ops.cpu.amx`; the
      serving parameter ``amx``);
    * ``rows``: the row-invariant mode: CPU float32 linears take the row-invariant GEMM
      (:func:`tandem.ops.cpu.gemm.linear`), the MoE, MLA rows and decoder blocks their row kernels, so a row's
      result does not depend on the rows beside it (a trunk's ``batch_invariant``; always on for the drafters);
    * ``fused``: in the row-invariant mode a decoder block runs as one numba call where it fits
      (:mod:`tandem.ops.cpu.block`, :mod:`tandem.ops.cpu.mla_block`); off, kernel by kernel (tests compare the two).

    Raises ``ValueError`` for an unknown ``backend`` or ``gemm_inputs``."""

    backend: str = AUTO
    numba: bool = True
    gemm_inputs: str = "bf16"
    amx: bool = True
    rows: bool = False
    fused: bool = True

    def __hash__(self) -> int:  # the fused blocks' plans are keyed by settings: hashed once, not per lookup
        return self._hash

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))
        if self.backend not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {self.backend!r}")
        if self.gemm_inputs not in GEMM_INPUTS:
            raise ValueError(f"GEMM inputs must be one of {GEMM_INPUTS}, got {self.gemm_inputs!r}")

    def numba_on(self, t: torch.Tensor | None = None) -> bool:
        """Whether the CPU numba kernels serve a call: :attr:`numba`, the backend not ``triton`` (the model then
        takes the call sites that reach the Triton kernels), autograd off and, when given, ``t`` on the CPU."""
        return self.numba and self.backend != TRITON and not torch.is_grad_enabled() and (t is None or t.is_cpu)

    def triton_on(self, t: torch.Tensor) -> bool:
        """Whether the call whose main input is ``t`` takes its Triton kernel. ``auto``: ``t`` on CUDA and triton
        installed; ``torch``: never; ``triton``: always, raising :class:`~tandem.ops.triton.KernelUnavailable`
        when it cannot run there (``t`` on the CPU without ``TRITON_INTERPRET=1``, or no triton)."""
        if self.backend == TORCH:
            return False
        if self.backend == AUTO:
            return t.is_cuda and available()
        if not available():
            raise KernelUnavailable(f"{ENV}=triton but the triton package is not installed")
        if not t.is_cuda and not interpreted():
            raise KernelUnavailable(
                f"{ENV}=triton on {t.device} tensors needs TRITON_INTERPRET=1 (Triton's "
                "interpreter), set before the kernels are imported"
            )
        return True

    def replace(self, **changes) -> "KernelSettings":
        """A copy with ``changes`` (the fields above)."""
        return dataclasses.replace(self, **changes)


#: what a model runs with unless it is loaded with other settings
DEFAULT = KernelSettings()
#: the pure-torch reference path: no numba, no Triton kernel
REFERENCE = KernelSettings(backend=TORCH, numba=False)
