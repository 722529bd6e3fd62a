"""The wire's types and generic array helpers, shared by both sides of every Triton call: tensor and
model specs, the request error, and conversions between numpy arrays and typed values. The concrete
tensors, defaults and limits are declared once in :mod:`tandem.schema`, which re-exports these.

numpy only (no torch, no Triton): the client imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]

#: Triton data type -> numpy dtype (``TYPE_STRING`` tensors are numpy ``object`` arrays of bytes).
NUMPY = {
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_UINT64": np.uint64,
    "TYPE_FP32": np.float32,
    "TYPE_STRING": np.object_,
    "TYPE_BOOL": np.bool_,
}


class WireError(ValueError):
    """A malformed or impossible request. The message starts with the offending wire field
    (``"SIDS: unknown sequence id 7"``, ``"MAX_TOKENS must be in [1, 4096], got 0"``)."""


@dataclasses.dataclass(frozen=True)
class TensorWire:
    """One input or output: ``name``, Triton ``dtype`` (``"TYPE_INT32"`` ...), ``dims`` (``-1`` =
    variable), ``optional``, ``default`` (value used when an optional input is absent) and a value
    range ``lo..hi`` (None = unbounded; inclusive, but for ``lo`` itself when ``lo_open``). Size limits,
    checked before an input is decoded (:func:`check_size`): ``max_items`` elements of a variable-length
    input at most, ``max_bytes`` bytes per ``TYPE_STRING`` element at most (None: :data:`MAX_STRING_BYTES`)."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    default: Any = None
    lo: int | float | None = None
    hi: int | float | None = None
    doc: str = ""
    #: the lower bound itself is outside the range (``(lo, hi]``)
    lo_open: bool = False
    max_items: int | None = None
    max_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class ModelWire:
    """A Triton model's interface: ``inputs``, ``outputs``, ``parameters`` (config.pbtxt
    ``parameters`` keys), ``ops`` (values of its ``OP`` input; empty for ``tandem``),
    and ``decoupled``."""

    name: str
    inputs: tuple[TensorWire, ...]
    outputs: tuple[TensorWire, ...]
    parameters: tuple[str, ...]
    ops: tuple[str, ...] = ()
    decoupled: bool = False

    def input(self, name: str) -> TensorWire:
        """The input spec called ``name``. Raises ``KeyError``."""
        return {t.name: t for t in self.inputs}[name]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The inputs' names, as a model's ``execute`` reads them."""
        return tuple(t.name for t in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)


#: bytes per element of a ``TYPE_STRING`` input whose spec names no ``max_bytes`` (a spec, a mode, a key)
MAX_STRING_BYTES = 256


# -- array helpers (generic) -------------------------------------------------------------------------------------------
def check_size(a: np.ndarray, tensor: TensorWire, max_items: int | None = None) -> None:
    """Refuse input ``a`` of ``tensor`` before any work on its content: more than ``max_items`` elements
    (default ``tensor.max_items``; None: any number), or a ``TYPE_STRING`` element over ``tensor.max_bytes``
    (:data:`MAX_STRING_BYTES` when None). Raises :class:`WireError` naming the field and the limit."""
    limit = tensor.max_items if max_items is None else max_items
    if limit is not None and a.size > limit:
        raise WireError(f"{tensor.name} has {a.size} elements, over the limit of {limit}")
    if tensor.dtype == "TYPE_STRING":
        cap = MAX_STRING_BYTES if tensor.max_bytes is None else tensor.max_bytes
        for v in a.reshape(-1)[: limit if limit is not None else None]:
            n = len(v) if isinstance(v, (bytes, np.bytes_, str)) else 0
            if n > cap:
                raise WireError(f"{tensor.name}: a string of {n} bytes is over the limit of {cap} bytes")


def string_array(s: str) -> np.ndarray:
    """A ``[1]`` TYPE_STRING tensor (numpy ``object`` array of ``bytes``)."""
    return np.array([s.encode()], dtype=np.object_)


def _single(arrays: Arrays, tensor: TensorWire, what: str):
    """The one element of input ``tensor``, or None when it is absent and optional (Raises
    :class:`WireError` when it is required and absent, or not exactly one element)."""
    a = arrays.get(tensor.name)
    if a is None:
        if tensor.optional:
            return None
        raise WireError(f"{tensor.name} is required" + ("" if what == "string" else " (an INT32 tensor of shape [1])"))
    a = np.asarray(a).reshape(-1)
    if a.size != 1:
        raise WireError(f"{tensor.name} must hold exactly 1 {what}, got {a.size}")
    check_size(a, tensor)
    return a[0]


def get_string(arrays: Arrays, tensor: TensorWire) -> str:
    """The single string of input ``tensor`` (its default when absent and optional).

    Raises :class:`WireError` naming the field when it is missing, not exactly one element or over its
    size limit (:func:`check_size`)."""
    v = _single(arrays, tensor, "string")
    if v is None:
        return tensor.default
    return v.decode("utf-8", errors="replace") if isinstance(v, (bytes, np.bytes_)) else str(v)


def get_scalar(arrays: Arrays, tensor: TensorWire) -> int | float | None:
    """The single number of input ``tensor``: an int, or a float for ``TYPE_FP32`` (its default when
    absent and optional; range checks are the caller's, see :func:`check_range`). Raises
    :class:`WireError` naming the field (also for a NaN)."""
    v = _single(arrays, tensor, "value")
    if v is None:
        return tensor.default
    if tensor.dtype == "TYPE_FP32":
        if not np.isfinite(v):
            raise WireError(f"{tensor.name} must be a finite number, got {v}")
        return float(v)
    if tensor.dtype == "TYPE_BOOL":
        return bool(v)
    return int(v)


def get_strings(arrays: Arrays, tensor: TensorWire) -> tuple[str, ...]:
    """The strings of the 1-D ``TYPE_STRING`` input ``tensor`` (UTF-8; its default when absent).
    Raises :class:`WireError` naming the field for another rank, invalid UTF-8 or a size over its limits
    (:func:`check_size`)."""
    a = arrays.get(tensor.name)
    if a is None:
        return tuple(tensor.default or ())
    a = np.asarray(a)
    if a.ndim != 1:
        raise WireError(f"{tensor.name} must be 1-D, got shape {list(a.shape)}")
    check_size(a, tensor)
    try:
        return tuple(v.decode("utf-8") if isinstance(v, (bytes, np.bytes_)) else str(v) for v in a.tolist())
    except UnicodeDecodeError as e:
        raise WireError(f"{tensor.name} must be UTF-8 text: {e}") from None


def check_range(tensor: TensorWire, v: int | float, hi: int | float | None = None) -> None:
    """Raise :class:`WireError` ``"NAME must be in [lo, hi], got v"`` when ``v`` is outside the
    tensor's range (``hi`` overrides ``tensor.hi``, e.g. a server configured below the default)."""
    lo, hi = tensor.lo, tensor.hi if hi is None else hi
    below = lo is not None and (v <= lo if tensor.lo_open else v < lo)
    if below or (hi is not None and v > hi):
        rng = (
            f"{'(' if tensor.lo_open else '['}{lo}, {hi}]"
            if hi is not None
            else f"{'>' if tensor.lo_open else '>='} {lo}"
        )
        raise WireError(f"{tensor.name} must be {'in ' if hi is not None else ''}{rng}, got {v}")


def get_vector(arrays: Arrays, tensor: TensorWire, ndim: int = 1) -> np.ndarray:
    """Input ``tensor`` as an array of its numpy dtype with ``ndim`` dimensions.

    Raises :class:`WireError` naming the field when it is missing or has another rank."""
    a = arrays.get(tensor.name)
    if a is None:
        raise WireError(f"{tensor.name} is required for this op")
    a = np.asarray(a)
    if a.ndim != ndim:
        raise WireError(f"{tensor.name} must be {ndim}-D, got shape {list(a.shape)}")
    return a.astype(NUMPY[tensor.dtype], copy=False)


def sids_to_wire(sids: list[int]) -> np.ndarray:
    """Sequence ids in ``[0, 2**64)`` -> ``SIDS [S]`` int64 with the same bits. Raises
    ``ValueError`` outside that range."""
    return np.array(sids, dtype=np.uint64).view(np.int64)


def sids_from_wire(a: np.ndarray) -> list[int]:
    """``SIDS [S]`` int64 -> the uint64 sequence ids (inverse of :func:`sids_to_wire`)."""
    return np.asarray(a, dtype=np.int64).view(np.uint64).tolist()


def split_rows(a, lengths) -> list:
    """Split the leading axis of ``a`` (array or tensor) into consecutive pieces of ``lengths`` rows (views)."""
    offs = np.cumsum([0] + [int(n) for n in lengths])
    return [a[offs[i] : offs[i + 1]] for i in range(len(offs) - 1)]


def check_tokens(name: str, toks: np.ndarray, vocab: int) -> None:
    """Raise :class:`WireError` unless every id of ``toks`` is in ``[0, vocab)``."""
    if toks.size and (toks.min() < 0 or toks.max() >= vocab):
        bad = int(toks.min()) if toks.min() < 0 else int(toks.max())
        raise WireError(f"{name}: token ids must be in [0, {vocab}), got {bad}")


def describe(wire: ModelWire) -> str:
    """A Markdown table of a model's tensors: name, direction, dtype, dims, optional, default, range, meaning."""
    rows = [
        f"`{wire.name}`"
        + (" (decoupled; a request is a turn of the sequence its sequence id names)" if wire.decoupled else "")
        + (f"; OP: {' | '.join(wire.ops)}" if wire.ops else ""),
        "",
        "| tensor | in/out | dtype | dims | optional | default | range | meaning |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for io, ts in (("in", wire.inputs), ("out", wire.outputs)):
        for t in ts:
            rng = (
                ""
                if t.lo is None and t.hi is None
                else f"{'' if t.lo is None else t.lo}..{'' if t.hi is None else t.hi}"
            )
            if io == "in" and t.max_items is not None:
                rng += f"{'; ' if rng else ''}at most {t.max_items} elements"
            if io == "in" and t.dtype == "TYPE_STRING":
                rng += f"{'; ' if rng else ''}at most {MAX_STRING_BYTES if t.max_bytes is None else t.max_bytes} bytes each"
            rows.append(
                f"| `{t.name}` | {io} | {t.dtype[5:]} | {list(t.dims)} | {'yes' if t.optional else ''} | "
                f"{'' if t.default in (None, ()) else t.default} | {rng} | {t.doc} |"
            )
    return "\n".join(rows)
