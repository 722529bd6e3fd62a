"""Compile every Triton kernel tandem launches for a CUDA target, on a machine without a GPU.

``python -m tandem.tools.kernel_compile [--arch 90]`` runs each kernel module's CPU
cases' Triton thunks (:data:`tandem.tools.kernel_cases.CASES`) with ``JITFunction.run`` replaced by a compile-only step: the launch's
real arguments are bound and specialised exactly as Triton does before a launch, and the kernel is
compiled to a ``cubin`` for ``sm_<arch>`` (the Hopper H100 / H200 by default) with Triton's bundled
``ptxas``. Nothing runs, so outputs are garbage; what this proves is that every launch the engine
makes type-checks and compiles for the GPU — the part of "works on CUDA" a CPU machine can check.
It must run without ``TRITON_INTERPRET`` (the interpreter never compiles). Prints one line per
compiled kernel and exits 1 when any launch failed to compile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .kernel_cases import CASES

MODULES = ("sampler", "kda_verify", "dsa_indexer", "mla_attention", "block_attention", "fp8_gemm")


def compile_only(arch: int) -> list[tuple[str, str, float]]:
    """Patch Triton so that a launch compiles for ``sm_<arch>`` and returns; returns the log list
    (module, kernel name, seconds) that each compile appends to."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime import jit
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    log: list[tuple[str, str, float]] = []
    seen: set = set()

    def run(self, *args, grid, warmup, **kwargs):
        t0 = time.perf_counter()
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        key = (self.fn.__qualname__, str(signature), str(sorted(constexprs.items(), key=str)), str(attrs))
        if key not in seen:
            seen.add(key)
            triton.compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
            log.append((self.module, self.fn.__name__, time.perf_counter() - t0))
        return None

    jit.JITFunction.run = run
    return log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100 / H200)")
    ap.add_argument("--modules", default=",".join(MODULES), help="comma-separated modules of tandem.ops.triton")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernel_compile: unset TRITON_INTERPRET (the interpreter does not compile)", file=sys.stderr)
        return 2
    log = compile_only(a.arch)
    failed = []
    for name in a.modules.split(","):
        for label, _, kernel in CASES[name]("cpu"):
            n = len(log)
            try:
                kernel()
            except Exception as e:  # noqa: BLE001 - a launch that did not compile, or garbage outputs afterwards
                if len(log) == n:
                    failed.append(f"{name}: {label}: {type(e).__name__}: {e}")
                    continue
            for mod_name, fn, s in log[n:]:
                print(f"sm_{a.arch}  {mod_name}.{fn}  ({label})  {s:.1f} s", flush=True)
    for f in failed:
        print(f"FAILED {f}", file=sys.stderr)
    print(f"{len(log)} kernel specialisations compiled for sm_{a.arch}, {len(failed)} launches failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
