"""Every Triton kernel launch tandem makes compiles for the GPU it is served on (sm_90: H100 / H200),
checked on this GPU-less machine: tandem.ops.triton.compile_check binds each launch's real arguments
and compiles a cubin with Triton's bundled ptxas (no interpreter, nothing runs)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from tandem.tools import kernel_compile  # noqa: E402


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run(
        [sys.executable, "-m", "tandem.tools.kernel_compile", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    compiled = {line.split()[1] for line in p.stdout.splitlines() if line.startswith("sm_90")}
    modules = {name.rsplit(".", 1)[0] for name in compiled}
    assert modules == {f"tandem.ops.triton.{m}" for m in kernel_compile.MODULES}, p.stdout
    assert "tandem.ops.triton.sampler._walk_kernel" in compiled and "tandem.ops.triton.sampler._rows_kernel" in compiled
