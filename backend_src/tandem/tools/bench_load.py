"""`make bench`'s concurrency rows: N sessions admitted together into one in-process scheduler and
decoded side by side (each round one drafter call and one batched trunk verify over all of them),
against one session alone: aggregate tokens/s, TTFT, the gap between streamed responses and the
latency per token (ITL)."""

from __future__ import annotations

import statistics
import time

from ..engine.scheduler import Turn


def run_concurrent(engine, prompts: list[list[int]], max_tokens: int, spec: str) -> dict:
    """Admit one turn per prompt at once and run bursts until all finish. Returns ``sessions``,
    ``tokens``, ``seconds``, ``tokens_per_s`` (aggregate), ``ttft_s`` (median), ``gap_s`` (median
    time between one session's consecutive responses), ``itl_s`` (median of gap / tokens in the
    response) and ``token_ids`` per prompt."""
    sched = engine.sched
    t0 = time.perf_counter()
    seen: dict[int, list[tuple[float, int]]] = {}
    out: dict[int, list[int]] = {}
    base = 1 << 50

    def emitter(sid):
        def emit(r, err, final):
            if err:
                raise RuntimeError(err)
            seen.setdefault(sid, []).append((time.perf_counter(), len(r.tokens)))
            out.setdefault(sid, []).extend(r.tokens)
        return emit

    sids = [base + i for i in range(len(prompts))]
    sched.admit([Turn(s, list(p), max_tokens, emitter(s), spec=spec) for s, p in zip(sids, prompts)])
    while any(s in sched.turns for s in sids):
        sched.burst()
    el = time.perf_counter() - t0
    tokens = sum(len(v) for v in out.values())
    gaps, itls = [], []
    for ev in seen.values():
        for (a, _), (b, n) in zip(ev, ev[1:]):
            gaps.append(b - a)
            if n:
                itls.append((b - a) / n)
    return {"sessions": len(prompts), "tokens": tokens, "seconds": el, "tokens_per_s": tokens / el,
            "ttft_s": statistics.median(ev[0][0] - t0 for ev in seen.values()),
            "gap_s": statistics.median(gaps) if gaps else None, "itl_s": statistics.median(itls) if itls else None,
            "token_ids": [out[s] for s in sids]}


def run_scaling(engine, prompts: list[list[int]], max_tokens: int, spec: str) -> dict:
    """One session at a time over ``prompts`` vs all of them at once (same prompts, same engine):
    aggregate tokens/s of each, their ratio, TTFT / gap / ITL medians, and whether every output is
    identical (greedy outputs must not depend on the batch)."""
    run_concurrent(engine, prompts[:2], 8, spec)  # warm-up
    one = [run_concurrent(engine, [p], max_tokens, spec) for p in prompts]
    many = run_concurrent(engine, prompts, max_tokens, spec)
    t1 = sum(r["tokens"] for r in one) / sum(r["seconds"] for r in one)
    med = lambda k: statistics.median(r[k] for r in one if r[k] is not None)  # noqa: E731
    return {"spec": spec, "sessions": len(prompts), "one_tokens_per_s": t1, "many_tokens_per_s": many["tokens_per_s"],
            "ratio": many["tokens_per_s"] / t1, "one": {k: med(k) for k in ("ttft_s", "gap_s", "itl_s")},
            "many": {k: many[k] for k in ("ttft_s", "gap_s", "itl_s")},
            "identical": many["token_ids"] == [r["token_ids"][0] for r in one]}


def print_scaling(console, rows: list[dict]) -> None:
    for r in rows:
        o, m = r["one"], r["many"]
        console.print(f"{'concurrency ' + r['spec']:>30}: {r['sessions']} sessions {r['many_tokens_per_s']:.1f} tok/s vs one "
                      f"at a time {r['one_tokens_per_s']:.1f} = [bold]{r['ratio']:.2f}x[/]; TTFT {m['ttft_s'] * 1e3:.0f} vs "
                      f"{o['ttft_s'] * 1e3:.0f} ms, ITL {m['itl_s'] * 1e3:.1f} vs {o['itl_s'] * 1e3:.1f} ms, gap between "
                      f"responses {m['gap_s'] * 1e3:.0f} vs {o['gap_s'] * 1e3:.0f} ms; outputs identical {r['identical']}")
