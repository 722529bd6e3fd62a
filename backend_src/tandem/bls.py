"""The Triton side of tandem, minus Triton: tensor packing for the ``trunk`` / ``drafter_mtp``
models, the services those models run, the BLS proxies the ``tandem`` model hands to its
:class:`~tandem.worker.Scheduler`, and request/response translation for ``tandem``.

Wire format (one request = one batched op over many sequences):

``trunk``
    inputs ``OP`` (string: open | close | prime | verify | commit), ``SIDS [S]`` int64,
    ``TOKENS [sum(LENGTHS)]`` int64 (the rows of every sequence, concatenated), ``LENGTHS [S]``
    int32, ``N_ROWS [S]`` int32 (commit); outputs ``ARGMAX [R]`` int64, ``HIDDEN [R, D]`` fp32,
    ``TOP2_GAP [R]`` fp32 over all rows ``R = sum(LENGTHS)`` (``R = 0`` for open/close/commit).
``drafter_mtp``
    inputs ``OP`` (open | close | draft), ``SIDS [S]``, ``HIDDEN [N, D]`` fp32, ``NEXT_TOKENS [N]``
    int64, ``LENGTHS [S]`` int32 (ingest rows per sequence, ``N = sum``), ``K [S]`` int32;
    outputs ``DRAFTS [sum(K)]`` int64, ``DRAFT_LENGTHS [S]`` int32.

The proxies (:class:`TrunkProxy`, :class:`DrafterProxy`) have the method signatures of
:class:`~tandem.stages.TrunkStage` / :class:`~tandem.stages.MTPStage`; each method is one call of
a :data:`Transport` — one ``pb_utils.InferenceRequest(...).exec()`` behind Triton
(:class:`BLSTransport`), or a direct call of the services in-process (:class:`LocalTransport`,
used by unit tests to check the wire format without a server).

Sequence ids are Triton correlation ids (uint64); on the wire they travel as int64 with the
same 64 bits (:func:`sid_to_wire`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from .stages import MTPStage, TrunkStage, VerifyOut

Arrays = dict[str, np.ndarray]

TRUNK_OPS = ("open", "close", "prime", "verify", "commit")
DRAFTER_OPS = ("open", "close", "draft")
TRUNK_OUTPUTS = ("ARGMAX", "HIDDEN", "TOP2_GAP")
DRAFTER_OUTPUTS = ("DRAFTS", "DRAFT_LENGTHS")
TANDEM_OUTPUTS = ("OUTPUT_IDS", "ROUNDS", "DRAFTED", "ACCEPTED", "FINISH_REASON")


class StageRequestError(ValueError):
    """A malformed or impossible stage request. The message starts with the offending field
    (``"SIDS: unknown sequence id 7"``, ``"TOKENS: context full: ..."``)."""


class StageError(RuntimeError):
    """A stage call over a transport failed; ``model`` and ``op`` say which, the message carries
    the remote error text."""

    def __init__(self, model: str, op: str, message: str) -> None:
        super().__init__(f"{model}.{op}: {message}")
        self.model, self.op, self.remote_message = model, op, message


# -- packing ------------------------------------------------------------------------------------------
_U64 = 1 << 64
_I63 = 1 << 63


def sid_to_wire(sid: int) -> int:
    """A sequence id in ``[-2**63, 2**64)`` as the int64 with the same bits (uint64 correlation ids
    above ``2**63 - 1`` become negative). Raises ``ValueError`` outside that range."""
    if not -_I63 <= sid < _U64:
        raise ValueError(f"sequence id {sid} does not fit in 64 bits")
    return sid - _U64 if sid >= _I63 else sid


def sid_from_wire(x: int) -> int:
    """Inverse of :func:`sid_to_wire` for ids that came from uint64 correlation ids: int64 -> uint64."""
    return x + _U64 if x < 0 else x


def string_array(s: str) -> np.ndarray:
    """A ``[1]`` TYPE_STRING tensor (numpy ``object`` array of ``bytes``)."""
    return np.array([s.encode()], dtype=np.object_)


def string_value(a: np.ndarray | None, field: str, default: str | None = None) -> str:
    """The single string in a ``[1]`` TYPE_STRING tensor (bytes or str elements).

    Raises :class:`StageRequestError` naming ``field`` when it is missing (and no default) or not
    exactly one element.
    """
    if a is None:
        if default is None:
            raise StageRequestError(f"{field} is required")
        return default
    a = np.asarray(a).reshape(-1)
    if a.size != 1:
        raise StageRequestError(f"{field} must hold exactly 1 string, got {a.size}")
    v = a[0]
    return v.decode("utf-8", errors="replace") if isinstance(v, (bytes, np.bytes_)) else str(v)


def pack_rows(items: list[tuple[int, list[int]]]) -> Arrays:
    """``[(sid, rows)]`` -> ``SIDS [S]`` int64, ``TOKENS [sum]`` int64, ``LENGTHS [S]`` int32."""
    return {
        "SIDS": np.array([sid_to_wire(s) for s, _ in items], dtype=np.int64),
        "TOKENS": np.array([t for _, rows in items for t in rows], dtype=np.int64),
        "LENGTHS": np.array([len(rows) for _, rows in items], dtype=np.int32),
    }


def split_rows(a: np.ndarray, lengths) -> list[np.ndarray]:
    """Split the leading axis of ``a`` into consecutive pieces of ``lengths`` rows (views)."""
    offs = np.cumsum([0] + [int(n) for n in lengths])
    return [a[offs[i]: offs[i + 1]] for i in range(len(offs) - 1)]


def _need(inputs: Arrays, name: str, dtype, ndim: int = 1) -> np.ndarray:
    a = inputs.get(name)
    if a is None:
        raise StageRequestError(f"{name} is required for this op")
    a = np.asarray(a)
    if a.ndim != ndim:
        raise StageRequestError(f"{name} must be {ndim}-D, got shape {list(a.shape)}")
    return a.astype(dtype, copy=False)


def _sids(inputs: Arrays) -> list[int]:
    return [int(x) for x in _need(inputs, "SIDS", np.int64)]


def _lengths(inputs: Arrays, n_sids: int, total: int, of: str, min_len: int = 1) -> list[int]:
    lengths = [int(x) for x in _need(inputs, "LENGTHS", np.int64)]
    if len(lengths) != n_sids:
        raise StageRequestError(f"LENGTHS has {len(lengths)} entries for {n_sids} SIDS")
    if any(n < min_len for n in lengths):
        raise StageRequestError(f"LENGTHS entries must be >= {min_len}, got {min(lengths)}")
    if sum(lengths) != total:
        raise StageRequestError(f"LENGTHS sum to {sum(lengths)} but {of} has {total} rows")
    return lengths


def _check_tokens(name: str, toks: np.ndarray, vocab: int) -> None:
    if toks.size and (toks.min() < 0 or toks.max() >= vocab):
        raise StageRequestError(f"{name}: token ids must be in [0, {vocab}), got {int(toks.min())}..{int(toks.max())}")


# -- services (run inside the trunk / drafter_mtp models) ---------------------------------------------
class TrunkService:
    """Executes packed ``trunk`` requests on a :class:`TrunkStage`.

    Every request is validated before any sequence is touched, so a rejected batch changes no
    cache. :meth:`handle` raises :class:`StageRequestError` naming the field.
    """

    def __init__(self, stage: TrunkStage) -> None:
        self.stage = stage
        self.cfg = stage.model.cfg

    def _empty(self) -> Arrays:
        return {"ARGMAX": np.zeros(0, np.int64), "HIDDEN": np.zeros((0, self.cfg.hidden_size), np.float32),
                "TOP2_GAP": np.zeros(0, np.float32)}

    def _known(self, sids: list[int]) -> None:
        for s in sids:
            if s not in self.stage.caches:
                raise StageRequestError(f"SIDS: unknown sequence id {sid_from_wire(s)} (not open in the trunk)")

    def handle(self, inputs: Arrays) -> Arrays:
        """Run one op. ``inputs``: name -> numpy array (see module doc). Returns the three outputs."""
        op = string_value(inputs.get("OP"), "OP")
        if op not in TRUNK_OPS:
            raise StageRequestError(f"OP must be one of {TRUNK_OPS}, got {op!r}")
        sids = _sids(inputs)
        if len(set(sids)) != len(sids):
            raise StageRequestError("SIDS: a sequence id appears twice in one request")
        if op == "open":
            for s in sids:
                self.stage.open(s)
            return self._empty()
        if op == "close":
            for s in sids:
                self.stage.close(s)
            return self._empty()
        self._known(sids)
        if op == "commit":
            n_rows = [int(x) for x in _need(inputs, "N_ROWS", np.int64)]
            if len(n_rows) != len(sids):
                raise StageRequestError(f"N_ROWS has {len(n_rows)} entries for {len(sids)} SIDS")
            for s, n in zip(sids, n_rows):
                c = self.stage.caches[s]
                if c.pending is None:
                    raise StageRequestError(f"N_ROWS: sequence {sid_from_wire(s)} has no pending verify to commit")
                if not 1 <= n <= c.pending_rows:
                    raise StageRequestError(f"N_ROWS: {n} for sequence {sid_from_wire(s)} outside [1, {c.pending_rows}]")
            self.stage.commit(list(zip(sids, n_rows)))
            return self._empty()
        toks = _need(inputs, "TOKENS", np.int64)
        lengths = _lengths(inputs, len(sids), toks.size, "TOKENS")
        _check_tokens("TOKENS", toks, self.cfg.vocab_size)
        for s, n in zip(sids, lengths):
            c = self.stage.caches[s]
            if c.pending is not None:
                raise StageRequestError(f"OP: {op} for sequence {sid_from_wire(s)} while a verify is pending (commit first)")
            if c.pos + n > c.max_ctx:
                raise StageRequestError(f"TOKENS: context full for sequence {sid_from_wire(s)}: {c.pos} + {n} rows "
                                        f"> max_ctx {c.max_ctx}")
        items = [(s, rows.tolist()) for s, rows in zip(sids, split_rows(toks, lengths))]
        outs = self.stage.prime(items) if op == "prime" else self.stage.verify(items)
        return {
            "ARGMAX": torch.cat([o.argmax for o in outs]).numpy().astype(np.int64, copy=False),
            "HIDDEN": torch.cat([o.hidden for o in outs]).float().numpy(),
            "TOP2_GAP": torch.cat([o.top2_gap for o in outs]).float().numpy(),
        }


class DrafterService:
    """Executes packed ``drafter_mtp`` requests on an :class:`MTPStage` (validated before any state
    changes). ``max_k`` bounds ``K``. :meth:`handle` raises :class:`StageRequestError`."""

    def __init__(self, stage: MTPStage, max_k: int = 16) -> None:
        self.stage = stage
        self.cfg = stage.model.cfg
        self.max_k = max_k

    def handle(self, inputs: Arrays) -> Arrays:
        """Run one op. ``inputs``: name -> numpy array (see module doc). Returns DRAFTS, DRAFT_LENGTHS."""
        op = string_value(inputs.get("OP"), "OP")
        if op not in DRAFTER_OPS:
            raise StageRequestError(f"OP must be one of {DRAFTER_OPS}, got {op!r}")
        sids = _sids(inputs)
        if len(set(sids)) != len(sids):
            raise StageRequestError("SIDS: a sequence id appears twice in one request")
        empty = {"DRAFTS": np.zeros(0, np.int64), "DRAFT_LENGTHS": np.zeros(len(sids), np.int32)}
        if op == "open":
            for s in sids:
                self.stage.open(s)
            return empty
        if op == "close":
            for s in sids:
                self.stage.close(s)
            return empty
        for s in sids:
            if s not in self.stage.states:
                raise StageRequestError(f"SIDS: unknown sequence id {sid_from_wire(s)} (not open in the drafter)")
        hidden = _need(inputs, "HIDDEN", np.float32, ndim=2)
        nxt = _need(inputs, "NEXT_TOKENS", np.int64)
        D = self.cfg.hidden_size
        if hidden.shape[1] != D:
            raise StageRequestError(f"HIDDEN must be [N, {D}], got {list(hidden.shape)}")
        if hidden.shape[0] != nxt.size:
            raise StageRequestError(f"HIDDEN has {hidden.shape[0]} rows but NEXT_TOKENS has {nxt.size}")
        lengths = _lengths(inputs, len(sids), nxt.size, "NEXT_TOKENS")
        ks = [int(x) for x in _need(inputs, "K", np.int64)]
        if len(ks) != len(sids):
            raise StageRequestError(f"K has {len(ks)} entries for {len(sids)} SIDS")
        if any(not 0 <= k <= self.max_k for k in ks):
            raise StageRequestError(f"K entries must be in [0, {self.max_k}], got {ks}")
        _check_tokens("NEXT_TOKENS", nxt, self.cfg.vocab_size)
        hs = split_rows(torch.from_numpy(np.ascontiguousarray(hidden)), lengths)
        ns = split_rows(nxt, lengths)
        res = self.stage.draft([(s, h, n.tolist(), k) for s, h, n, k in zip(sids, hs, ns, ks)])
        return {"DRAFTS": np.array([t for d in res for t in d], dtype=np.int64),
                "DRAFT_LENGTHS": np.array([len(d) for d in res], dtype=np.int32)}


# -- transports ---------------------------------------------------------------------------------------
class Transport(Protocol):
    """``transport(model, inputs, output_names) -> outputs``; raises :class:`StageError`."""

    def __call__(self, model: str, inputs: Arrays, output_names: tuple[str, ...]) -> Arrays: ...


@dataclasses.dataclass
class CallStats:
    """Per ``model.op``: number of calls and total seconds (for BLS round-trip figures)."""

    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, key: str, dt: float) -> None:
        """Record one call of ``key`` (``"model.op"``) that took ``dt`` seconds."""
        self.calls[key] = self.calls.get(key, 0) + 1
        self.seconds[key] = self.seconds.get(key, 0.0) + dt

    def summary(self) -> dict[str, dict[str, float]]:
        """``{key: {"calls": n, "mean_ms": ...}}``."""
        return {k: {"calls": n, "mean_ms": 1e3 * self.seconds[k] / n} for k, n in sorted(self.calls.items())}


class LocalTransport:
    """Calls services in this process (``{"trunk": TrunkService, "drafter_mtp": DrafterService}``),
    copying arrays both ways as a server would. Service errors become :class:`StageError`."""

    def __init__(self, services: dict[str, Any]) -> None:
        self.services = services
        self.stats = CallStats()

    def __call__(self, model: str, inputs: Arrays, output_names: tuple[str, ...]) -> Arrays:
        """Run ``services[model].handle`` on copies of ``inputs``; returns copies of ``output_names``."""
        op = string_value(inputs.get("OP"), "OP", "?")
        t0 = time.perf_counter()
        try:
            out = self.services[model].handle({k: np.array(v, copy=True) for k, v in inputs.items()})
        except StageRequestError as e:
            raise StageError(model, op, str(e)) from None
        finally:
            self.stats.add(f"{model}.{op}", time.perf_counter() - t0)
        return {k: np.array(out[k], copy=True) for k in output_names}


class BLSTransport:
    """One ``pb_utils.InferenceRequest(model_name, inputs, requested_output_names).exec()`` per call.

    ``pb_utils``: the ``triton_python_backend_utils`` module (passed in, so this module imports
    without Triton). Usable from any thread of a decoupled model. Raises :class:`StageError`
    with the remote error text.
    """

    def __init__(self, pb_utils, timeout_us: int = 0) -> None:
        self.pb = pb_utils
        self.timeout_us = timeout_us
        self.stats = CallStats()

    def __call__(self, model: str, inputs: Arrays, output_names: tuple[str, ...]) -> Arrays:
        """One blocking BLS call of ``model``; returns owned copies of ``output_names``."""
        pb = self.pb
        op = string_value(inputs.get("OP"), "OP", "?")
        tensors = [pb.Tensor(k, v if v.dtype == np.object_ else np.ascontiguousarray(v)) for k, v in inputs.items()]
        kw = {"timeout": self.timeout_us} if self.timeout_us else {}
        t0 = time.perf_counter()
        resp = pb.InferenceRequest(model_name=model, inputs=tensors, requested_output_names=list(output_names),
                                   **kw).exec()
        self.stats.add(f"{model}.{op}", time.perf_counter() - t0)
        if resp.has_error():
            raise StageError(model, op, resp.error().message())
        out = {}
        for name in output_names:
            t = pb.get_output_tensor_by_name(resp, name)
            if t is None:
                raise StageError(model, op, f"response lacks output {name}")
            out[name] = np.array(t.as_numpy(), copy=True)  # own the bytes: the response's buffer is freed with it
        return out


# -- proxies (what the tandem model's Scheduler drives) -----------------------------------------------
class TrunkProxy:
    """:class:`TrunkStage` over a transport: ``open``, ``close``, ``prime``, ``verify``, ``commit``,
    each one call of model ``model``. ``vocab_size`` (set by the owner) lets the scheduler reject
    out-of-vocabulary prompts before any call. Errors: :class:`StageError` (``close`` never raises)."""

    def __init__(self, transport: Transport, model: str = "trunk", vocab_size: int | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.t, self.model = transport, model
        self.vocab_size = vocab_size
        self.on_error = on_error

    def _call(self, op: str, arrays: Arrays) -> Arrays:
        return self.t(self.model, {"OP": string_array(op), **arrays}, TRUNK_OUTPUTS)

    def open(self, sid: int) -> None:
        """Create an empty trunk cache for ``sid`` (replacing any). Raises :class:`StageError`."""
        self._call("open", {"SIDS": np.array([sid_to_wire(sid)], np.int64)})

    def close(self, sid: int) -> None:
        """Drop the sequence's cache (best effort: a failure is reported to ``on_error``, not raised)."""
        try:
            self._call("close", {"SIDS": np.array([sid_to_wire(sid)], np.int64)})
        except Exception as e:  # noqa: BLE001 - cleanup must not take the worker down
            if self.on_error is not None:
                self.on_error(f"trunk close {sid}: {e}")

    def _rows(self, op: str, items: list[tuple[int, list[int]]]) -> list[VerifyOut]:
        if not items:
            return []
        packed = pack_rows(items)
        out = self._call(op, packed)
        lens = packed["LENGTHS"]
        am = split_rows(torch.from_numpy(np.ascontiguousarray(out["ARGMAX"]).astype(np.int64, copy=False)), lens)
        hid = split_rows(torch.from_numpy(np.ascontiguousarray(out["HIDDEN"], dtype=np.float32)), lens)
        gap = split_rows(torch.from_numpy(np.ascontiguousarray(out["TOP2_GAP"], dtype=np.float32)), lens)
        return [VerifyOut(a, h, g) for a, h, g in zip(am, hid, gap)]

    def prime(self, items: list[tuple[int, list[int]]], all_rows: bool = True) -> list[VerifyOut]:
        """Prefill each ``(sid, ids)`` (committed). Returns per item the rows' outputs (only the last
        row when ``all_rows`` is False)."""
        outs = self._rows("prime", items)
        if not all_rows:
            outs = [VerifyOut(o.argmax[-1:], o.hidden[-1:], o.top2_gap[-1:]) for o in outs]
        return outs

    def verify(self, items: list[tuple[int, list[int]]]) -> list[VerifyOut]:
        """Run each ``(sid, [anchor, *drafts])`` without committing."""
        return self._rows("verify", items)

    def commit(self, items: list[tuple[int, int]]) -> None:
        """Keep ``n_rows`` of each sequence's pending verify."""
        if not items:
            return
        self._call("commit", {"SIDS": np.array([sid_to_wire(s) for s, _ in items], np.int64),
                              "N_ROWS": np.array([n for _, n in items], np.int32)})


class DrafterProxy:
    """:class:`MTPStage` over a transport: ``open``, ``close``, ``draft``, each one call of model
    ``model``. Errors: :class:`StageError` (``close`` never raises)."""

    def __init__(self, transport: Transport, model: str = "drafter_mtp",
                 on_error: Callable[[str], None] | None = None) -> None:
        self.t, self.model = transport, model
        self.on_error = on_error

    def _call(self, op: str, arrays: Arrays) -> Arrays:
        return self.t(self.model, {"OP": string_array(op), **arrays}, DRAFTER_OUTPUTS)

    def open(self, sid: int) -> None:
        """Create empty drafter state for ``sid`` (replacing any). Raises :class:`StageError`."""
        self._call("open", {"SIDS": np.array([sid_to_wire(sid)], np.int64)})

    def close(self, sid: int) -> None:
        """Drop the sequence's drafter state (best effort, never raises)."""
        try:
            self._call("close", {"SIDS": np.array([sid_to_wire(sid)], np.int64)})
        except Exception as e:  # noqa: BLE001
            if self.on_error is not None:
                self.on_error(f"drafter close {sid}: {e}")

    def draft(self, items: list[tuple[int, torch.Tensor, list[int], int]]) -> list[list[int]]:
        """For each ``(sid, hidden [n, D] fp32, next_tokens [n], k)``: ingest the rows and return
        ``k`` greedy drafts."""
        if not items:
            return []
        hidden = np.concatenate([h.detach().float().reshape(len(n), -1).numpy() for _, h, n, _ in items], 0)
        out = self._call("draft", {
            "SIDS": np.array([sid_to_wire(s) for s, _, _, _ in items], np.int64),
            "HIDDEN": np.ascontiguousarray(hidden, dtype=np.float32),
            "NEXT_TOKENS": np.array([t for _, _, n, _ in items for t in n], np.int64),
            "LENGTHS": np.array([len(n) for _, _, n, _ in items], np.int32),
            "K": np.array([k for _, _, _, k in items], np.int32),
        })
        return [d.tolist() for d in split_rows(out["DRAFTS"], out["DRAFT_LENGTHS"])]


# -- tandem model: requests in, receipts out ----------------------------------------------------------
@dataclasses.dataclass
class TurnRequest:
    """A parsed ``tandem`` request (everything of a :class:`~tandem.worker.Turn` but ``emit``)."""

    sid: int
    tokens: list[int]
    max_tokens: int
    spec: str
    start: bool
    end: bool
    k: int | None


def _scalar(a: np.ndarray | None, field: str, default: int | None = None) -> int | None:
    if a is None:
        if default is None:
            raise StageRequestError(f"{field} is required (an INT32 tensor of shape [1])")
        return default
    a = np.asarray(a).reshape(-1)
    if a.size != 1:
        raise StageRequestError(f"{field} must hold exactly 1 value, got {a.size}")
    return int(a[0])


def parse_turn(inputs: Arrays, correlation_id: int | None = None, max_tokens_limit: int = 4096,
               specs: tuple[str, ...] = ("mtp", "off")) -> TurnRequest:
    """Parse a ``tandem`` request's tensors (absent optional inputs missing from ``inputs``).

    ``CORRID`` / ``START`` / ``END`` come from the sequence batcher's control inputs (falling back
    to ``correlation_id`` and START+END when absent, e.g. a request without a sequence id).
    Raises :class:`StageRequestError` naming the field and its limit: ``INPUT_IDS`` not 1-D,
    ``MAX_TOKENS`` missing or outside ``[1, max_tokens_limit]``, ``SPEC`` not in ``specs``,
    ``NUM_DRAFT_TOKENS`` not a single value.
    """
    corr = inputs.get("CORRID")
    if corr is not None and np.asarray(corr).size:
        sid = int(np.asarray(corr).reshape(-1).astype(np.uint64)[0])
    elif correlation_id is not None:
        sid = int(correlation_id)
    else:
        raise StageRequestError("CORRID: the request carries no sequence id")
    start = bool(_scalar(inputs.get("START"), "START", 1))
    end = bool(_scalar(inputs.get("END"), "END", 1))
    ids = inputs.get("INPUT_IDS")
    if ids is None:
        tokens: list[int] = []
    else:
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise StageRequestError(f"INPUT_IDS must be 1-D, got shape {list(ids.shape)}")
        tokens = ids.astype(np.int64).tolist()
    max_tokens = _scalar(inputs.get("MAX_TOKENS"), "MAX_TOKENS")
    if not 1 <= max_tokens <= max_tokens_limit:
        raise StageRequestError(f"MAX_TOKENS must be in [1, {max_tokens_limit}], got {max_tokens}")
    spec = string_value(inputs.get("SPEC"), "SPEC", "mtp").strip().lower() or "mtp"
    if spec not in specs:
        raise StageRequestError(f"SPEC must be one of {specs}, got {spec!r}")
    k_in = inputs.get("NUM_DRAFT_TOKENS")
    k = None if k_in is None else _scalar(k_in, "NUM_DRAFT_TOKENS")
    return TurnRequest(sid, tokens, max_tokens, spec, start, end, k)


def receipt_outputs(receipt) -> Arrays:
    """One streamed ``tandem`` response from a :class:`~tandem.session.Receipt`: ``OUTPUT_IDS [n]``
    int32, ``ROUNDS`` / ``DRAFTED`` / ``ACCEPTED [1]`` int32 (deltas for this burst),
    ``FINISH_REASON [1]`` string (empty while the turn continues)."""
    return {
        "OUTPUT_IDS": np.array(receipt.tokens, dtype=np.int32),
        "ROUNDS": np.array([receipt.rounds], dtype=np.int32),
        "DRAFTED": np.array([receipt.drafted], dtype=np.int32),
        "ACCEPTED": np.array([receipt.accepted], dtype=np.int32),
        "FINISH_REASON": string_array(receipt.finish_reason or ""),
    }


# -- model parameters -----------------------------------------------------------------------------------
def model_parameters(model_config: dict) -> dict[str, str]:
    """``parameters { key: ... value { string_value: ... } }`` of a parsed model config as a dict."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def resolve_checkpoint(params: dict[str, str], model_dir: str | Path, require_weights: bool = True) -> Path:
    """The checkpoint folder: ``$TANDEM_CHECKPOINT`` if set, else the ``checkpoint`` parameter
    (relative paths resolve against the model repository, i.e. the parent of ``model_dir``).

    Raises ``FileNotFoundError`` naming the folder and the missing file (``config.json``,
    ``tokenizer.json``, and ``model.safetensors`` when ``require_weights``).
    """
    raw = os.environ.get("TANDEM_CHECKPOINT") or params.get("checkpoint") or "weights/tandem-tiny"
    p = Path(raw)
    if not p.is_absolute():
        p = Path(model_dir).resolve().parent / p
    need = ["config.json", "tokenizer.json"] + (["model.safetensors"] if require_weights else [])
    for f in need:
        if not (p / f).exists():
            raise FileNotFoundError(f"checkpoint folder {p} lacks {f} (set TANDEM_CHECKPOINT or the model's "
                                    f"'checkpoint' parameter; `make model` trains the default)")
    return p


def resolve_dtype(params: dict[str, str]) -> str:
    """``$TANDEM_DTYPE`` if set, else the ``dtype`` parameter, else ``"bf16"``."""
    return os.environ.get("TANDEM_DTYPE") or params.get("dtype") or "bf16"


# -- Triton glue shared by the model.py adapters (pb_utils passed in) ---------------------------------------
def request_arrays(pb_utils, request, names) -> Arrays:
    """The named inputs of a ``pb_utils`` request as owned numpy arrays; absent inputs are left out."""
    out = {}
    for n in names:
        t = pb_utils.get_input_tensor_by_name(request, n)
        if t is not None:
            out[n] = np.array(t.as_numpy(), copy=True)
    return out


def make_response(pb_utils, arrays: Arrays | None = None, error: str | None = None):
    """A ``pb_utils.InferenceResponse`` with ``arrays`` as output tensors, or with ``error``."""
    if error is not None:
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(error))
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in arrays.items()])


def execute_service(pb_utils, service, requests, input_names, log=None) -> list:
    """``execute()`` of a non-decoupled stage model: one response per request; a
    :class:`StageRequestError` or any other exception becomes that request's error response."""
    responses = []
    for r in requests:
        try:
            responses.append(make_response(pb_utils, service.handle(request_arrays(pb_utils, r, input_names))))
        except StageRequestError as e:
            responses.append(make_response(pb_utils, error=str(e)))
        except Exception as e:  # noqa: BLE001 - report, keep the model alive
            if log is not None:
                log(f"internal error: {type(e).__name__}: {e}")
            responses.append(make_response(pb_utils, error=f"internal error: {type(e).__name__}: {e}"))
    return responses


def set_torch_threads(n: int = 1) -> None:
    """One intra-op (and, if still possible, inter-op) thread per model process: the models share
    a 2-core machine."""
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass
