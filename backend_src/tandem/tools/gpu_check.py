"""`make gpu-check`: one prepared run of everything tandem can check on a machine with NVIDIA GPUs, writing its
results to one folder, in under 10 minutes.

``python -m tandem.tools.gpu_check [--out DIR] [--budget-s 540]``. Steps, each with its own log in ``DIR``
(default ``reports/gpu-check-<UTC time>/``) and a line in ``DIR/summary.json``:

1. ``probe``: ``nvidia-smi -L``. No GPU: it says so and runs the compile checks alone (step 2), as ``make test``
   does on this CPU machine.
2. ``compile``: every Triton kernel launch compiled for ``sm_90`` (:mod:`tandem.tools.kernel_compile`).
3. ``venv``: a CUDA build of torch in its own venv, ``.venv-cuda`` (``TORCH_INDEX``, default PyPI, whose Linux
   wheels are CUDA builds), beside the other pinned requirements; reused when it sees a GPU already.
4. ``kernel-tests``: the Triton kernel tests, natively (no interpreter) on the GPU.
5. ``kernel-bench``: :mod:`tandem.tools.kernel_bench` on the real GLM-5.3-Flash shapes (``kernel_bench.json``).
6. ``serve``: the miniature served with ``device cuda`` in fp32, every spec's greedy tokens against plain
   greedy decoding of the same prompts in-process on the CPU (:mod:`tandem.tools.equivalence`'s record,
   ``serve.json``; it fails naming the first token that differs).
7. ``bench``: a short bench of plain against DFlash2 on the GPU server (``bench.json``).
8. ``fp8``: the miniature's block-FP8 copy (:mod:`tandem.tools.fp8`) loaded on the GPU with its FP8 weights kept
   and dequantized: the weight bytes each holds (``fp8_memory.json``), then served on the GPU (kept, the block-FP8
   GEMM) against the same copy dequantized in-process on the CPU (``fp8_serve.json``).
9. ``tensor-parallel``: when two GPUs are present, the miniature served over 2 ranks (NCCL, a GPU each) against
   one rank's torch path on the CPU (``tensor_parallel.json``).

A step that fails is recorded and the next one runs; the exit status is 1 when any step failed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[3]
app = typer.Typer(add_completion=False)


class Run:
    """The folder of one check and its summary; :meth:`step` runs one command with its log there."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.deadline = out, time.monotonic() + budget_s
        out.mkdir(parents=True, exist_ok=True)
        self.steps: list[dict] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def step(self, name: str, argv: list[str], timeout_s: float, env: dict | None = None) -> bool:
        """Run ``argv`` (its output to ``<name>.log``) within ``timeout_s`` and the run's budget, with ``env`` over
        this process's environment (a None value removes that variable); record it."""
        limit = min(timeout_s, self.left())
        log = self.out / f"{name}.log"
        t0 = time.monotonic()
        if limit < 10:
            rec = {"step": name, "ok": False, "seconds": 0.0, "note": "skipped: the run's time budget is spent"}
        else:
            typer.echo(f"[{name}] {' '.join(argv[:4])} ... (log: {log})")
            with open(log, "w") as f:
                try:
                    rc = subprocess.run(
                        argv, stdout=f, stderr=subprocess.STDOUT, timeout=limit, env=_environ(env)
                    ).returncode
                    note = "" if rc == 0 else f"exit status {rc}"
                except subprocess.TimeoutExpired:
                    rc, note = 124, f"timed out after {limit:.0f} s"
            rec = {"step": name, "ok": rc == 0, "seconds": round(time.monotonic() - t0, 1), "note": note}
        self.record(rec)
        return rec["ok"]

    def record(self, rec: dict) -> None:
        self.steps.append(rec)
        typer.echo(f"[{rec['step']}] {'ok' if rec['ok'] else 'FAILED'} {rec.get('note', '')}".rstrip())
        (self.out / "summary.json").write_text(json.dumps({"steps": self.steps}, indent=2) + "\n")


def _environ(changes: dict | None) -> dict:
    """This process's environment with ``changes`` (None: removed)."""
    env = {**os.environ, **(changes or {})}
    return {k: v for k, v in env.items() if v is not None}


def gpus() -> list[str]:
    """The NVIDIA GPUs ``nvidia-smi -L`` lists (none when it is absent or fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.startswith("GPU ")]


def _cuda_python(run: Run) -> str | None:
    """A python whose torch sees a GPU: ``.venv-cuda``'s, made (or completed) when needed; None when it cannot."""
    venv = ROOT / ".venv-cuda"
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        run.record({"step": "venv", "ok": True, "seconds": 0.0, "note": f"reused {venv}"})
        return str(py)
    index = os.environ.get("TORCH_INDEX", "https://pypi.org/simple")
    reqs = [r for r in (ROOT / "requirements.txt").read_text().splitlines() if r and not r.startswith(("#", "torch=="))]
    script = (
        f"{sys.executable} -m venv {venv} && {py} -m pip install -q --upgrade pip && "
        f"{py} -m pip install -q --index-url {index} torch==2.13.0 && "
        f"{py} -m pip install -q {' '.join(reqs)} && {py} -m pip install -q --no-deps --no-build-isolation -e {ROOT}"
    )
    if not run.step("venv", ["bash", "-c", script], 420) or subprocess.run(probe, capture_output=True).returncode:
        return None
    return str(py)


def fp8_memory(folder: str, out: str) -> None:
    """Load the FP8 checkpoint ``folder`` on the GPU with its FP8 weights kept, then dequantized (bf16): print and
    write to ``out/fp8_memory.json`` the weight bytes each holds and the GPU memory its load took."""
    import torch

    from ..engine.ranks import weight_bytes
    from ..model.checkpoint import load_trunk

    rows = {}
    for mode in ("keep", "dequantize"):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        model = load_trunk(folder, torch.bfloat16, device="cuda", fp8=mode)
        rows[mode] = {
            "weight_bytes": weight_bytes(model),
            "cuda_allocated": torch.cuda.memory_allocated() - before,
            "loaded_from": model.loaded_from,
        }
        del model
    rows["kept_over_dequantized"] = rows["keep"]["weight_bytes"] / rows["dequantize"]["weight_bytes"]
    (Path(out) / "fp8_memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


@app.command()
def main(
    out: Path = typer.Option(None, help="results folder (default reports/gpu-check-<UTC time>)"),
    budget_s: float = typer.Option(540.0, help="the whole run's time limit, seconds"),
) -> None:
    """Run the GPU checks that this machine allows; results in one folder."""
    out = out or ROOT / "reports" / time.strftime("gpu-check-%Y%m%dT%H%M%SZ", time.gmtime())
    run = Run(out, budget_s)
    found = gpus()
    (out / "gpus.txt").write_text("\n".join(found) + "\n")
    native = {"TRITON_INTERPRET": None}  # compiled and run natively, never in Triton's interpreter
    if not found:
        typer.echo("gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none): running the compile checks only")
        run.record({"step": "probe", "ok": True, "seconds": 0.0, "note": "no GPU: compile checks only"})
        run.step("compile", [sys.executable, "-m", "tandem.tools.kernel_compile", "--arch", "90"], 300, native)
    else:
        typer.echo(f"gpu-check: {len(found)} GPU(s): " + "; ".join(found))
        run.record({"step": "probe", "ok": True, "seconds": 0.0, "note": f"{len(found)} GPU(s)"})
        run.step("compile", [sys.executable, "-m", "tandem.tools.kernel_compile", "--arch", "90"], 120, native)
        py = _cuda_python(run)
        if py is not None:
            cuda = {**native, "TANDEM_DEVICE": "cuda"}
            tests = sorted(str(p) for p in (ROOT / "tests").glob("test_kernels_*.py"))
            run.step("kernel-tests", [py, "-m", "pytest", "-q", "-x", *tests], 240, cuda)
            run.step(
                "kernel-bench",
                [py, "-m", "tandem.tools.kernel_bench", "--json", str(out / "kernel_bench.json")],
                120,
                native,
            )
            eq = ["record", str(out / "serve.json"), "--prompts", "4", "--humaneval", "2", "--max-tokens", "32"]
            eq += ["--sampled-prompts", "0"]  # the in-process rows on the CPU, the served ones on the GPU in fp32
            run.step("serve", [py, "-m", "tandem.tools.equivalence", *eq], 240, {**cuda, "TANDEM_DTYPE": "fp32"})
            bench = ["--prompts", "4", "--humaneval", "0", "--max-tokens", "64", "--specs", "dflash2"]
            bench += ["--served-specs", "off,dflash2", "--no-transformers", "--concurrency", "0", "--prefix-pairs", "0"]
            bench += ["--structured", "0", "--json", str(out / "bench.json")]
            run.step("bench", [py, "-m", "tandem.tools.bench", *bench], 180, cuda)
        if py is not None:
            fp8 = out / "tiny-fp8"
            mem = f"from tandem.tools.gpu_check import fp8_memory; fp8_memory({str(fp8)!r}, {str(out)!r})"
            ok = run.step(
                "fp8-copy",
                [py, "-m", "tandem.tools.fp8", str(ROOT / "model_repository/weights/tandem-tiny"), str(fp8)],
                60,
            )
            if ok and run.step("fp8-memory", [py, "-c", mem], 60, native):
                eq = ["record", str(out / "fp8_serve.json"), "--checkpoint", str(fp8), "--prompts", "8", "--humaneval"]
                eq += ["4", "--max-tokens", "64", "--sampled-prompts", "0", "--specs", "dflash2"]
                run.step("fp8-serve", [py, "-m", "tandem.tools.equivalence", *eq], 240, cuda)
        if py is not None and len(found) >= 2:  # 2 ranks on 2 GPUs (NCCL) against one rank's torch path on the CPU
            tp = ["record", str(out / "tensor_parallel.json"), "--prompts", "4", "--humaneval", "0", "--max-tokens"]
            tp += ["32", "--sampled-prompts", "0", "--specs", "dflash2", "--set", "tensor_parallel=2", "--torch-path"]
            run.step(
                "tensor-parallel", [py, "-m", "tandem.tools.equivalence", *tp], 240, {**cuda, "TANDEM_DTYPE": "fp32"}
            )
    failed = [s["step"] for s in run.steps if not s["ok"]]
    typer.echo(f"gpu-check: results in {out}" + (f"; failed: {', '.join(failed)}" if failed else "; every step passed"))
    raise typer.Exit(1 if failed else 0)


if __name__ == "__main__":
    app()
