"""The stages one engine core calls (the trunk and the drafters by spec), and what a failing one does.

A drafter stage that fails (an error, an unloaded ``drafter_*`` model) degrades its sessions to plain
decoding, which gives the same greedy output: they are counted (``stats["degraded_sessions"]``),
reported through ``on_event``, and their drafter state is dropped; sessions admitted later use the
drafter again once it answers.

A stage whose process died (or is being restarted) is named in ``unavailable``: no call goes to it;
without the trunk, turns are refused (:meth:`~tandem.engine.admission.Admission.validate`); without a
drafter, sessions decode plain.
"""

from __future__ import annotations

from typing import Callable

from .. import schema
from .protocols import DrafterAPI, DraftRequest, TrunkAPI
from .session import SpecSession


class StageSet:
    """The trunk and the drafter stages by spec (one stage may serve several specs, and gets one call per
    round for all of them), their availability and the failure handling of drafter calls.

    Args: ``trunk`` — a :class:`~tandem.engine.protocols.TrunkAPI`; ``drafters`` — spec ->
    :class:`~tandem.engine.protocols.DrafterAPI`; ``stats`` — the engine core's counters (this class adds
    ``degraded_sessions``).
    """

    def __init__(self, trunk: TrunkAPI, drafters: dict[str, DrafterAPI], stats: dict) -> None:
        self.trunk, self.drafters, self.stats = trunk, drafters, stats
        #: model names of stages that must not be called (their process died; being restarted)
        self.unavailable: frozenset[str] = frozenset()
        #: ``on_event(message)``: notable events without a request to answer (a drafter failed)
        self.on_event: Callable[[str], None] = lambda msg: None
        #: ``on_stage_dead(model, reason)``: a stage call found the stage's process dead (a drafter's
        #: sessions have gone on plain; a trunk's turns fail)
        self.on_stage_dead: Callable[[str, str], None] = lambda model, reason: None

    def name(self, stage) -> str:
        """A stage's name: the model a proxy calls (:data:`tandem.schema.MODELS`), else ``"trunk"`` for the
        trunk stage and the name in the stage's ``wire`` (a drafter in this process)."""
        if (name := getattr(stage, "model_name", None)) is not None:
            return name
        wire = getattr(stage, "wire", None)
        return "trunk" if stage is self.trunk else (wire.name if wire is not None else type(stage).__name__)

    def usable(self, stage) -> bool:
        """Whether ``stage`` may be called (it is not named in :attr:`unavailable`)."""
        return self.name(stage) not in self.unavailable

    def by_drafter(self, sessions: list[SpecSession]) -> list[tuple[DrafterAPI, list[SpecSession]]]:
        """Sessions that draft (spec other than ``off``), grouped by drafter stage (one call per stage)."""
        groups: dict[int, tuple[DrafterAPI, list[SpecSession]]] = {}
        for s in sessions:
            if s.spec != schema.OFF:
                stage = self.drafters[s.spec]
                groups.setdefault(id(stage), (stage, []))[1].append(s)
        return list(groups.values())

    def open_drafters(self, new: list[SpecSession], warm: dict) -> None:
        """Open the new sessions' drafter state, one call per stage (``warm``: sid -> ``(spec, prefix keys)``
        of a DFlash session starting from published tails); a stage that fails degrades its group."""
        for stage, group in self.by_drafter(new):
            if not self.usable(stage):
                self._degrade(group, RuntimeError(f"{self.name(stage)} is unavailable"))
                continue
            try:
                if any(s.sid in warm for s in group):  # a DFlash drafter starts from published tails
                    stage.open([s.sid for s in group], [warm.get(s.sid) for s in group])
                else:
                    stage.open([s.sid for s in group])
            except Exception as e:  # noqa: BLE001 - plain decoding instead
                self._degrade(group, e)

    def draft(self, stage: DrafterAPI, group: list[SpecSession], reqs: list[DraftRequest]) -> list[list[int]]:
        """One drafter call for ``group`` (one request each); on failure the group is degraded and drafts
        nothing (an empty list: its rows are plain)."""
        if not self.usable(stage):
            self._degrade(group, RuntimeError(f"{self.name(stage)} is unavailable"))
            return []
        try:
            return stage.draft(reqs)
        except Exception as e:  # noqa: BLE001 - plain decoding instead
            self._degrade(group, e)
            return []

    def close(self, sessions: list[SpecSession]) -> None:
        """Drop the stage state of ``sessions``: one call per usable stage (a failure raises)."""
        for stage, group in [(self.trunk, sessions)] + self.by_drafter(sessions):
            if self.usable(stage):
                stage.close([s.sid for s in group])

    def close_quietly(self, sessions: list[SpecSession]) -> None:
        """As :meth:`close`, best effort: a stage's failure is only reported (``on_event``)."""
        for stage, group in [(self.trunk, sessions)] + self.by_drafter(sessions):
            if group and self.usable(stage):
                try:
                    stage.close([s.sid for s in group])
                except Exception as e:  # noqa: BLE001
                    self.on_event(f"{self.name(stage)} close failed: {type(e).__name__}: {e}")

    def _degrade(self, group: list[SpecSession], e: Exception) -> None:
        """Sessions ``group`` decode plain from now on; their drafter state is dropped (best effort)."""
        self.stats["degraded_sessions"] = self.stats.get("degraded_sessions", 0) + len(group)
        sids, spec = [s.sid for s in group], group[0].spec
        for s in group:
            s.degraded = True
        if getattr(e, "dead", False):
            self.on_stage_dead(self.name(self.drafters[spec]), str(e))
        self.on_event(f"drafter {spec} failed ({type(e).__name__}: {e}); sequences {sids} continue by plain decoding")
        try:
            if self.usable(self.drafters[spec]):
                self.drafters[spec].close(sids)
        except Exception:  # noqa: BLE001 - the stage is failing already
            pass
