"""`make bench`'s hardware-limit figures for plain decoding: the weight bytes one decoded token reads,
the matrix-vector bandwidth measured on this machine, the resulting weight-streaming limit and the
fraction of it plain decoding reaches, and the operators dispatched per token (torch profiler)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F


def weight_bytes_per_token(model) -> dict:
    """Bytes of weights one plain decode row reads (the trunk only, not the MTP layer): every dense
    parameter of the trunk layers, the routed experts' share ``top_k / n_routed_experts`` (the experts
    a token needs), the shared experts, the final norm and LM head, one embedding row; each at the
    width serving reads it (2 bytes for the weights the row-invariant GEMM streams as bfloat16 bits,
    :func:`tandem.ops.cpu.gemm.kernel_weight`, once a decode has made them). Returns
    ``{"total": bytes, "lm_head": .., "experts": .., "other": ..}``."""
    from ..ops.cpu import gemm as cpu_gemm

    bf16 = {e[0].untyped_storage().data_ptr() for e in cpu_gemm._W.values() if cpu_gemm.is_bf16(e[2])}
    cfg = model.cfg
    n = cfg.num_hidden_layers
    share = cfg.num_experts_per_tok / cfg.n_routed_experts
    out = {"lm_head": 0.0, "experts": 0.0, "embedding": 0.0, "other": 0.0}
    for name, p in model.named_parameters():
        b = p.numel() * (2 if p.untyped_storage().data_ptr() in bf16 else p.element_size())
        if name.startswith(f"layers.{n}."):
            continue
        if name.startswith("embed_tokens"):
            out["embedding"] += b / cfg.vocab_size
        elif name.startswith("lm_head"):
            out["lm_head"] += b
        elif ".mlp.experts." in name:
            out["experts"] += b * share
        else:
            out["other"] += b
    out["total"] = sum(out.values())
    return out


#: bytes written between the timed products of a cold probe: twice a 32 MiB L3, so the weight comes from memory
_FLUSH_BYTES = 64 << 20


def matvec_bandwidth(
    nbytes: float, in_features: int, dtype: torch.dtype = torch.float32, reps: int = 30, cold: bool = False
) -> dict:
    """Bytes/s of one-row matrix-vector products over a weight of ``nbytes`` (``[in_features, N]``),
    the fastest of MKL on the input-major layout serving uses, MKL on the row-major one, and (fp32)
    tandem's own row-invariant GEMM, on fp32 and on bf16 weights, unpacked, strip-packed and as
    bfloat16 pairs as serving runs it (the strictest limit). Median of ``reps``
    timed calls after warm-up; the weight stays in the last-level cache between calls when it fits
    (the shipped miniature's 19 MiB a token does, in a 32 MiB L3), unless ``cold``: then
    ``_FLUSH_BYTES`` are written before each timed call, so the weight streams from memory as a model
    larger than the cache would. Returns ``{"bytes_per_s", "seconds", "layout"}``."""
    from ..ops.cpu import gemm as cpu_gemm

    esz = torch.tensor([], dtype=dtype).element_size()
    n_out = max(1, int(nbytes // (in_features * esz)))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n_out, in_features, generator=g).to(dtype)
    x = torch.randn(1, in_features, generator=g).to(dtype)
    best = None
    flush = np.zeros(_FLUSH_BYTES // 4, np.float32) if cold else None
    calls = {
        "MKL input-major": lambda wt=w.t().contiguous().t(): F.linear(x, wt),
        "MKL row-major": lambda: F.linear(x, w),
    }
    if dtype == torch.float32:  # bytes/s of the weight as stored, fp32 or bf16 bits (half the bytes)
        calls["tandem GEMM"] = lambda xn=x.numpy(), wt=w.t().contiguous().numpy(): cpu_gemm.mm_rows(xn, wt)
        n_bf16 = max(1, int(nbytes // (in_features * 2)))  # the same bytes: twice the rows
        wb = (
            torch.randn(n_bf16, in_features, generator=g)
            .to(torch.bfloat16)
            .t()
            .contiguous()
            .view(torch.int16)
            .numpy()
            .view(np.uint16)
        )
        calls["tandem GEMM, bf16 weights"] = lambda xn=x.numpy(), wt=wb: cpu_gemm.mm_rows(xn, wt)
        calls["tandem GEMM, packed bf16 weights"] = lambda xn=x.numpy(), wt=cpu_gemm.pack_strips(wb): cpu_gemm.mm_rows(
            xn, wt
        )
        if in_features % 2 == 0:  # serving's default for bf16 weights: bf16 dot products
            calls["tandem GEMM, bf16 pairs"] = lambda xn=x.numpy(), wt=cpu_gemm.pack_pairs(wb): cpu_gemm.mm_rows(xn, wt)
    for layout, call in calls.items():
        for _ in range(3):
            call()
        ts = []
        for _ in range(reps):
            if flush is not None:
                flush += 1.0
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        s = statistics.median(ts)
        rate = (n_bf16 * in_features * 2 if "bf16" in layout else n_out * in_features * esz) / s
        if best is None or rate > best["bytes_per_s"]:
            best = {"seconds": s, "layout": layout, "bytes_per_s": rate}
    return best


def ops_per_token(engine, ids: list[int], max_tokens: int) -> dict:
    """aten operators dispatched per generated token of a plain generation (the torch profiler's
    count of ``aten::`` events, nested ones included), with the serving kernels and with the
    pure-torch reference. Returns ``{"serving": n, "reference": n}``."""
    from torch.profiler import ProfilerActivity, profile

    from ..ops.settings import REFERENCE

    def count() -> float:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            r = engine.generate(ids, max_tokens, spec="off")
        return sum(k.count for k in prof.key_averages() if k.key.startswith("aten::")) / max(len(r["token_ids"]), 1)

    serving, kernels = count(), engine.kernels
    engine.model.use_kernels(REFERENCE)
    try:
        reference = count()
    finally:
        engine.model.use_kernels(kernels)
    return {"serving": serving, "reference": reference}


def decode_seconds_per_token(runs: list[dict]) -> float:
    """Median over prompts of decode time per token after the first (``(elapsed - TTFT) / (n - 1)``)."""
    per = [
        (len(r["token_ids"]) / r["tokens_per_s"] - r["ttft_s"]) / (len(r["token_ids"]) - 1)
        for r in runs
        if r.get("ttft_s") is not None and len(r["token_ids"]) > 1 and r["tokens_per_s"]
    ]
    return statistics.median(per)


def limits(model, engine, plain_runs: list[dict], ids: list[int], ops_tokens: int = 32) -> dict:
    """The weight-streaming section: bytes per token, bandwidth, limit (s per token), plain decoding's
    measured s per token and its fraction of the limit (limit / measured), ops per token (counted over a
    generation of ``ops_tokens`` tokens; the profiled pure-torch reference takes seconds a token)."""
    ops = ops_per_token(engine, ids, ops_tokens)  # first: a decode makes the kernels' weights
    wb = weight_bytes_per_token(model)
    bw = matvec_bandwidth(wb["total"], model.cfg.hidden_size, model.dtype)
    cold = matvec_bandwidth(wb["total"], model.cfg.hidden_size, model.dtype, reps=15, cold=True)
    limit = wb["total"] / bw["bytes_per_s"]
    measured = decode_seconds_per_token(plain_runs)
    return {
        "weight_bytes": wb,
        "bandwidth": bw,
        "limit_s_per_token": limit,
        "plain_s_per_token": measured,
        "fraction_of_limit": limit / measured,
        "ops_per_token": ops,
        "cold_bandwidth": cold,
        "cold_limit_s_per_token": wb["total"] / cold["bytes_per_s"],
    }


def print_limits(console, lim: dict) -> None:
    wb, bw = lim["weight_bytes"], lim["bandwidth"]
    console.print(
        f"{'weight-streaming limit':>30}: {wb['total'] / 2**20:.1f} MiB of weights a token "
        f"(LM head {wb['lm_head'] / 2**20:.1f}, experts {wb['experts'] / 2**20:.1f}, rest {wb['other'] / 2**20:.1f})"
        f" / {bw['bytes_per_s'] / 1e9:.1f} GB/s matrix-vector ({bw['layout']}) = "
        f"{lim['limit_s_per_token'] * 1e3:.2f} ms a token"
    )
    console.print(
        f"{'plain decoding vs the limit':>30}: {lim['plain_s_per_token'] * 1e3:.2f} ms a token = "
        f"[bold]{lim['fraction_of_limit']:.0%}[/] of the limit; aten ops per token "
        f"{lim['ops_per_token']['serving']:.0f} (pure-torch reference {lim['ops_per_token']['reference']:.0f})"
    )
    if "cold_bandwidth" in lim:  # the same bytes from memory (caches flushed before each product)
        c = lim["cold_limit_s_per_token"]
        console.print(
            f"{'the same, weights from memory':>30}: {lim['cold_bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s "
            f"({lim['cold_bandwidth']['layout']}) = {c * 1e3:.2f} ms a token; plain decoding "
            f"{c / lim['plain_s_per_token']:.0%} of it (the figure above is the target's definition)"
        )
