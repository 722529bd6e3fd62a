"""Turn the locustfile's raw JSONL (``--tandem-raw``) into the per-user-level summary and plots.

Raw records: ``{"kind": "stage", "users", "t"}`` when the ramp moves to a new level,
``{"kind": "end", "t"}`` when Locust starts stopping users, and one ``{"kind": "turn", ...}`` per
turn with ``t0`` (epoch s, request sent), ``ttft_ms``, ``e2e_ms``, ``error`` and ``bursts``
(``[t_epoch_s, tokens, rounds, accepted, drafted]`` per streamed response).

Attribution to a ramp level: a turn's requests, failures and TTFT go to the level in force when it
was sent; tokens, inter-token latencies and acceptance go to the level in force when their burst
arrived. The ``all`` row covers everything, including turns finished while Locust was stopping.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

PCTS = (50, 90, 99)
#: Columns of the summary table / CSV (latencies in ms, throughput in tokens/s).
COLUMNS = [
    "users",
    "duration_s",
    "requests",
    "failures",
    "tokens",
    "tokens_per_s",
    "requests_per_s",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p90_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "e2e_p90_ms",
    "tau",
    "rounds",
    "accepted",
]


def _records(path: str | Path):
    """The raw file's records, skipping a torn line (from a killed run)."""
    for line in Path(path).read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def read_raw(path: str | Path) -> tuple[list[tuple[float, int]], float | None, list[dict]]:
    """``(stages [(t_epoch_s, users)], end_t or None, turns)`` from a raw JSONL file (a torn
    last line, from a killed run, is skipped)."""
    stages, end, turns = [], None, []
    for r in _records(path):
        if r.get("kind") == "stage":
            stages.append((float(r["t"]), int(r["users"])))
        elif r.get("kind") == "end":
            end = float(r["t"]) if end is None else end
        elif r.get("kind") == "turn":
            turns.append(r)
    stages.sort()
    return stages, end, turns


def fault_counts(path: str | Path) -> dict[str, int]:
    """The soak's fault records of a raw file: ``cancelled`` (turns the client cancelled), ``bad``
    (bad requests sent), ``bad_wrong`` (bad requests not refused with an error naming their field)."""
    out = {"cancelled": 0, "bad": 0, "bad_wrong": 0}
    for r in _records(path):
        if r.get("kind") == "cancel":
            out["cancelled"] += 1
        elif r.get("kind") == "bad":
            out["bad"] += 1
            out["bad_wrong"] += bool(r.get("wrong"))
    return out


def _pct(values, weights=None) -> list[float | None]:
    if weights is not None:
        values = np.repeat(np.asarray(values, dtype=float), np.asarray(weights, dtype=int))
    if len(values) == 0:
        return [None] * len(PCTS)
    return [float(x) for x in np.percentile(np.asarray(values, dtype=float), PCTS)]


def _row(users, duration, turns, bursts) -> dict:
    """One summary row. ``turns``: turn records attributed here; ``bursts``: ``(t, n, rounds,
    accepted, per_token_gap_ms or None)`` attributed here."""
    ok = [t for t in turns if not t.get("error")]
    tokens = sum(b[1] for b in bursts)
    rounds = sum(b[2] for b in bursts)
    accepted = sum(b[3] for b in bursts)
    itl = [(b[4], b[1]) for b in bursts if b[4] is not None]
    ttft = _pct([t["ttft_ms"] for t in ok if t.get("ttft_ms") is not None])
    itl_p = _pct([v for v, _ in itl], [n for _, n in itl])
    e2e = _pct([t["e2e_ms"] for t in ok])
    return {
        "users": users,
        "duration_s": duration,
        "requests": len(turns),
        "failures": len(turns) - len(ok),
        "tokens": tokens,
        "tokens_per_s": tokens / duration if duration > 0 else None,
        "requests_per_s": len(turns) / duration if duration > 0 else None,
        "ttft_p50_ms": ttft[0],
        "ttft_p90_ms": ttft[1],
        "ttft_p99_ms": ttft[2],
        "itl_p50_ms": itl_p[0],
        "itl_p90_ms": itl_p[1],
        "itl_p99_ms": itl_p[2],
        "e2e_p50_ms": e2e[0],
        "e2e_p90_ms": e2e[1],
        "tau": 1.0 + accepted / rounds if rounds else None,
        "rounds": rounds,
        "accepted": accepted,
    }


def burst_rows(turn: dict) -> list[tuple]:
    """``(t_epoch_s, tokens, rounds, accepted, per_token_gap_ms)`` per burst of a turn record; the
    first burst (its gap is the TTFT) has ``None`` as gap, later ones the gap since the previous
    burst divided by their token count (ms per token)."""
    out, prev = [], None
    for t, n, r, a, *_ in turn.get("bursts") or []:
        out.append((t, n, r, a, None if prev is None else (t - prev) * 1000.0 / n))
        prev = t
    return out


def summarize(path: str | Path) -> dict:
    """Summary of a raw file: ``levels`` (one row per ramp level, see :data:`COLUMNS`; times in ms,
    throughput in tokens/s, ``duration_s`` = how long the level was in force), ``all`` (every
    record), ``by_sampling`` (``greedy`` / ``sampled``: the same row over those turns only),
    ``stages``, ``start_t`` / ``end_t`` (epoch s)."""
    stages, end, turns = read_raw(path)
    bursts = [b for t in turns for b in burst_rows(t)]
    last_t = max([t["t0"] + t["e2e_ms"] / 1000.0 for t in turns] + [s[0] for s in stages] + [0.0])
    if end is None:
        end = last_t
    starts = [s[0] for s in stages]
    # merge repeated levels (a step that did not change the user count) into one row per user count
    merged: dict[int, dict] = {}
    for i, (t_start, users) in enumerate(stages):
        t_end = starts[i + 1] if i + 1 < len(stages) else end
        m = merged.setdefault(users, {"turns": [], "bursts": [], "duration": 0.0})
        m["turns"] += [t for t in turns if t_start <= t["t0"] < t_end]
        m["bursts"] += [b for b in bursts if t_start <= b[0] < t_end]
        m["duration"] += max(0.0, t_end - t_start)
    levels = [_row(u, m["duration"], m["turns"], m["bursts"]) for u, m in merged.items()]
    t0 = starts[0] if starts else (min(t["t0"] for t in turns) if turns else 0.0)
    span = max(0.0, max(last_t, end) - t0)
    everything = _row("all", span, turns, bursts)
    by_sampling = {}  # greedy and sampled turns apart (their tau differ: a sampled draft is accepted less often)
    for kind, want in (("greedy", False), ("sampled", True)):
        ts = [t for t in turns if bool(t.get("sampled")) == want]
        by_sampling[kind] = _row(kind, span, ts, [b for t in ts for b in burst_rows(t)])
    return {
        "levels": levels,
        "all": everything,
        "by_sampling": by_sampling,
        "stages": stages,
        "start_t": t0,
        "end_t": end,
        "turns": len(turns),
    }


def tau_over_time(path: str | Path, bin_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(bin_centres_s since the first stage, tau per bin, tokens per bin)`` — mean acceptance
    length 1 + accepted / rounds of the bursts arriving in each ``bin_s``-second bin (NaN where a
    bin saw no verify round)."""
    stages, _end, turns = read_raw(path)
    bursts = [b for t in turns for b in burst_rows(t)]
    if not bursts:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    t0 = stages[0][0] if stages else min(b[0] for b in bursts)
    t = np.array([b[0] - t0 for b in bursts])
    k = np.floor(np.maximum(t, 0) / bin_s).astype(int)
    nb = int(k.max()) + 1
    rounds = np.bincount(k, weights=[b[2] for b in bursts], minlength=nb)
    acc = np.bincount(k, weights=[b[3] for b in bursts], minlength=nb)
    toks = np.bincount(k, weights=[b[1] for b in bursts], minlength=nb)
    with np.errstate(invalid="ignore", divide="ignore"):
        tau = np.where(rounds > 0, 1.0 + acc / rounds, np.nan)
    return (np.arange(nb) + 0.5) * bin_s, tau, toks


def write_summary(summary: dict, out_dir: str | Path) -> list[Path]:
    """``summary.csv`` (one row per level + ``all``) and ``summary.json`` in ``out_dir``."""
    out_dir = Path(out_dir)
    rows = summary["levels"] + [summary["all"]]
    with open(out_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow(
                {k: ("" if r.get(k) is None else round(r[k], 3) if isinstance(r[k], float) else r[k]) for k in COLUMNS}
            )
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return [out_dir / "summary.csv", out_dir / "summary.json"]


def _fmt(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def table_rows(summary: dict) -> list[list[str]]:
    """The printed table's rows: users, requests, failures, tokens/s, TTFT p50/p90/p99 (ms),
    ITL p50/p90/p99 (ms), tau."""
    out = []
    for r in summary["levels"] + [summary["all"]]:
        out.append(
            [
                str(r["users"]),
                str(r["requests"]),
                str(r["failures"]),
                _fmt(r["tokens_per_s"]),
                _fmt(r["ttft_p50_ms"], 0),
                _fmt(r["ttft_p90_ms"], 0),
                _fmt(r["ttft_p99_ms"], 0),
                _fmt(r["itl_p50_ms"]),
                _fmt(r["itl_p90_ms"]),
                _fmt(r["itl_p99_ms"]),
                _fmt(r["tau"], 2),
            ]
        )
    return out


TABLE_HEADER = [
    "users",
    "requests",
    "failures",
    "tokens/s",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p90 ms",
    "ITL p99 ms",
    "tau",
]


def markdown_table(summary: dict) -> str:
    """The summary table as GitHub Markdown."""
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|" + "---:|" * len(TABLE_HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(summary)]
    return "\n".join(lines) + "\n"


def plot_all(summary: dict, raw_path: str | Path, out_dir: str | Path, title_suffix: str = "") -> list[Path]:
    """Write ``throughput.png`` (output tokens/s vs users), ``ttft.png`` and ``itl.png`` (p50/p90/p99
    in ms vs users) and ``acceptance.png`` (mean acceptance length over time, ramp steps marked)
    into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    lv = [r for r in summary["levels"] if r["requests"] or r["tokens"]]
    users = [r["users"] for r in lv]
    sub = f"\n{title_suffix}" if title_suffix else ""
    paths = []

    def finish(fig, ax, name):
        ax.grid(True, alpha=0.3)
        if users:
            ax.set_xticks(sorted(set(users)))
        # legend under the axes, so it never hides a line
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
        fig.tight_layout()
        p = out_dir / name
        fig.savefig(p, dpi=120, bbox_inches="tight")
        plt.close(fig)
        paths.append(p)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    tps = [r["tokens_per_s"] or 0.0 for r in lv]
    ax.plot(users, tps, "o-", color="tab:blue", label="all users (aggregate)")
    ax.plot(users, [t / u for t, u in zip(tps, users)], "s--", color="tab:orange", label="per user (aggregate / users)")
    for u, t in zip(users, tps):
        ax.annotate(f"{t:.1f}", (u, t), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_title("Token throughput vs concurrent users" + sub)
    ax.set_ylim(bottom=0, top=max(tps + [1.0]) * 1.18)
    finish(fig, ax, "throughput.png")

    for key, name, label in (
        ("ttft", "ttft.png", "Time to first token (TTFT)"),
        ("itl", "itl.png", "Inter-token latency (ITL, per token)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for p, style in zip(PCTS, ("o-", "s--", "^:")):
            ys = [r[f"{key}_p{p}_ms"] for r in lv]
            xs = [u for u, y in zip(users, ys) if y is not None]
            ax.plot(xs, [y for y in ys if y is not None], style, label=f"p{p}")
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(f"{key.upper()} (ms)")
        ax.set_title(f"{label} vs concurrent users" + sub)
        ax.set_ylim(bottom=0)
        finish(fig, ax, name)

    stages = summary["stages"]
    t0 = summary["start_t"]
    span = (summary["end_t"] or t0) - t0
    bin_s = max(1.0, min(10.0, span / 40.0)) if span > 0 else 1.0
    x, tau, _toks = tau_over_time(raw_path, bin_s)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(x, tau, "o-", ms=3, color="tab:green", label=f"per {bin_s:.0f} s bin")
    overall = summary["all"]["tau"]
    if overall is not None:
        ax.axhline(overall, color="gray", ls="--", lw=1, label=f"whole run: {overall:.2f}")
    for i, (ts, u) in enumerate(stages):
        ax.axvline(ts - t0, color="k", lw=0.6, alpha=0.4)
        ax.text(
            ts - t0,
            0.98,
            f" {u} user{'s' if u != 1 else ''}",
            rotation=90,
            va="top",
            ha="left",
            fontsize=8,
            alpha=0.7,
            transform=ax.get_xaxis_transform(),
        )
    ax.set_xlabel("time since ramp start (s); vertical lines: ramp steps (users)")
    ax.set_ylabel("mean acceptance length τ\n(tokens per verify round)")
    ax.set_title("Mean acceptance length τ = 1 + accepted / rounds over time" + sub)
    finite = tau[np.isfinite(tau)] if len(tau) else tau
    top = float(finite.max()) if len(finite) else 2.0
    ax.set_ylim(bottom=min(1.0, float(finite.min()) if len(finite) else 1.0) - 0.05, top=top * 1.15 + 0.05)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    p = out_dir / "acceptance.png"
    fig.savefig(p, dpi=120, bbox_inches="tight")
    plt.close(fig)
    paths.append(p)
    return paths
