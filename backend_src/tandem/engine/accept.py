"""The greedy accept walk (Leviathan et al. 2023, §2, greedy case), with the turn's stop rules."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Walk:
    """Result of one accept walk: ``accepted`` drafts kept (counted toward tau), ``emitted`` tokens
    (the accepted drafts, then the trunk's token at the first mismatch or the bonus token, cut after
    the first stop token and at the turn budget) and ``finish`` (``"stop"``, ``"length"`` or None)."""

    accepted: int
    emitted: list[int]
    finish: str | None


def accept_walk(
    drafts: list[int], target: list[int], stop_ids: tuple[int, ...] = (), budget: int | None = None
) -> Walk:
    """Accept the longest draft prefix equal to the trunk's argmax, then emit the trunk's token.

    Args: ``drafts`` — k drafted tokens; ``target`` — the trunk argmax at each of the k+1 verify rows
    (row 0 is the anchor's row, so ``target[i]`` is the trunk's choice after draft ``i - 1``);
    ``stop_ids`` — tokens that end the turn (emitted, nothing after them); ``budget`` — tokens
    the turn may still emit (None: unlimited).

    Returns a :class:`Walk` with ``1 <= len(emitted) <= k + 1`` (when ``budget >= 1``).
    Raises ``ValueError`` when ``len(target) != len(drafts) + 1`` or ``budget < 1``.
    """
    if len(target) != len(drafts) + 1:
        raise ValueError(f"target needs {len(drafts) + 1} rows, got {len(target)}")
    if budget is not None and budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    emitted = list(drafts[:a]) + [int(target[a])]
    m = next((i + 1 for i, t in enumerate(emitted) if t in stop_ids), len(emitted))
    if budget is not None:
        m = min(m, budget)
    emitted = emitted[:m]
    finish = "stop" if emitted[-1] in stop_ids else ("length" if budget is not None and m == budget else None)
    return Walk(min(a, m), emitted, finish)
