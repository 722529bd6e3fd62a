"""numba kernels for the CPU serving hot path (float32 rows, no autograd), each tested against its
pure-torch reference in :mod:`tandem.model` (``tests/test_cpu_*.py``, odd shapes). numba caches their
machine code in this folder's ``__pycache__`` (``python -m tandem.model.warm`` fills it)."""
