"""Each Triton kernel against its torch reference: speed and agreement, side by side in one run.

``python -m tandem.tools.kernel_bench`` (or ``make kernel-bench``) on a machine with a GPU times every
module's cases (:data:`tandem.tools.kernel_cases.CASES`, ``"cuda"``) (realistic GLM-5.3-Flash shapes: 8 sessions x 8 verify rows, real
head dimensions, ~4k-token contexts, the 154,880-token vocabulary) with ``triton.testing.do_bench``
(median of repeated runs after warm-up, milliseconds) and prints torch ms, Triton ms, the speedup and
the largest difference between their outputs (it fails above 1e-4 in fp32 on the CPU, 5e-2 on the
GPU or in bf16). Without a GPU it says so and, with ``--cpu``, runs the
tiny CPU cases in Triton's interpreter (``TRITON_INTERPRET=1``): a smoke run whose timings mean nothing.
``--json PATH`` keeps the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from .kernel_cases import CASES

MODULES = ("sampler", "kda_verify", "dsa_indexer", "mla_attention", "block_attention")


def _flat(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for e in x for t in _flat(e)]
    if hasattr(x, "__dataclass_fields__"):
        return [t for f in x.__dataclass_fields__ for t in _flat(getattr(x, f))]
    if isinstance(x, (int, float)):
        return [torch.tensor(float(x))]
    return []


def max_diff(a, b) -> float:
    """Largest absolute difference between two outputs (nested tuples / lists of tensors or numbers);
    inf when their structure differs."""
    fa, fb = _flat(a), _flat(b)
    if len(fa) != len(fb):
        return float("inf")
    d = 0.0
    for x, y in zip(fa, fb):
        if x.shape != y.shape:
            return float("inf")
        if x.numel():
            d = max(d, (x.detach().double().cpu() - y.detach().double().cpu()).abs().max().item())
    return d


def _time_cpu(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def run(device: str, modules=MODULES, reps: int = 3) -> list[dict]:
    """One row per case: ``module``, ``case``, ``torch_ms``, ``triton_ms``, ``speedup``, ``max_diff``."""
    if device == "cuda":
        from triton.testing import do_bench

        def timer(fn):
            return do_bench(fn)
    else:

        def timer(fn):
            return _time_cpu(fn, reps)

    rows = []
    for name in modules:
        for label, ref, ker in CASES[name](device):
            out = ref()
            diff = max_diff(out, ker())
            low = any(t.dtype in (torch.bfloat16, torch.float16) for t in _flat(out))  # bf16: ~1 rounding step
            t_ref, t_ker = timer(ref), timer(ker)
            rows.append(
                {
                    "module": name,
                    "case": label,
                    "torch_ms": t_ref,
                    "triton_ms": t_ker,
                    "speedup": t_ref / t_ker if t_ker > 0 else float("nan"),
                    "max_diff": diff,
                    "low_precision": low,
                }
            )
            r = rows[-1]
            print(
                f"{name:16s} {label:58s} torch {r['torch_ms']:9.3f} ms  triton {r['triton_ms']:9.3f} ms  "
                f"{r['speedup']:6.2f}x  max|diff| {r['max_diff']:.2e}",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="no GPU: run the tiny cases in Triton's interpreter (smoke)")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--modules", default=",".join(MODULES))
    a = ap.parse_args(argv)
    if torch.cuda.is_available() and not a.cpu:
        device = "cuda"
        print(f"kernel bench on {torch.cuda.get_device_name()} (triton.testing.do_bench medians, ms)", flush=True)
    elif a.cpu:
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            print(
                "kernel bench --cpu: set TRITON_INTERPRET=1 (Triton's interpreter runs the kernels on the CPU)",
                file=sys.stderr,
            )
            return 2
        device = "cpu"
        print("kernel bench: CPU smoke run in Triton's interpreter; timings are NOT kernel speed", flush=True)
    else:
        print(
            "kernel bench: no CUDA GPU here. Run it on a GPU machine, or pass --cpu for an interpreter "
            "smoke run (agreement only).",
            file=sys.stderr,
        )
        return 2
    rows = run(device, a.modules.split(","))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=2)
    bad = [r for r in rows if not r["max_diff"] <= (5e-2 if device == "cuda" or r["low_precision"] else 1e-4)]
    for r in bad:
        print(f"DISAGREES: {r['module']} {r['case']}: max|diff| {r['max_diff']:.3e}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
