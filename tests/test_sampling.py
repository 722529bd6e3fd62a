"""Sampled decoding: the rejection walk is lossless (histograms against the target distribution),
the noise is keyed and reproducible, the parameters are checked."""

import numpy as np
import pytest
import torch
from scipy import stats

from tandem import schema
from tandem.engine import sampling
from tandem.engine.accept import accept_walk
from tandem.engine.sampling import SamplingParams

V, N = 23, 100_000
TRANSFORMS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
}


def _draws(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    return sampling.sample(np.broadcast_to(probs, (N, V)), rng.random(N))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft", ["one-hot", "full"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_rejection_walk_emits_the_target_distribution(transform, draft, k):
    """100,000 walks of k drafts: the first emitted token follows p (the transformed trunk
    distribution) within total variation 0.01, and a chi-square test does not reject at 1e-3; tokens
    outside the top-k / top-p set never appear."""
    g = torch.Generator().manual_seed(k)
    p = sampling.transform(torch.randn(1, V, generator=g) * 2, TRANSFORMS[transform])[0]
    rng = np.random.Generator(np.random.Philox(key=[k, len(transform)]))
    probs = np.broadcast_to(p, (N, k + 1, V))
    if draft == "full":  # a drafter distribution unlike p; drafts drawn from it
        q1 = sampling.transform(torch.randn(1, V, generator=g) * 2, SamplingParams(temperature=1.0))[0]
        q = np.broadcast_to(q1, (N, k, V))
        drafts = np.stack([_draws(rng, q1) for _ in range(k)], 1)
    else:  # an argmax drafter: a fixed token per row, one inside and one outside p's support
        q, drafts = None, np.broadcast_to(np.array([int(np.argmax(p)), int(np.argmin(p))] * 3)[:k], (N, k))
    tg = sampling.rejection_targets(
        probs, np.ascontiguousarray(drafts), rng.random((N, k)), rng.random((N, k)), rng.random(N), q
    )
    first = np.array([accept_walk(d.tolist(), t.tolist()).emitted[0] for d, t in zip(drafts[:, :k], tg)])
    hist = np.bincount(first, minlength=V) / N
    tv = 0.5 * np.abs(hist - p).sum()
    assert tv <= 0.01, (transform, draft, k, tv)
    support = p > 0
    assert hist[~support].sum() == 0
    chi = stats.chisquare(np.bincount(first, minlength=V)[support], N * p[support] / p[support].sum())
    assert chi.pvalue > 1e-3, (transform, draft, k, chi)


def test_transforms_keep_the_right_tokens():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 2.0]])
    pk = sampling.transform(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert (pk > 0).tolist() == [True, False, True, False, True]  # ties at the k-th value kept
    pp = sampling.transform(logits, SamplingParams(temperature=1.0, top_p=0.5))[0]
    assert (pp > 0).tolist() == [True, False, False, False, False] and pp.sum() == pytest.approx(1.0)
    cold = sampling.transform(logits, SamplingParams(temperature=0.05))[0]
    assert cold[0] > 0.999


def test_noise_is_keyed_by_seed_position_and_purpose():
    a = sampling.uniforms(7, 100, sampling.ACCEPT, 4)
    assert np.array_equal(a, sampling.uniforms(7, 100, sampling.ACCEPT, 4))  # reproducible
    assert np.array_equal(a[:2], sampling.uniforms(7, 100, sampling.ACCEPT, 2))  # a prefix of the same stream
    others = [
        sampling.uniforms(8, 100, sampling.ACCEPT, 4),
        sampling.uniforms(7, 101, sampling.ACCEPT, 4),
        sampling.uniforms(7, 100, sampling.BONUS, 4),
    ]
    assert all(not np.array_equal(a, o) for o in others)
    long = sampling.uniforms(7, 100, sampling.GUMBEL, 10_000)  # a long stream does not run into the next position's
    assert not np.isin(sampling.uniforms(7, 101, sampling.GUMBEL, 8), long).any()


def test_sampling_parameters_are_checked_with_the_field_and_range():
    for kw, msg in [
        ({"temperature": -0.1}, "TEMPERATURE must be in [0.0, 10.0], got -0.1"),
        ({"temperature": float("nan")}, "TEMPERATURE must be a finite number"),
        ({"top_k": -1}, "TOP_K must be in [0, 1048576], got -1"),
        ({"top_p": 0.0}, "TOP_P must be in (0.0, 1.0], got 0.0"),
        ({"top_p": 1.5}, "TOP_P must be in (0.0, 1.0], got 1.5"),
        ({"seed": -3}, "SEED must be in [0, 9223372036854775807], got -3"),
        ({"mode": "nucleus"}, "SAMPLING must be one of ('rejection', 'coupled'), got 'nucleus'"),
    ]:
        with pytest.raises(
            schema.WireError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
        ):
            SamplingParams.create(**kw)
    a, b = SamplingParams.create(temperature=0.8), SamplingParams.create(temperature=0.8)
    assert a.seed != b.seed and 0 <= a.seed < 2**63  # unseeded: fresh seeds, never a shared stream


def test_coupled_targets_equal_plain_sampling_row_by_row():
    """Coupled mode: a verify block's targets equal the tokens plain decoding would sample at the
    same positions (Gumbel-max over the same noise), whatever the drafts."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    p = SamplingParams(temperature=0.9, top_k=20, seed=11, mode=schema.COUPLED)
    block = sampling.row_targets(logits, [5, 1, 2, 3], 40, p)
    alone = [int(sampling.row_targets(logits[i : i + 1], [9], 40 + i, p)[0]) for i in range(4)]
    assert block.tolist() == alone
    assert block.tolist() == sampling.row_targets(logits, [5, 7, 7, 7], 40, p).tolist()
