"""`make bench`'s concurrency rows: N sessions admitted together into one in-process scheduler and
decoded side by side (each round one drafter call and one batched trunk verify over all of them),
against one session alone: aggregate tokens/s, TTFT, the gap between streamed responses and the
latency per token (ITL)."""

from __future__ import annotations

import statistics
import time

from .. import schema
from ..engine.scheduler import Turn


def run_concurrent(engine, prompts: list[list[int]], max_tokens: int, spec: str) -> dict:
    """Admit one turn per prompt at once and run bursts until all finish. Returns ``sessions``,
    ``tokens``, ``seconds``, ``tokens_per_s`` (aggregate), ``ttft_s`` (median), ``gap_s`` (median
    time between one session's consecutive responses), ``itl_s`` (median of gap / tokens in the
    response), ``token_ids`` per prompt and ``finish_s`` per prompt (seconds from the admission to its last
    response). ``spec`` may be a list (one per prompt; None: the server's default)."""
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
    specs = spec if isinstance(spec, list) else [spec] * len(prompts)
    sched.admit([Turn(s, list(p), max_tokens, emitter(s), spec=a) for s, p, a in zip(sids, prompts, specs)])
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
    return {
        "sessions": len(prompts),
        "tokens": tokens,
        "seconds": el,
        "tokens_per_s": tokens / el,
        "ttft_s": statistics.median(ev[0][0] - t0 for ev in seen.values()),
        "gap_s": statistics.median(gaps) if gaps else None,
        "itl_s": statistics.median(itls) if itls else None,
        "token_ids": [out[s] for s in sids],
        "finish_s": [seen[s][-1][0] - t0 for s in sids],
    }


def run_mixed(engine, prompts: list[list[int]], max_tokens: int, spec: str, reps: int = 3) -> dict:
    """``len(prompts) - 1`` plain sessions (spec ``off``) beside one session of ``spec`` (the last prompt), against
    the same batch with that session plain too, ``reps`` times in turn (plain, mixed, plain again, so drift weighs on
    both): each plain session's tokens/s (its tokens over its own time to its last response), mixed over plain, the
    median and lowest over the sessions of the median rep; whether every plain session's output is the same."""
    n = len(prompts) - 1
    every_off = [schema.OFF] * len(prompts)
    run_concurrent(engine, prompts[:2], 8, [schema.OFF, spec])  # warm-up
    runs = []
    for _ in range(reps):
        a = run_concurrent(engine, prompts, max_tokens, every_off)
        m = run_concurrent(engine, prompts, max_tokens, every_off[:n] + [spec])
        b = run_concurrent(engine, prompts, max_tokens, every_off)
        rate = [[len(t) / f for t, f in zip(r["token_ids"], r["finish_s"])][:n] for r in (a, m, b)]
        ratios = [y / ((x + z) / 2) for x, y, z in zip(*rate)]
        same = a["token_ids"][:n] == m["token_ids"][:n] == b["token_ids"][:n]
        runs.append((statistics.median(ratios), min(ratios), same))
    med = sorted(runs)[len(runs) // 2]
    return {
        "plain_sessions": n,
        "spec": spec,
        "median_ratio": med[0],
        "lowest_ratio": med[1],
        "reps": [r[0] for r in runs],
        "identical": all(r[2] for r in runs),
    }


def print_mixed(console, r: dict) -> None:
    console.print(
        f"{'mixed batch':>30}: {r['plain_sessions']} plain sessions beside one {r['spec']} session / beside a plain "
        f"one: "
        f"[bold]{r['median_ratio']:.2f}x[/] (median session; lowest {r['lowest_ratio']:.2f}x; reps "
        f"{', '.join(f'{x:.2f}x' for x in r['reps'])}); plain outputs identical {r['identical']}"
    )


def run_poor(engine, prompts: list[list[int]], max_tokens: int, spec: str, reps: int = 2) -> dict:
    """Prompts the drafters draft poorly for (``prompts``: e.g. random tokens), one session at a time: ``spec``
    against plain decoding, interleaved prompt by prompt; aggregate tokens/s ratio, the spec's share of rounds
    that drafted and its drafts a drafting round, whether the outputs are equal."""
    tok = {spec: [0, 0.0], schema.OFF: [0, 0.0]}
    rounds = drafted = spec_rounds = 0
    same = True
    engine.generate(prompts[0][:16], 8, spec=spec)
    for rep in range(reps):
        for p in prompts:
            outs = {}
            for a in (schema.OFF, spec) if rep % 2 == 0 else (spec, schema.OFF):
                o = engine.generate(p, max_tokens, spec=a)
                tok[a][0] += len(o["token_ids"])
                tok[a][1] += o["elapsed_s"]
                outs[a] = o["token_ids"]
                if a == spec:
                    rounds, drafted, spec_rounds = (
                        rounds + o["rounds"],
                        drafted + o["drafted"],
                        spec_rounds + o["spec_rounds"],
                    )
            same = same and outs[spec] == outs[schema.OFF]
    rate = {a: n / t for a, (n, t) in tok.items()}
    return {
        "spec": spec,
        "prompts": len(prompts),
        "ratio": rate[spec] / rate[schema.OFF],
        "drafted_share": spec_rounds / rounds if rounds else 0.0,
        "mean_k": drafted / spec_rounds if spec_rounds else 0.0,
        "identical": same,
    }


def print_poor(console, r: dict) -> None:
    console.print(
        f"{'poor drafts (random tokens)':>30}: {r['spec']} / plain [bold]{r['ratio']:.2f}x[/] over {r['prompts']} "
        f"prompts; rounds that drafted {r['drafted_share']:.0%}, {r['mean_k']:.2f} drafts a drafting round; "
        f"outputs identical {r['identical']}"
    )


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
    return {
        "spec": spec,
        "sessions": len(prompts),
        "one_tokens_per_s": t1,
        "many_tokens_per_s": many["tokens_per_s"],
        "ratio": ratio,
        "ratios": [r[0] for r in runs],
        "one": {k: med(k) for k in ("ttft_s", "gap_s", "itl_s")},
        "many": {k: many[k] for k in ("ttft_s", "gap_s", "itl_s")},
        "identical": all(m["token_ids"] == [r["token_ids"][0] for r in o] for _, _, o, m in runs),
    }


def print_scaling(console, rows: list[dict]) -> None:
    for r in rows:
        o, m = r["one"], r["many"]
        console.print(
            f"{'concurrency ' + r['spec']:>30}: {r['sessions']} sessions {r['many_tokens_per_s']:.1f} tok/s vs one "
            f"at a time {r['one_tokens_per_s']:.1f} = [bold]{r['ratio']:.2f}x[/]; TTFT {m['ttft_s'] * 1e3:.0f} vs "
            f"{o['ttft_s'] * 1e3:.0f} ms, ITL {m['itl_s'] * 1e3:.1f} vs {o['itl_s'] * 1e3:.1f} ms, gap between "
            f"responses {m['gap_s'] * 1e3:.0f} vs {o['gap_s'] * 1e3:.0f} ms; outputs identical {r['identical']}; "
            f"the median of {len(r['ratios'])} reps ({', '.join(f'{x:.2f}x' for x in r['ratios'])})"
        )


def _arrivals(
    engine,
    streams: list[list[int]],
    spec: str,
    longs: list[list[int]],
    short: list[int],
    shorts_at: list[float],
    window_s: float,
) -> dict:
    """``streams`` decode together; two bursts later the ``longs`` arrive together (one token each), and
    ``short`` arrives ``shorts_at`` seconds after them (each is admitted at the next burst boundary, as the
    front admits what arrived during a burst); a stream that ends (a stop token) starts again as a new
    session. The window measured ends ``window_s`` after the long prompts' arrival, or when the last of
    them has its first token, once every short prompt has its first token; then every turn is cancelled.
    Returns ``gaps`` (s) between the streams' responses that overlap the window, the streams'
    ``tokens_per_s`` in it, the TTFTs (s) of the long prompts primed in it (``long_ttft``) and of each
    short prompt (``short_ttft``), counted from its arrival."""
    sched, base = engine.sched, 1 << 52
    seen: dict[int, list[tuple[float, int]]] = {}
    cancelled: set[int] = set()

    def emitter(sid):
        def emit(r, err, final):
            if err and sid not in cancelled:
                raise RuntimeError(err)
            if r is not None:
                seen.setdefault(sid, []).append((time.perf_counter(), len(r.tokens)))

        return emit

    room = sched.config.max_ctx - max(map(len, streams)) - 1
    live = {base + i: p for i, p in enumerate(streams)}  # sid -> prompt of the streams running
    stream_sids = list(live)
    sched.admit([Turn(s, list(p), room, emitter(s), spec=spec) for s, p in live.items()])
    sched.burst()
    sched.burst()
    t0 = time.perf_counter()
    long_sids = [base + 1000 + i for i in range(len(longs))]
    if longs:
        sched.admit([Turn(s, list(p), 1, emitter(s), spec=spec) for s, p in zip(long_sids, longs)])
    arrive: dict[int, float] = {}
    pending = sorted(shorts_at)
    waiting = lambda: any(s in sched.turns for s in long_sids) if longs else True  # noqa: E731
    while pending or any(s in sched.turns for s in arrive) or (waiting() and time.perf_counter() < t0 + window_s):
        now = time.perf_counter()
        due = [a for a in pending if t0 + a <= now]
        if due:
            pending = pending[len(due) :]
            turns = [
                Turn(base + 2000 + len(arrive) + j, list(short), 1, emitter(base + 2000 + len(arrive) + j), spec=spec)
                for j in range(len(due))
            ]
            arrive.update((t.sid, t0 + a) for t, a in zip(turns, due))
            sched.admit(turns)
        if ended := [s for s in live if s not in sched.turns]:
            again = {base + 3000 + len(stream_sids) + j: live.pop(s) for j, s in enumerate(ended)}
            live.update(again)
            stream_sids += list(again)
            sched.admit([Turn(s, list(p), room, emitter(s), spec=spec) for s, p in again.items()])
        sched.burst()
    t1 = time.perf_counter()
    for s in list(live) + long_sids:
        if s in sched.turns:
            cancelled.add(s)
            sched.cancel(s)
    firsts = {sid: seen[sid][0][0] for sid in long_sids + list(arrive) if sid in seen}
    if longs and all(s in firsts for s in long_sids):
        t1 = min(t1, max(firsts[s] for s in long_sids))
    evs = [seen.get(s, []) for s in stream_sids]
    return {
        "gaps": [b - a for ev in evs for (a, _), (b, _) in zip(ev, ev[1:]) if b > t0 and a < t1],
        "tokens_per_s": sum(n for ev in evs for t, n in ev if t0 < t <= t1) / (t1 - t0),
        "long_ttft": [firsts[s] - t0 for s in long_sids if s in firsts],
        "short_ttft": [firsts[s] - a for s, a in arrive.items()],
    }


def run_long_prompt(
    engine,
    streams: list[list[int]],
    longs: list[list[int]],
    short: list[int],
    spec: str,
    shorts_at: list[float],
    window_s: float,
) -> dict:
    """Head-of-line blocking: ``streams`` decode while the ``longs`` prompts wait to be primed (under the
    engine's ``prefill_budget``) and a ``short`` prompt arrives at each of ``shorts_at`` seconds, over a
    window of ``window_s`` (:func:`_arrivals`); against the same streams and short prompts without the
    long ones. Returns per side (``alone``, ``waiting``) the streams' p90 gap between responses (s), their
    tokens/s and the short prompt's median TTFT (s), the TTFTs of the long prompts primed within the
    window, and the ratios waiting / alone (the aim: gap at most 2x, short TTFT at most 3x)."""
    import numpy as np

    _arrivals(engine, streams[:1], spec, [], short, [0.0], 0.0)  # warm-up
    out = {
        "spec": spec,
        "sessions": len(streams),
        "long_prompts": len(longs),
        "long_tokens": len(longs[0]),
        "short_tokens": len(short),
        "budget": engine.sched.config.prefill_budget,
        "window_s": window_s,
        "prefix_cache_mb": engine.sched.config.prefix_cache_mb,
    }
    for name, ls in (("alone", []), ("waiting", longs)):
        r = _arrivals(engine, streams, spec, ls, short, shorts_at, window_s)
        out[name] = {
            "gap_p90_s": float(np.percentile(r["gaps"], 90)),
            "tokens_per_s": r["tokens_per_s"],
            "short_ttft_s": float(np.median(r["short_ttft"])),
            "shorts": len(r["short_ttft"]),
            "long_ttft_s": r["long_ttft"],
        }
    a, w = out["alone"], out["waiting"]
    out["gap_ratio"], out["ttft_ratio"] = w["gap_p90_s"] / a["gap_p90_s"], w["short_ttft_s"] / a["short_ttft_s"]
    return out


def print_long_prompt(console, r: dict) -> None:
    a, w = r["alone"], r["waiting"]
    console.print(
        f"{'long prompts ' + r['spec']:>30}: {r['sessions']} streaming sessions' p90 gap between responses "
        f"{a['gap_p90_s'] * 1e3:.0f} ms alone, {w['gap_p90_s'] * 1e3:.0f} ms with {r['long_prompts']} prompts of "
        f"{r['long_tokens']} tokens waiting = [bold]{r['gap_ratio']:.2f}x[/] (target <= 2x); "
        f"a {r['short_tokens']}-token prompt's TTFT {a['short_ttft_s'] * 1e3:.0f} vs {w['short_ttft_s'] * 1e3:.0f} ms "
        f"= [bold]{r['ttft_ratio']:.2f}x[/] "
        f"(target <= 3x, median of {w['shorts']}); streams {a['tokens_per_s']:.0f} vs {w['tokens_per_s']:.0f} tok/s; "
        f"{len(w['long_ttft_s'])} of the long prompts primed within the {r['window_s']:g} s measured "
        f"(prefill_budget {r['budget']} rows a burst, prefix cache {r.get('prefix_cache_mb', 0)} MB)"
    )
