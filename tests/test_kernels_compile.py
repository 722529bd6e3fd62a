"""`make gpu-check` on this GPU-less machine: it says so and runs the compile checks alone, every Triton kernel
launch tandem makes compiled for the GPU it is served on (sm_90: H100 / H200) by tandem.tools.kernel_compile,
which binds each launch's real arguments and compiles a cubin with Triton's bundled ptxas (no interpreter,
nothing runs); its results land in one folder."""

import json
import os
import subprocess

import pytest

pytest.importorskip("triton")

from tandem.tools import gpu_check, kernel_compile  # noqa: E402


def test_gpu_check_without_a_gpu_compiles_every_kernel_for_sm90(tmp_path):
    if gpu_check.gpus():
        pytest.skip("this machine has a GPU: make gpu-check runs the whole check there")
    out = tmp_path / "gpu-check"
    p = subprocess.run(
        ["make", "-s", "gpu-check", f"ARGS=--out {out}"],
        cwd=gpu_check.ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},  # (set by the suite's kernel tests: the check drops it)
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "no NVIDIA GPU on this machine" in p.stdout and "compile checks only" in p.stdout
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert [(s["step"], s["ok"]) for s in steps] == [("probe", True), ("compile", True)]
    log = (out / "compile.log").read_text()
    compiled = {line.split()[1] for line in log.splitlines() if line.startswith("sm_90")}
    modules = {name.rsplit(".", 1)[0] for name in compiled}
    assert modules == {f"tandem.ops.triton.{m}" for m in kernel_compile.MODULES}, log
    assert "tandem.ops.triton.sampler._walk_kernel" in compiled and "tandem.ops.triton.sampler._rows_kernel" in compiled
