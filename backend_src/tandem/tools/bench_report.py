"""`make bench`'s figures from its raw runs: per-row medians and spreads, acceptance, exact match,
ratios, the analytical ceiling per spec, the served round breakdown, and the printed table.

The ceiling of an in-process spec is ``n * T_plain / T_round`` with ``n`` the tokens its rounds
emit on average, ``T_round`` the measured draft + verify (commit folded in) + accept time of its
rounds and ``T_plain`` plain decoding's round (Leviathan et al. 2023, §3.4, expected walltime
improvement, with measured rather than modelled costs). ``n`` equals tau when every round drafts;
the adaptive draft length makes some rounds plain, so tau (the mean acceptance length, vLLM's definition:
1 + accepted / rounds that drafted) and the share of rounds that drafted are printed apart.
"""

from __future__ import annotations

import statistics

STAGES = ("draft_s", "verify_s", "accept_s")


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of ``xs`` (inclusive method; one value gives it three times)."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def summarize(name: str, runs: list[dict], plain_ref: dict[int, dict], n_pos: int, rss_mb: float | None) -> dict:
    """One table row from a row's runs (``tokens_per_s`` is the median over prompts,
    ``tokens_per_s_aggregate`` all tokens over all seconds: the figure ratios and ceilings use) (``tokens_per_s``, ``token_ids``, ``ttft_s``, ``rounds``,
    ``accepted``, ``accepted_at``, ``top2_gaps`` per prompt). ``n_pos``: draft positions (0 for rows
    that do not draft); ``plain_ref``: prompt -> the plain in-process run. Exact match counts prompts
    equal to plain in-process; a divergence where plain decoding's top-2 logit gap at the first
    differing token is under 0.125 (one bf16 step at these logit sizes) is a counted near-tie."""
    q1, med, q3 = quantiles([r["tokens_per_s"] for r in runs])
    tokens = sum(len(r["token_ids"]) for r in runs)
    seconds = sum(len(r["token_ids"]) / r["tokens_per_s"] for r in runs if r["tokens_per_s"])
    # tau and the per-position rates are over the rounds that carried drafts (vLLM's definition): a
    # resting session's plain rounds are not acceptance. Served rows report no spec_rounds: no tau.
    spec = [r.get("spec_rounds") for r in runs]
    spec_rounds = sum(spec) if None not in spec else 0
    all_rounds = sum(r["rounds"] for r in runs)
    acc = sum(r["accepted"] for r in runs)
    per_pos = (
        [sum(r["accepted_at"][j] for r in runs if j < len(r["accepted_at"])) / spec_rounds for j in range(n_pos)]
        if n_pos and spec_rounds and any(r["accepted_at"] for r in runs)
        else []
    )
    ttfts = [r["ttft_s"] for r in runs if r.get("ttft_s") is not None]
    exact, near_ties = 0, 0
    for r in runs:
        ref = plain_ref[r["prompt"]]["token_ids"]
        if r["token_ids"] == ref:
            exact += 1
            continue
        j = next((i for i, (a, b) in enumerate(zip(r["token_ids"], ref)) if a != b), min(len(ref), len(r["token_ids"])))
        gaps = plain_ref[r["prompt"]].get("top2_gaps") or []
        near_ties += bool(j < len(gaps) and gaps[j] < 0.125)
    return {
        "name": name,
        "tokens_per_s": med,
        "tokens_per_s_q1": q1,
        "tokens_per_s_q3": q3,
        "tokens_per_s_aggregate": tokens / seconds if seconds else 0.0,
        "mean_acceptance_length": (1 + acc / spec_rounds) if n_pos and spec_rounds else None,
        "acceptance_per_position": per_pos,
        "ttft_s": statistics.median(ttfts) if ttfts else None,
        "spec_round_share": spec_rounds / all_rounds if spec_rounds else None,
        "mean_k": sum(r.get("drafted", 0) for r in runs) / spec_rounds if spec_rounds else None,
        "tokens_per_round": 1 + acc / all_rounds if spec_rounds else None,
        "peak_rss_mb": rss_mb,
        "exact_match_rate": exact / len(runs),
        "near_ties": near_ties,
        "new_tokens": sum(len(r["token_ids"]) for r in runs),
    }


def _median_prompt_ratio(raw: dict, row: str, ref: str) -> float | None:
    """The median over prompts and reps of ``row``'s tokens/s over ``ref``'s on the same prompt in the
    same rep (they ran back to back; None: no pair)."""
    key = lambda r: (r["prompt"], r.get("rep", 0))  # noqa: E731
    base = {key(r): r["tokens_per_s"] for r in raw[ref]}
    pairs = [r["tokens_per_s"] / base[key(r)] for r in raw[row] if base.get(key(r)) and r["tokens_per_s"]]
    return statistics.median(pairs) if pairs else None


def speedup_ratios(by: dict, raw: dict, labels: list[str], served: list[str], hf: bool) -> dict:
    """The ratios: best in-process spec / plain (all tokens over all seconds, and the median of the
    per-prompt ratios), served / in-process per served row (the same two: the per-prompt pairs ran
    back to back, so their median is the steadier figure on a noisy machine), tandem plain / transformers.
    The best spec is the fastest of those that drafted in some round (one that never drafted decoded plain
    rows: the later sections would measure plain decoding against itself), else the fastest."""
    agg = {n: r["tokens_per_s_aggregate"] for n, r in by.items()}
    plain = agg["plain (in-process)"]
    out: dict = {}
    if labels:
        drafted = [x for x in labels if by[f"{x} (in-process)"].get("spec_round_share")]
        best = max(drafted or labels, key=lambda x: agg[f"{x} (in-process)"])
        out.update(
            best_spec=best,
            best_spec_vs_plain=agg[f"{best} (in-process)"] / plain,
            best_spec_vs_plain_median_prompt=_median_prompt_ratio(raw, f"{best} (in-process)", "plain (in-process)"),
        )
    for label in served:
        ip = agg.get(f"{label} (in-process)")
        if ip:
            out[f"served_vs_inprocess {label}"] = agg[f"{label} (served)"] / ip
            out[f"served_vs_inprocess_median_prompt {label}"] = _median_prompt_ratio(
                raw, f"{label} (served)", f"{label} (in-process)"
            )
    if hf:
        out["plain_vs_transformers"] = plain / agg["transformers generate"]
    return out


def ceilings(by: dict, timings: dict[str, dict], plain_timing: dict) -> dict:
    """Per in-process spec (``label -> scheduler timing``): measured round costs, tau, ceiling and
    measured speed-up over plain (all tokens over all seconds). Adds ``ceiling_speedup`` to each spec's row in ``by``."""
    t_plain = sum(plain_timing[x] for x in STAGES) / max(plain_timing["rounds"], 1)
    plain_tps = by["plain (in-process)"]["tokens_per_s_aggregate"]
    out = {"plain_round_s": t_plain, "specs": {}}
    for label, ts in timings.items():
        t_round = {x: ts[x] / max(ts["rounds"], 1) for x in STAGES}
        row = by[f"{label} (in-process)"]
        tau, per_round = row["mean_acceptance_length"], row.get("tokens_per_round")  # equal unless resting rounds
        ceiling = per_round * t_plain / sum(t_round.values()) if sum(t_round.values()) and per_round else None
        row["ceiling_speedup"] = ceiling
        out["specs"][label] = {
            "round_s": t_round,
            "rounds": ts["rounds"],
            "tau": tau,
            "tokens_per_round": per_round,
            "spec_round_share": row.get("spec_round_share"),
            "mean_k": row.get("mean_k"),
            "ceiling_speedup": ceiling,
            "measured_speedup": row["tokens_per_s_aggregate"] / plain_tps,
            "round_in_plain_steps": sum(t_round.values()) / t_plain if t_plain else None,
        }
    return out


def print_report(console, rows: list[dict], ratios: dict, profile: dict, title: str) -> None:
    """The rich table, the ratios, one ceiling line per spec and the served calls."""
    from rich.table import Table

    table = Table(title=title)
    for c in (
        "row",
        "tok/s (all)",
        "tok/s (median)",
        "IQR",
        "tau",
        "accept/pos",
        "TTFT ms",
        "RSS MB",
        "exact vs plain",
        "ceiling",
    ):
        table.add_column(c, justify="right" if c != "row" else "left", no_wrap=True)
    for r in rows:
        exact = f"{r['exact_match_rate']:.0%}" + (f" ({r['near_ties']} near-tie)" if r.get("near_ties") else "")
        table.add_row(
            r["name"],
            f"{r['tokens_per_s_aggregate']:.1f}",
            f"{r['tokens_per_s']:.1f}",
            f"{r['tokens_per_s_q1']:.1f}-{r['tokens_per_s_q3']:.1f}",
            "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}",
            " ".join(f"{p:.2f}" for p in r["acceptance_per_position"]),
            "" if r["ttft_s"] is None else f"{r['ttft_s'] * 1e3:.0f}",
            "" if r["peak_rss_mb"] is None else f"{r['peak_rss_mb']:.0f}",
            exact,
            f"{r['ceiling_speedup']:.2f}x" if r.get("ceiling_speedup") else "",
        )
    console.print(table)
    for key, v in ratios.items():
        console.print(f"{key:>30}: " + (f"{v:.2f}x" if isinstance(v, float) else str(v)))
    t_plain = profile["ceilings"]["plain_round_s"]
    for name, a in profile["ceilings"]["specs"].items():
        if a["ceiling_speedup"] is None:
            continue
        console.print(
            f"{'ceiling ' + name:>30}: {a['ceiling_speedup']:.2f}x  measured {a['measured_speedup']:.2f}x = "
            f"{a['tokens_per_round']:.2f} tokens a round (tau {a['tau']:.2f} on the {a['spec_round_share']:.0%} of "
            f"rounds that drafted, {a['mean_k']:.2f} drafts each) / round {a['round_in_plain_steps']:.2f} plain steps ("
            + ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in a["round_s"].items())
            + f" ms; plain round {t_plain * 1e3:.1f} ms)"
        )
    pre = profile.get("prefix")
    if pre:
        console.print(
            f"{'prefix cache (' + pre['spec'] + ')':>30}: TTFT warm/cold {pre['ttft_ratio_same']:.2f}x (same prompt), "
            f"{pre['ttft_ratio_shared']:.2f}x (shared system prompt); prime rows skipped "
            f"{pre['rows_skipped_same']:.0f} / {pre['rows_skipped_shared']:.0f} per prompt of "
            f"{pre['prompt_rows']:.0f}; tau warm/cold {pre['tau_ratio']:.3f}; identical outputs "
            f"{pre['identical']}/{pre['pairs']}"
        )
