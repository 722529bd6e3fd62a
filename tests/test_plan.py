"""The memory plan (tandem.tools.plan) of the real GLM-5.3-Flash config and of the shipped miniature: weights per
rank against the loader's own count, a session's state against admission's estimate, what fits where."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from tandem.engine.state_size import StateSize
from tandem.model.checkpoint import param_bytes
from tandem.model.config import TrunkConfig
from tandem.tools.plan import GIB, app, plan, session_bytes, weight_bytes

REAL = TrunkConfig.from_dict({"model_type": "glm5_next_text"})


def test_weights_agree_with_the_loader_and_split_across_ranks():
    n, total, one = weight_bytes(REAL, "bf16", 1)
    assert (n, total) == param_bytes(REAL, torch.bfloat16, with_mtp=True) and one == total
    _, fp8, rank8 = weight_bytes(REAL, "fp8", 8)
    assert 0.45 * total < fp8 < 0.6 * total  # the experts dominate, and they are FP8
    assert fp8 / 8 < rank8 < 0.55 * fp8 / 4  # split 8 ways, but for the tensors every rank keeps whole


def test_session_state_agrees_with_admission_and_splits_by_heads(checkpoint):
    for cfg in (REAL, TrunkConfig.load(checkpoint)):
        est = StateSize.from_configs(cfg.to_hf_dict())
        for tokens in (4096, 8192):  # (admission counts at least MIN_ENTRIES rows and pools: shorter ones differ)
            assert session_bytes(cfg, tokens, 1, element=4) == est.session("mtp", tokens)
        assert session_bytes(cfg, 4096, 8) < session_bytes(cfg, 4096, 1) / 3


def test_the_real_model_fits_eight_80gb_gpus_in_fp8_and_not_one():
    p = plan(REAL, 8, 80 * 10**9, "fp8", 4096)
    assert p.fits and p.sessions == (p.usable - p.per_rank) // p.session and p.sessions > 16
    assert not plan(REAL, 8, 80 * 10**9, "bf16").fits and plan(REAL, 8, 141 * 10**9, "bf16").fits
    res = CliRunner().invoke(app, ["--devices", "1", "--memory-gb", "80", "--dtype", "fp8"])
    one = plan(REAL, 1, 80 * 10**9, "fp8")
    assert res.exit_code == 1 and "does not fit" in res.output
    assert f"{one.per_rank / GIB:,.1f} GiB" in res.output and f"{one.usable / GIB:,.1f} GiB" in res.output
    res = CliRunner().invoke(app, [])
    assert res.exit_code == 0 and f"{p.sessions:,} sessions of 4,096 tokens" in res.output


def test_a_split_the_server_would_refuse_is_refused_here(checkpoint, tmp_path):
    """The plan refuses what the server would: the miniature's 4 heads over 3 devices (exit 1, the reason
    named), and a folder that is not a checkpoint (exit 2, no traceback)."""
    res = CliRunner().invoke(app, [str(checkpoint), "--devices", "3"])
    assert res.exit_code == 1 and "does not split over 3 devices" in res.output and "num_attention_heads" in res.output
    assert CliRunner().invoke(app, [str(checkpoint), "--devices", "2"]).exit_code == 0
    res = CliRunner().invoke(app, [str(tmp_path / "none")])
    assert res.exit_code == 2 and "No such file" in res.output and "Traceback" not in res.output
