"""The greedy accept walk, case by case (accept_walk is pure: drafts, trunk argmax, stop ids, budget)."""

import pytest

from tandem.engine.accept import Walk, accept_walk

STOP = 0


@pytest.mark.parametrize(
    "drafts, target, budget, want",
    [
        # all drafts accepted, plus the bonus token from the last verify row
        ([5, 6, 7], [5, 6, 7, 8], None, Walk(3, [5, 6, 7, 8], None)),
        # first draft rejected: only the trunk's own token is emitted
        ([5, 6, 7], [9, 6, 7, 8], None, Walk(0, [9], None)),
        # rejection mid-block: accepted prefix, then the trunk's token at the mismatch
        ([5, 6, 7], [5, 6, 1, 8], None, Walk(2, [5, 6, 1], None)),
        # a stop token inside the accepted block: emitted, nothing after it
        ([5, STOP, 7], [5, STOP, 7, 8], None, Walk(2, [5, STOP], "stop")),
        # the trunk's correction is the stop token
        ([5, 6], [5, STOP, 9], None, Walk(1, [5, STOP], "stop")),
        # the turn budget cuts the accepted block (2 tokens left): the walk ends with "length"
        ([5, 6, 7], [5, 6, 7, 8], 2, Walk(2, [5, 6], "length")),
        # the budget lands exactly on the bonus token
        ([5, 6, 7], [5, 6, 7, 8], 4, Walk(3, [5, 6, 7, 8], "length")),
        # budget 1 with every draft right: one token, the first draft, counted as accepted
        ([5, 6], [5, 6, 7], 1, Walk(1, [5], "length")),
        # a stop token exactly at the budget: stop wins
        ([5, STOP], [5, STOP, 3], 2, Walk(2, [5, STOP], "stop")),
        # plain decoding (no drafts): the trunk token alone
        ([], [4], None, Walk(0, [4], None)),
    ],
)
def test_accept_walk_table(drafts, target, budget, want):
    assert accept_walk(drafts, target, (STOP,), budget) == want


def test_accept_walk_rejects_bad_shapes():
    with pytest.raises(ValueError, match="target needs 3 rows, got 2"):
        accept_walk([1, 2], [1, 2])
    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        accept_walk([1], [1, 2], budget=0)
