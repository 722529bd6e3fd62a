"""tandem's Triton (OpenAI compiler) kernels for the speculative hot path (package ``tandem.ops.triton``).

Each kernel module holds the ``triton.jit`` kernel, its launcher (same arguments and results as its
pure-torch reference) and names the reference it is tested against (``tests/test_kernels_*.py``,
odd shapes, ``TRITON_INTERPRET=1`` on CPU). :mod:`tandem.ops.dispatch` decides per call whether
the engine takes a kernel (CUDA tensors, or forced) or the torch path; importing this package does
not import triton.
"""
