"""`make bench`'s row summary: tau over the rounds that drafted (a demoted session's plain rounds
are not acceptance), tokens a round over all rounds (what the ceiling uses), served rows without tau."""

import pytest

from tandem.tools.bench_report import speedup_ratios, summarize


def _run(prompt, rounds, spec_rounds, accepted, accepted_at):
    return {
        "prompt": prompt,
        "token_ids": [1] * (rounds + accepted + 1),
        "tokens_per_s": 10.0,
        "ttft_s": 0.01,
        "rounds": rounds,
        "spec_rounds": spec_rounds,
        "accepted": accepted,
        "accepted_at": accepted_at,
    }


def test_tau_counts_only_rounds_that_drafted():
    plain = {0: {"token_ids": [1] * 20}, 1: {"token_ids": [1] * 20}}
    # prompt 0: 10 rounds, all drafting; prompt 1: 20 rounds, 4 of them drafting (demoted the rest)
    runs = [_run(0, 10, 10, 20, [8, 7, 5]), _run(1, 20, 4, 6, [3, 2, 1])]
    row = summarize("dflash2 (in-process)", runs, plain, 3, None)
    assert row["mean_acceptance_length"] == pytest.approx(1 + 26 / 14)
    assert row["tokens_per_round"] == pytest.approx(1 + 26 / 30)
    assert row["spec_round_share"] == pytest.approx(14 / 30)
    assert row["acceptance_per_position"] == pytest.approx([11 / 14, 9 / 14, 6 / 14])
    served = summarize("dflash2 (served)", [dict(r, spec_rounds=None) for r in runs], plain, 3, None)
    assert served["mean_acceptance_length"] is None and served["acceptance_per_position"] == []


def test_served_vs_in_process_gives_the_aggregate_and_the_paired_median():
    """Served / in-process per served row: all tokens over all seconds, and the median over prompts of
    each prompt's served / in-process speed (the pairs ran back to back)."""
    tps = {"plain (in-process)": [100, 100, 100], "plain (served)": [90, 50, 95]}
    raw = {
        n: [{"prompt": i, "tokens_per_s": float(v), "token_ids": [1] * 100} for i, v in enumerate(vs)]
        for n, vs in tps.items()
    }
    by = {n: {"tokens_per_s_aggregate": 300 / sum(100 / v for v in vs)} for n, vs in tps.items()}
    out = speedup_ratios(by, raw, [], ["plain"], False)
    assert out["served_vs_inprocess plain"] == pytest.approx((300 / (100 / 90 + 100 / 50 + 100 / 95)) / 100)
    assert out["served_vs_inprocess_median_prompt plain"] == pytest.approx(0.90)


def test_the_paired_median_pairs_each_prompt_within_its_rep():
    """With reps, a served run is paired with the in-process run of the same prompt in the same rep
    (they ran back to back), not with the last in-process run of that prompt."""
    ip = [(0, 0, 100.0), (0, 1, 50.0), (1, 0, 100.0), (1, 1, 100.0)]  # (prompt, rep, tokens/s): rep 1 of prompt 0 slow
    sv = [(0, 0, 90.0), (0, 1, 45.0), (1, 0, 80.0), (1, 1, 90.0)]
    raw = {
        n: [{"prompt": p, "rep": r, "tokens_per_s": v, "token_ids": [1] * 100} for p, r, v in runs]
        for n, runs in (("plain (in-process)", ip), ("plain (served)", sv))
    }
    by = {n: {"tokens_per_s_aggregate": 1.0} for n in raw}
    out = speedup_ratios(by, raw, [], ["plain"], False)
    assert out["served_vs_inprocess_median_prompt plain"] == pytest.approx(0.9)  # pairs 0.9, 0.9, 0.8, 0.9


def test_the_best_spec_is_the_fastest_that_drafted():
    """A spec row that drafted in no round decoded plain rows: the best spec (whose load, mixed-batch and
    poor-draft sections follow) is the fastest of those that drafted, the fastest of all when none did."""
    rows = {"plain": (100.0, None), "mtp d=3": (110.0, None), "dflash2": (104.0, 0.2), "dflash": (101.0, 0.3)}
    by = {f"{n} (in-process)": {"tokens_per_s_aggregate": v, "spec_round_share": s} for n, (v, s) in rows.items()}
    raw = {n: [{"prompt": 0, "tokens_per_s": by[n]["tokens_per_s_aggregate"]}] for n in by}
    out = speedup_ratios(by, raw, ["mtp d=3", "dflash", "dflash2"], [], False)
    assert out["best_spec"] == "dflash2" and out["best_spec_vs_plain"] == pytest.approx(1.04)
    for n in ("dflash", "dflash2"):
        by[f"{n} (in-process)"]["spec_round_share"] = None
    assert speedup_ratios(by, raw, ["mtp d=3", "dflash", "dflash2"], [], False)["best_spec"] == "mtp d=3"
