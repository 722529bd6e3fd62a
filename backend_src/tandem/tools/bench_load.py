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


def run_scaling(engine, prompts: list[list[int]], max_tokens: int, spec: str, reps: int = 5) -> dict:
    """One session at a time over ``prompts`` vs all of them at once (same prompts, same engine),
    ``reps`` times in turn (the machine's speed drifts: each rep runs half the prompts one at a time,
    then all at once, then the other half one at a time, so a steady drift weighs on both sides alike;
    the median rep is reported): aggregate tokens/s of each, their ratio, TTFT / gap / ITL medians,
    every rep's ratio, and whether every output is identical (greedy outputs must not depend on the
    batch)."""
    run_concurrent(engine, prompts[:2], 8, spec)  # warm-up
    runs, half = [], len(prompts) // 2
    for _ in range(reps):  # the all-at-once run between the two halves of the one-at-a-time runs
        one = [run_concurrent(engine, [p], max_tokens, spec) for p in prompts[:half]]
        many = run_concurrent(engine, prompts, max_tokens, spec)
        one += [run_concurrent(engine, [p], max_tokens, spec) for p in prompts[half:]]
        t1 = sum(r["tokens"] for r in one) / sum(r["seconds"] for r in one)
        runs.append((many["tokens_per_s"] / t1, t1, one, many))
    ratio, t1, one, many = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    med = lambda k: statistics.median(r[k] for r in one if r[k] is not None)  # noqa: E731
    return {"spec": spec, "sessions": len(prompts), "one_tokens_per_s": t1, "many_tokens_per_s": many["tokens_per_s"],
            "ratio": ratio, "ratios": [r[0] for r in runs], "one": {k: med(k) for k in ("ttft_s", "gap_s", "itl_s")},
            "many": {k: many[k] for k in ("ttft_s", "gap_s", "itl_s")},
            "identical": all(m["token_ids"] == [r["token_ids"][0] for r in o] for _, _, o, m in runs)}


def print_scaling(console, rows: list[dict]) -> None:
    for r in rows:
        o, m = r["one"], r["many"]
        console.print(f"{'concurrency ' + r['spec']:>30}: {r['sessions']} sessions {r['many_tokens_per_s']:.1f} tok/s vs one "
                      f"at a time {r['one_tokens_per_s']:.1f} = [bold]{r['ratio']:.2f}x[/]; TTFT {m['ttft_s'] * 1e3:.0f} vs "
                      f"{o['ttft_s'] * 1e3:.0f} ms, ITL {m['itl_s'] * 1e3:.1f} vs {o['itl_s'] * 1e3:.1f} ms, gap between "
                      f"responses {m['gap_s'] * 1e3:.0f} vs {o['gap_s'] * 1e3:.0f} ms; outputs identical {r['identical']}; "
                      f"the median of {len(r['ratios'])} reps ({', '.join(f'{x:.2f}x' for x in r['ratios'])})")


def _stream_with_arrival(engine, prompts: list[list[int]], max_tokens: int, spec: str,
                         long_prompt: list[int] | None, after_bursts: int) -> dict:
    """``prompts`` stream together; after ``after_bursts`` bursts the ``long_prompt`` turn (one token)
    arrives. Returns the streaming sessions' per-token ITL samples (s) and the long turn's TTFT (s)."""
    sched, base = engine.sched, 1 << 51
    seen: dict[int, list[tuple[float, int]]] = {}
    arrival, first = [None], [None]

    def emitter(sid):
        def emit(r, err, final):
            if err:
                raise RuntimeError(err)
            if sid == base - 1:
                first[0] = first[0] or time.perf_counter()
            else:
                seen.setdefault(sid, []).append((time.perf_counter(), len(r.tokens)))
        return emit

    sids = [base + i for i in range(len(prompts))]
    sched.admit([Turn(s, list(p), max_tokens, emitter(s), spec=spec) for s, p in zip(sids, prompts)])
    n = 0
    pending = long_prompt is not None
    while any(s in sched.turns for s in sids) or pending:
        # it arrives after ``after_bursts`` bursts, or when the streams end first (a short QUICK run)
        if pending and (n >= after_bursts or not any(s in sched.turns for s in sids)):
            pending = False
            arrival[0] = time.perf_counter()
            sched.admit([Turn(base - 1, list(long_prompt), 1, emitter(base - 1), spec=spec)])
        sched.burst()
        n += 1
    while base - 1 in sched.turns:
        sched.burst()
    itl = [(b - a) / k for ev in seen.values() for (a, _), (b, k) in zip(ev, ev[1:]) if k for _ in range(k)]
    gap = max(b - a for ev in seen.values() for (a, _), (b, _) in zip(ev, ev[1:]))
    return {"itl": itl, "max_gap_s": gap, "ttft_s": None if arrival[0] is None else first[0] - arrival[0]}


def run_long_prompt(engine, prompts: list[list[int]], long_prompt: list[int], max_tokens: int, spec: str) -> dict:
    """The streaming sessions' p90 inter-token latency alone, and with ``long_prompt`` arriving
    mid-stream primed in chunks (the engine's ``prefill_chunk``) and all at once; the long turn's
    TTFT each way. Ratios are p90 with / p90 alone (the aim: at most 2x chunked)."""
    import dataclasses

    import numpy as np

    cfg, sched = engine.sched.config, engine.sched
    p90 = lambda xs: float(np.percentile(xs, 90))  # noqa: E731
    _stream_with_arrival(engine, prompts[:1], 8, spec, None, 0)  # warm-up
    alone = _stream_with_arrival(engine, prompts, max_tokens, spec, None, 0)
    out = {"spec": spec, "sessions": len(prompts), "long_tokens": len(long_prompt), "chunk": cfg.prefill_chunk,
           "alone_p90_s": p90(alone["itl"]), "alone_max_gap_s": alone["max_gap_s"]}
    for name, chunk in (("chunked", cfg.prefill_chunk), ("whole", 0)):
        sched.config = dataclasses.replace(cfg, prefill_chunk=chunk)
        try:
            r = _stream_with_arrival(engine, prompts, max_tokens, spec, long_prompt, 3)
        finally:
            sched.config = cfg
        out[name] = {"p90_s": p90(r["itl"]), "ratio": p90(r["itl"]) / out["alone_p90_s"], "ttft_s": r["ttft_s"],
                     "max_gap_s": r["max_gap_s"]}
    return out


def print_long_prompt(console, r: dict) -> None:
    c, w = r["chunked"], r["whole"]
    console.print(f"{'long prompt ' + r['spec']:>30}: {r['sessions']} streaming sessions' p90 ITL {r['alone_p90_s'] * 1e3:.1f} ms "
                  f"alone (longest gap {r['alone_max_gap_s'] * 1e3:.0f} ms); a {r['long_tokens']}-token prompt arriving, "
                  f"primed {r['chunk']} rows a burst: p90 {c['p90_s'] * 1e3:.1f} ms = [bold]{c['ratio']:.2f}x[/] (target <= 2x), "
                  f"longest gap {c['max_gap_s'] * 1e3:.0f} ms, its TTFT {c['ttft_s']:.2f} s; primed at once: p90 "
                  f"{w['p90_s'] * 1e3:.1f} ms = {w['ratio']:.2f}x, longest gap {w['max_gap_s'] * 1e3:.0f} ms, TTFT {w['ttft_s']:.2f} s")
