"""The fused Triton sampler and accept walk (tandem.ops.triton.sampler) against the engine's references
(sampling.targets_and_gaps / uniforms, accept.accept_walk): ragged walks, a vocabulary that is not a
power of two and spans several tiles, greedy / rejection (top-k, top-p) / coupled rows. On CPU the
kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest)."""

import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from tandem import schema  # noqa: E402
from tandem.engine import sampling  # noqa: E402
from tandem.engine.accept import accept_walk  # noqa: E402
from tandem.engine.sampling import SamplingParams  # noqa: E402
from tandem.ops import dispatch  # noqa: E402
from tandem.ops.triton import sampler  # noqa: E402

DEV = "cpu" if dispatch.interpreted() else "cuda"


@pytest.mark.parametrize(
    "seed,position,purpose",
    [
        (0, 0, sampling.ACCEPT),
        (1, 1, sampling.BONUS),
        (123456789, 77, sampling.GUMBEL),
        ((1 << 63) - 1, (1 << 40) + 3, sampling.RESIDUAL),
    ],
)
def test_philox_uniforms_bit_identical(seed, position, purpose):
    got = sampler.uniforms(seed, position, purpose, 11, DEV).cpu().numpy()  # 11: three 4-word counter blocks
    want = sampling.uniforms(seed, position, purpose, 11)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def _walks(V, lengths, gen):
    """Logits [R, V] whose first rows are peaked (drafts equal to the argmax get accepted) and drafts
    that are the previous row's argmax for the first half of each walk, random after."""
    logits = torch.randn(sum(lengths), V, generator=gen) * 2.5
    tokens, off = [], 0
    for n in lengths:
        am = logits[off : off + n].argmax(-1).tolist()
        logits[off : off + n, am] += 4.0
        toks = [7] + [am[i] if i < n // 2 else int(torch.randint(0, V, (1,), generator=gen)) for i in range(n - 1)]
        tokens.append(toks)
        off += n
    return logits, tokens


CASES = [
    SamplingParams.create(0.7, 0, 1.0, seed=5),
    SamplingParams.create(1.0, 40, 1.0, seed=7),
    SamplingParams.create(1.2, 0, 0.8, seed=9),
    SamplingParams.create(0.9, 25, 0.7, seed=11, mode=schema.COUPLED),
    SamplingParams.create(1.0, 0, 1.0, seed=(1 << 62) + 1, mode=schema.COUPLED),
]


@pytest.mark.parametrize("p", CASES, ids=lambda p: f"{p.mode}-T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_targets_equal_reference(p):
    V, lengths = 2500, [1, 5, 3, 4]  # 3 tiles of 1024, the last one partial
    gen = torch.Generator().manual_seed(1)
    logits, tokens = _walks(V, lengths, gen)
    smp = [None, (p, tokens[1], 10, False), (p, tokens[2], 300, True), (p, tokens[3], 41, False)]
    want_t, want_g = sampling.targets_and_gaps(logits, lengths, smp)
    got_t, got_g = sampler.targets_and_gaps(logits.to(DEV), lengths, smp)
    assert got_t.cpu().tolist() == want_t.tolist()
    assert torch.equal(got_g.cpu(), want_g)
    # the case is not vacuous: greedy row, skipped prime rows (target 0), accepted and rejected drafts
    assert want_t[1 : 1 + 4].tolist().count(0) < 4 and want_t[6:8].tolist() == [0, 0]
    if p.mode == schema.REJECTION:
        drafted = tokens[1][1:] + tokens[3][1:]
        tested = want_t[1:5].tolist() + want_t[9:12].tolist()
        hits = sum(d == t for d, t in zip(drafted, tested))
        assert 0 < hits < len(drafted)


def test_greedy_targets_are_the_argmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 1500, generator=gen)
    logits[0, :700] = -0.0  # signed zeros tie with +0.0 (the argmax is the first of them)
    logits[0, 700:] = torch.where(logits[0, 700:] > 0, -logits[0, 700:], logits[0, 700:])
    logits[0, 3] = 0.0
    t, g = sampler.targets_and_gaps(logits.to(DEV), [2, 4])
    top = logits.topk(2, -1)
    assert t.cpu().tolist() == top.indices[:, 0].tolist()
    assert torch.equal(g.cpu(), top.values[:, 0] - top.values[:, 1])


def test_accept_walk_equals_reference():
    rnd = random.Random(0)
    lengths, drafts, stops, budgets, targets = [], [], [], [], []
    for _ in range(48):  # walks of 1..9 rows, drafts mostly right, stop ids and budgets cutting inside blocks
        n = rnd.randint(1, 9)
        t = [rnd.randint(0, 5) for _ in range(n)]
        drafts.append([t[i] if rnd.random() < 0.7 else rnd.randint(0, 5) for i in range(n - 1)])
        lengths.append(n)
        targets += t
        stops.append(tuple(rnd.sample(range(6), rnd.randint(0, 2))))
        budgets.append(rnd.choice([None, 1, 2, 3, 5, 20]))
    acc, emit, fin = sampler.accept_walk(torch.tensor(targets, device=DEV), lengths, drafts, stops, budgets)
    off, finishes = 0, set()
    for b, n in enumerate(lengths):
        w = accept_walk(drafts[b], targets[off : off + n], stops[b], budgets[b])
        assert (int(acc[b]), targets[off : off + int(emit[b])], sampler.FINISH_CODES[int(fin[b])]) == (
            w.accepted,
            w.emitted,
            w.finish,
        ), b
        finishes.add(w.finish)
        off += n
    assert finishes == {None, "stop", "length"}


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="logits must be"):
        sampler.targets_and_gaps(torch.zeros(3, 10), [2, 2])
    with pytest.raises(ValueError, match="drafts"):
        sampler.accept_walk(torch.zeros(3, dtype=torch.int64), [3], [[1]], [()], [None])
    with pytest.raises(ValueError, match="rows"):
        sampler.accept_walk(torch.zeros(40, dtype=torch.int64), [40], [[0] * 39], [()], [None])
