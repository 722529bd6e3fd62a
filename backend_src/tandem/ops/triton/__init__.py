"""tandem's Triton (OpenAI compiler) kernels for the speculative hot path (package ``tandem.ops.triton``).

Each kernel module holds the ``triton.jit`` kernel and its launcher (same arguments and results as its
pure-torch reference in :mod:`tandem.model` or :mod:`tandem.engine`); ``tests/test_kernels_*.py`` test
it against that reference (odd shapes, ``TRITON_INTERPRET=1`` on CPU) and
:mod:`tandem.tools.kernel_cases` benches it. :mod:`tandem.ops.dispatch` decides per call whether a model
takes a kernel. Importing this package does not import triton: it only says where Triton can run.
"""

from __future__ import annotations

import importlib.util
import os

#: the environment variable of the serving parameter ``kernels``
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
