"""Greedy accept walk for speculative decoding (Leviathan et al. 2023, §2; greedy case)."""

from __future__ import annotations


def greedy_accept(drafts: list[int], target: list[int]) -> tuple[int, list[int]]:
    """Accept the longest draft prefix equal to the trunk's argmax.

    Args: ``drafts`` — k drafted tokens; ``target`` — the trunk argmax at each of the k+1 verify
    rows (row 0 is the anchor's row, so ``target[i]`` is the trunk's choice for draft ``i``).
    Returns ``(a, emitted)``: the number of accepted drafts ``a`` and the ``a + 1`` tokens to emit
    (accepted drafts, then the trunk token at the first mismatch or the bonus token).

    Raises ``ValueError`` when ``len(target) != len(drafts) + 1``.
    """
    if len(target) != len(drafts) + 1:
        raise ValueError(f"target needs {len(drafts) + 1} rows, got {len(target)}")
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return a, list(drafts[:a]) + [int(target[a])]
