"""`make bench`'s row summary: tau over the rounds that drafted (a demoted session's plain rounds
are not acceptance), tokens a round over all rounds (what the ceiling uses), served rows without tau."""

import pytest

from tandem.tools.bench_report import summarize


def _run(prompt, rounds, spec_rounds, accepted, accepted_at):
    return {"prompt": prompt, "token_ids": [1] * (rounds + accepted + 1), "tokens_per_s": 10.0, "ttft_s": 0.01,
            "rounds": rounds, "spec_rounds": spec_rounds, "accepted": accepted, "accepted_at": accepted_at}


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
