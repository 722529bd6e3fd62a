"""What the scheduler exchanges with its stages: per-sequence items (small dataclasses) and the stage
interfaces as ``typing.Protocol``s. In-process stages (:mod:`tandem.engine.trunk_stage`,
:mod:`tandem.engine.mtp_stage`) and their BLS proxies (:mod:`tandem.serving.engine_core`) both implement them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch


@dataclasses.dataclass
class Rows:
    """Trunk rows of one sequence: ``tokens`` at positions ``pos .. pos + len - 1`` (prime: committed;
    verify: ``[anchor, *drafts]``, kept pending until :class:`Commit`)."""

    sid: int
    tokens: list[int]
    #: prime only: None = no prefix cache; else the chain keys of the published blocks to start from
    #: (``len * PREFIX_BLOCK`` rows restored before ``tokens``; may be empty), and the prime is
    #: computed in pieces ending at multiples of ``PREFIX_BLOCK``, capturing the state at each
    prefix: list[int] | None = None
    #: rows of the sequence's pending verify to keep first: the previous round's :class:`Commit`,
    #: folded into this call (0: none pending)
    commit: int = 0
    #: prime only: the turn's :class:`~tandem.engine.sampling.SamplingParams` (None: greedy), which
    #: the trunk applies to this prime and the verifies after it
    sampling: Any = None
    #: prime only: the turn's :class:`~tandem.engine.structured.Constraint` (None: unconstrained), whose masks
    #: the trunk applies to this prime's last row and to every row of the verifies after it
    constraint: Any = None


@dataclasses.dataclass
class Commit:
    """Keep the first ``n_rows`` (>= 1) rows of a sequence's pending verify."""

    sid: int
    n_rows: int


@dataclasses.dataclass
class DraftRequest:
    """One sequence's drafter call: ingest ``n`` committed rows, then propose ``num_draft_tokens``
    tokens. A row is its trunk ``hidden [n, D]`` (fp32, read by the MTP spec) and target-layer
    ``features [n, F]`` (fp32, read by the DFlash specs; ``F = 0`` when the trunk exports none), and
    ``next_tokens [n]`` the token after each row (the last one is the anchor). ``spec`` is the
    session's speculation method (one of :data:`tandem.schema.SPECS` but ``off``)."""

    sid: int
    hidden: torch.Tensor
    next_tokens: list[int]
    num_draft_tokens: int
    features: torch.Tensor | None = None
    spec: str = "mtp"


@dataclasses.dataclass
class VerifyOut:
    """A trunk pass over ``R`` rows: ``argmax [R]`` int64 (each row's target token: the argmax, or under
    sampling the drawn / accept-walk token, :func:`tandem.engine.sampling.row_targets`), ``hidden [R, D]`` fp32 (final normalised
    hidden), ``top2_gap [R]`` fp32 (top-1 minus top-2 logit, for near-tie analysis), ``features
    [R, F]`` fp32 (the DFlash target-layer features; ``F = 0`` when no DFlash drafter is loaded).
    A prime decides one token, after its last row: its other rows carry argmax ``-1`` and gap ``NaN``
    (the LM head runs on the last row only)."""

    argmax: torch.Tensor
    hidden: torch.Tensor
    top2_gap: torch.Tensor
    features: torch.Tensor

    def rows(self, n: int) -> "VerifyOut":
        """The first ``n`` rows."""
        return VerifyOut(self.argmax[:n], self.hidden[:n], self.top2_gap[:n], self.features[:n])

    def rows_at(self, i: int) -> "VerifyOut":
        """Row ``i`` alone (one row)."""
        return VerifyOut(
            self.argmax[i : i + 1], self.hidden[i : i + 1], self.top2_gap[i : i + 1], self.features[i : i + 1]
        )

    def then(self, other: "VerifyOut") -> "VerifyOut":
        """These rows followed by ``other``'s."""
        return VerifyOut.join([self, other])

    @staticmethod
    def join(parts: list["VerifyOut"]) -> "VerifyOut":
        """The rows of ``parts`` one after another (one concatenation per field)."""
        return VerifyOut(*(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(VerifyOut)))


class UnknownSequence(KeyError):
    """A stage was asked about a sequence id it does not hold."""


class KeyedStates:
    """Per-sequence state of a stage, keyed by sequence id: batched ``open`` (fresh state from
    ``new_state()``, replacing any) and ``close`` (unknown ids ignored), and ``state(sid)``."""

    def __init__(self) -> None:
        self.states: dict[int, Any] = {}

    def new_state(self) -> Any:
        raise NotImplementedError

    def open(self, sids: list[int]) -> None:
        for sid in sids:
            self.states[sid] = self.new_state()

    def close(self, sids: list[int]) -> None:
        for sid in sids:
            self.states.pop(sid, None)

    def state(self, sid: int) -> Any:
        """The state of ``sid``. Raises :class:`UnknownSequence`."""
        try:
            return self.states[sid]
        except KeyError:
            raise UnknownSequence(sid) from None


class TrunkAPI(Protocol):
    """The trunk stage: one hybrid cache per open sequence. Every method is one batched call."""

    vocab_size: int
    #: prompt token ids the trunk does not serve (the released layout's image and video placeholders)
    vision_token_ids: tuple[int, ...]

    def open(self, sids: list[int]) -> None:
        """Create empty caches (replacing any)."""

    def close(self, sids: list[int]) -> None:
        """Drop caches; unknown ids are ignored; never raises."""

    def prime(self, items: list[Rows]) -> list[VerifyOut]:
        """Prefill and commit each item's rows; one output per item over its rows."""

    def verify(self, items: list[Rows]) -> list[VerifyOut]:
        """Run each item's rows without committing (follow with :meth:`commit`)."""

    def commit(self, items: list[Commit]) -> None:
        """Keep ``n_rows`` of each pending verify, drop the rest (exact rollback)."""

    def publish(self, items: list[tuple[int, list[int]]]) -> list[int]:
        """Store blocks ``keys`` (block ``i`` of each ``(sid, keys)`` item is the chain key of rows
        ``[i*C, (i+1)*C)``; keys already stored are skipped) from the sequence's prime capture; returns
        the bytes newly stored per item."""

    def evict(self, keys: list[int]) -> None:
        """Drop published blocks (unknown keys ignored)."""


class DrafterAPI(Protocol):
    """A drafter stage: per-sequence drafter state (its own KV of committed context)."""

    def open(self, sids: list[int]) -> None:
        """Create empty drafter state (replacing any)."""

    def close(self, sids: list[int]) -> None:
        """Drop drafter state; unknown ids are ignored; never raises."""

    def draft(self, items: list[DraftRequest]) -> list[list[int]]:
        """Ingest each item's committed rows and return its ``num_draft_tokens`` greedy drafts."""
