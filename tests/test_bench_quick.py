"""(integration) `make bench QUICK=1` end to end: a smoke run of every row and section (in-process,
the served rows on the shared test server through ``--url``, transformers) whose JSON must hold each
row's runs and outputs equal to plain decoding. Its speeds mean nothing; the test checks the bench runs
and reports what it should (a QUICK run once crashed on its long-prompt section when the streams ended
before the prompt arrived)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.launch.serve import REPO_ROOT

pytestmark = pytest.mark.integration


def test_quick_bench_runs_every_row_and_section(tmp_path, server):
    out = tmp_path / "bench.json"
    p = subprocess.run(
        [sys.executable, "-m", "tandem.tools.bench", "--quick", "--json", str(out), "--url", server.grpc_url],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = " ".join(p.stdout.replace("│", " ").split())  # a table title wraps to the table's width
    assert "QUICK SMOKE RUN: figures mean nothing" in text, p.stdout[-3000:]
    d = json.loads(out.read_text())
    rows = {r["name"]: r for r in d["rows"]}
    assert {"plain (in-process)", "plain (served)", "transformers generate"} <= rows.keys()
    for name, r in rows.items():
        assert len(d["runs"][name]) == d["settings"]["prompts"], name  # QUICK: one rep
        if "transformers" in name:  # another implementation: divergences only at near-ties
            assert r["exact_match_rate"] * len(d["runs"][name]) + r["near_ties"] == len(d["runs"][name]), r
        else:
            assert r["exact_match_rate"] == 1.0, r  # greedy speculative and served output equal plain decoding
    assert 0 < d["ratios"]["served_vs_inprocess plain"] and d["settings"]["url"] == server.grpc_url
    lp = d["profile"]["long_prompt"]
    assert lp["waiting"]["short_ttft_s"] > 0 and lp["alone"]["gap_p90_s"] > 0 and lp["waiting"]["shorts"] == 3
    assert d["profile"]["limits"] and d["profile"]["scaling"]
