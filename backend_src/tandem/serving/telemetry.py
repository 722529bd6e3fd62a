"""Request metrics of the ``tandem`` model: counters and histogram samples accumulated as turns are
answered, drained periodically into Prometheus metrics (the publisher is
:class:`tandem.serving.metrics.MetricsPublisher`). Triton-free; thread-safe.

Names follow vLLM's spec-decode and request metrics where one exists (``tandem_`` in place of
``vllm:``; Prometheus adds ``_total`` to nothing here: counter names are written in full).
"""

from __future__ import annotations

import dataclasses
import threading
import time

from .. import schema

#: counter name -> help. ``per_pos`` counters carry a ``position`` label (draft index 0..);
#: ``request_success_total`` a ``finished_reason`` label (:data:`tandem.schema.FINISH_REASONS`)
COUNTERS = {
    "spec_decode_num_drafts_total": "verify rounds that carried drafts (vLLM spec_decode_num_drafts)",
    "spec_decode_num_draft_tokens_total": "draft tokens proposed (vLLM spec_decode_num_draft_tokens)",
    "spec_decode_num_accepted_tokens_total": "draft tokens accepted (vLLM spec_decode_num_accepted_tokens)",
    "spec_decode_num_accepted_tokens_per_pos_total": "rounds whose draft at `position` was accepted "
    "(vLLM spec_decode_num_accepted_tokens_per_pos)",
    "verify_rounds_total": "trunk verify rounds, one per session per round (plain rounds included)",
    "accept_walks_total": "accept walks run, one per verify round that ran one (compiled plain rounds need none)",
    "compiled_spec_rounds_total": "of those, the rounds run inside compiled calls (draft, verify, walk and commit "
    "together: the `compiled_spec_rounds` parameter), one per session per round",
    "prompt_tokens_total": "prompt tokens of admitted turns (vLLM prompt_tokens)",
    "generation_tokens_total": "tokens sent to clients (vLLM generation_tokens)",
    "request_success_total": "turns that finished, by `finished_reason` (vLLM request_success)",
    "request_errors_total": "requests answered with an error (refused or failed; a turn its client cancelled is "
    'request_success_total{finished_reason="cancelled"})',
    "demotions_total": "sessions the adaptive draft length moved to plain rows (no drafts)",
    "promotions_total": "sessions moved from plain rows back to drafting",
    "prefix_cache_hits_total": "new sessions whose prompt reused published prefix blocks",
    "prefix_cache_misses_total": "new sessions looked up in the prefix cache without a hit",
}
#: histogram name -> (help, bucket upper bounds)
HISTOGRAMS = {
    "time_to_first_token_seconds": (
        "request arrival to its first token's production, streamed or not (vLLM time_to_first_token_seconds)",
        (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0),
    ),
    "inter_token_latency_seconds": (
        "gap between a burst's tokens and the previous burst's (their production, "
        "streamed or not), divided by the burst's tokens, one sample per token after "
        "the first (vLLM inter_token_latency_seconds)",
        (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0),
    ),
    "acceptance_length": (
        "tokens a speculative verify round emitted (accepted drafts + 1), one sample per round",
        (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0),
    ),
}


def initial_series() -> list[tuple[str, tuple]]:
    """The counter series exported from the start, at 0: ``(name, labels)`` for every counter without
    labels and ``request_success_total`` for each finish reason (``per_pos`` series appear with their
    first draft position)."""
    out: list[tuple[str, tuple]] = []
    for name in COUNTERS:
        if name == "request_success_total":
            out += [(name, (("finished_reason", f),)) for f in schema.FINISH_REASONS]
        elif name != "spec_decode_num_accepted_tokens_per_pos_total":
            out.append((name, ()))
    return out


def acceptance_lengths(rounds: int, accepted_at: list[int]) -> dict[int, int]:
    """Rounds per acceptance length ``L`` (accepted drafts + 1) from a burst's ``accepted_at``
    (rounds whose draft ``i`` was accepted; acceptance is a prefix, so it is non-increasing):
    ``L = j + 1`` for ``accepted_at[j-1] - accepted_at[j]`` rounds, ``L = 1`` for the rest."""
    at = list(accepted_at) + [0]
    assert all(a >= b for a, b in zip([rounds] + at, at)), (rounds, accepted_at)
    out = {1: rounds - (at[0] if accepted_at else 0)}
    for j in range(1, len(at)):
        out[j + 1] = at[j - 1] - at[j]
    return {k: v for k, v in out.items() if v}


class Telemetry:
    """Accumulates counter deltas and histogram samples (seconds; tokens) until :meth:`drain`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, tuple], float] = {}
        self._samples: dict[str, list[float]] = {h: [] for h in HISTOGRAMS}

    def count(self, name: str, value: float = 1.0, **labels) -> None:
        assert name in COUNTERS, name
        if value:
            key = (name, tuple(sorted(labels.items())))
            with self._lock:
                self._counts[key] = self._counts.get(key, 0.0) + value

    def observe(self, name: str, value: float, times: int = 1) -> None:
        with self._lock:
            self._samples[name].extend([value] * times)

    def turn(self) -> "TurnClock":
        """A clock for one turn, started now (its arrival)."""
        return TurnClock(self, time.perf_counter())

    def drain(self) -> tuple[dict[tuple[str, tuple], float], dict[str, list[float]]]:
        """The counter deltas (``(name, labels) -> delta``) and samples since the last drain."""
        with self._lock:
            counts, self._counts = self._counts, {}
            samples, self._samples = self._samples, {h: [] for h in HISTOGRAMS}
        return counts, samples


class TurnClock:
    """One turn's metrics: :meth:`response` per burst as it is produced (whether its response is sent
    then or merged into one), :meth:`error` for an error final."""

    def __init__(self, tel: Telemetry, t0: float) -> None:
        self.tel, self.t0, self.last = tel, t0, None

    def response(self, receipt, spec_rounds: int) -> None:
        """A burst's ``receipt`` (a :class:`~tandem.engine.session.Receipt`), produced now;
        ``spec_rounds``: its rounds that carried drafts. Its finish reason (a client's cancel included)
        counts the turn once in ``request_success_total``."""
        tel, now, n = self.tel, time.perf_counter(), len(receipt.tokens)
        if n:
            if self.last is None:
                tel.observe("time_to_first_token_seconds", now - self.t0)
                if n > 1:  # a first response carrying more than the prime's token: the rest as ITL
                    tel.observe("inter_token_latency_seconds", (now - self.t0) / n, n - 1)
            else:
                tel.observe("inter_token_latency_seconds", (now - self.last) / n, n)
            self.last = now
        tel.count("generation_tokens_total", n)
        tel.count("verify_rounds_total", receipt.rounds)
        tel.count("spec_decode_num_drafts_total", spec_rounds)
        tel.count("spec_decode_num_draft_tokens_total", receipt.drafted)
        tel.count("spec_decode_num_accepted_tokens_total", receipt.accepted)
        for i, a in enumerate(receipt.accepted_at):
            tel.count("spec_decode_num_accepted_tokens_per_pos_total", a, position=str(i))
        if spec_rounds:
            for length, k in acceptance_lengths(spec_rounds, receipt.accepted_at).items():
                tel.observe("acceptance_length", float(length), k)
        if receipt.finish_reason:
            tel.count("request_success_total", 1, finished_reason=receipt.finish_reason)

    def error(self) -> None:
        self.tel.count("request_errors_total")


@dataclasses.dataclass
class CallStats:
    """Per ``model.op``: number of calls and total seconds (the bench's figures: BLS round trips in
    ``tandem``, time inside ``handle`` in a stage model)."""

    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, key: str, dt: float) -> None:
        self.calls[key] = self.calls.get(key, 0) + 1
        self.seconds[key] = self.seconds.get(key, 0.0) + dt

    def summary(self) -> dict[str, dict[str, float]]:
        """``{"model.op": {"calls": n, "mean_ms": ...}}``."""
        return {k: {"calls": n, "mean_ms": 1e3 * self.seconds[k] / n} for k, n in sorted(self.calls.items())}
