"""tandem's kernels, each beside the pure-torch reference in :mod:`tandem.model` it is tested against.

* :mod:`tandem.ops.cpu`: numba kernels for the CPU serving hot path (row-invariant GEMMs, fused
  decoder blocks, the compiled decode loop);
* :mod:`tandem.ops.triton`: Triton kernels for CUDA (and Triton's interpreter on the CPU);
* :mod:`tandem.ops.dispatch`: the one place that picks torch, numba or Triton for an op.

This package imports nothing above :mod:`tandem.schema` (``tests/test_layout.py``).
"""
