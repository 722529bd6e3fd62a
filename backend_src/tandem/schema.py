"""The wire: every Triton model's tensors (name, dtype, dims, optional, default, limits), the serving
defaults and limits, and the array helpers both sides of a BLS call use. Written once here; the
``config.pbtxt`` files are checked against it (``tests/test_schema.py``) and the engine, the
serving layer, the client, the load test and the tests read names and defaults from it.

numpy only (no torch, no Triton): the client imports it. Sequence ids are Triton correlation ids
(uint64); between tandem's own models they travel as int64 with the same 64 bits (:func:`sids_to_wire`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]

#: Triton data type -> numpy dtype (``TYPE_STRING`` tensors are numpy ``object`` arrays of bytes).
NUMPY = {"TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32,
         "TYPE_STRING": np.object_}


class WireError(ValueError):
    """A malformed or impossible request. The message starts with the offending wire field
    (``"SIDS: unknown sequence id 7"``, ``"MAX_TOKENS must be in [1, 4096], got 0"``)."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output: ``name``, Triton ``dtype`` (``"TYPE_INT32"`` ...), ``dims`` (``-1`` =
    variable), ``optional``, ``default`` (value used when an optional input is absent) and an
    inclusive value range ``lo..hi`` (None = unbounded)."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    default: Any = None
    lo: int | None = None
    hi: int | None = None
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A Triton model's interface: ``inputs``, ``outputs``, ``parameters`` (config.pbtxt
    ``parameters`` keys), ``ops`` (values of its ``OP`` input; empty for ``tandem``),
    ``decoupled`` and the sequence batcher's ``controls`` (input name -> control kind)."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameters: tuple[str, ...]
    ops: tuple[str, ...] = ()
    decoupled: bool = False
    controls: tuple[tuple[str, str], ...] = ()

    def input(self, name: str) -> TensorSpec:
        """The input spec called ``name``. Raises ``KeyError``."""
        return {t.name: t for t in self.inputs}[name]

    @property
    def input_names(self) -> tuple[str, ...]:
        """Data inputs and sequence controls, as a model's ``execute`` reads them."""
        return tuple(t.name for t in self.inputs) + tuple(n for n, _ in self.controls)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.outputs)


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Serving defaults and limits (each written once; config.pbtxt ``parameters`` carry the same
    values, checked by a test). ``num_draft_tokens``: drafts per verify round (MTP) when a request
    does not say; ``max_num_draft_tokens``: the most a request may ask for;
    ``block_size``: the DFlash block (anchor + drafts; the DFlash arms draft ``block_size - 1`` tokens
    unless a request asks for fewer); ``burst_rounds``: verify rounds per streamed response;
    ``max_ctx``: tokens per session (prompt + generated, all turns), also the ``MAX_TOKENS`` limit;
    ``idle_timeout_s``: sessions idle longer are closed; ``spec``: the default arm (the fastest measured;
    without its drafter: ``mtp``, then ``off``); ``checkpoint``: weights folder relative to the model
    repository; ``dtype``: compute dtype of the stage models; ``prefix_cache_mb``: memory bound of
    the prefix cache (published prompt blocks: trunk state and DFlash drafter tails), 0 turns it off;
    ``batch_invariant``: pad plain decoding's one-row trunk passes to two rows so a row's logits are
    bit-identical alone or in a verify block (off by default: it costs plain decoding ~16%, measured).
    """

    num_draft_tokens: int = 3
    max_num_draft_tokens: int = 8
    spec: str = "dflash2"
    burst_rounds: int = 4
    block_size: int = 8
    checkpoint: str = "weights/tandem-tiny"
    max_ctx: int = 4096
    idle_timeout_s: float = 600.0
    dtype: str = "fp32"
    prefix_cache_mb: int = 256
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if not 2 <= self.block_size <= self.max_num_draft_tokens + 1:
            raise ValueError(f"block_size must be in [2, {self.max_num_draft_tokens + 1}], got {self.block_size}")
        if not 1 <= self.num_draft_tokens <= self.max_num_draft_tokens:
            raise ValueError(f"num_draft_tokens must be in [1, {self.max_num_draft_tokens}], got {self.num_draft_tokens}")
        if self.spec not in SPECS:
            raise ValueError(f"spec must be one of {SPECS}, got {self.spec!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")
        for name in ("burst_rounds", "max_ctx"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_parameters(cls, params: dict[str, str], **overrides) -> "ServingConfig":
        """From a model's config.pbtxt ``parameters`` (strings), then ``overrides``. Raises
        ``ValueError`` naming an unknown parameter or a value that does not parse."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in params.items():
            if k not in fields:
                raise ValueError(f"unknown model parameter {k!r} (known: {sorted(fields)})")
            typ = type(getattr(cls(), k))
            try:
                kw[k] = {"true": True, "false": False}[v.lower()] if typ is bool else typ(v)
            except (ValueError, KeyError):
                raise ValueError(f"model parameter {k!r} must be {typ.__name__}, got {v!r}") from None
        kw.update(overrides)
        return cls(**kw)


MTP, DFLASH, DFLASH2, OFF = "mtp", "dflash", "dflash2", "off"  # arms: native MTP, DFlash, DFlash2, plain
SPECS = (MTP, DFLASH, DFLASH2, OFF)
#: The arms served by the ``drafter_dflash`` model.
DFLASH_ARMS = (DFLASH, DFLASH2)
DTYPES = ("bf16", "fp32")
DEFAULTS = ServingConfig()
#: Tokens per prefix-cache block: prompts are published and reused in whole blocks, and with the
#: prefix cache on every prime and DFlash ingest is computed in pieces ending at multiples of it (a
#: multiple of the KDA chunk, 16, and of ``index_kpool``), so warm and cold starts are bit-identical.
PREFIX_BLOCK = 64
FINISH_REASONS = ("stop", "length", "context")

# -- the tandem model ----------------------------------------------------------------------------------------
INPUT_IDS = "INPUT_IDS"
MAX_TOKENS = "MAX_TOKENS"
SPEC = "SPEC"
NUM_DRAFT_TOKENS = "NUM_DRAFT_TOKENS"
START, END, CORRID = "START", "END", "CORRID"
OUTPUT_IDS, ROUNDS, DRAFTED, ACCEPTED, FINISH_REASON = "OUTPUT_IDS", "ROUNDS", "DRAFTED", "ACCEPTED", "FINISH_REASON"
#: The sampling input a sampling-capable ``tandem`` model takes (not served yet: the server is greedy).
TEMPERATURE = "TEMPERATURE"

TANDEM = ModelSpec(
    name="tandem",
    inputs=(
        TensorSpec(INPUT_IDS, "TYPE_INT32", (-1,), optional=True, default=(), doc="new tokens of this turn"),
        TensorSpec(MAX_TOKENS, "TYPE_INT32", (1,), lo=1, hi=DEFAULTS.max_ctx, doc="tokens to generate at most"),
        TensorSpec(SPEC, "TYPE_STRING", (1,), optional=True, doc=" | ".join(SPECS) + f" (default {DEFAULTS.spec}; "
                   "later turns keep the sequence's arm)"),
        TensorSpec(NUM_DRAFT_TOKENS, "TYPE_INT32", (1,), optional=True, default=DEFAULTS.num_draft_tokens,
                   lo=1, hi=DEFAULTS.max_num_draft_tokens, doc="drafts per verify round"),
    ),
    outputs=(
        TensorSpec(OUTPUT_IDS, "TYPE_INT32", (-1,), doc="tokens of this burst"),
        TensorSpec(ROUNDS, "TYPE_INT32", (1,), doc="verify rounds in this burst"),
        TensorSpec(DRAFTED, "TYPE_INT32", (1,), doc="draft tokens proposed in this burst"),
        TensorSpec(ACCEPTED, "TYPE_INT32", (1,), doc="draft tokens accepted in this burst"),
        TensorSpec(FINISH_REASON, "TYPE_STRING", (1,), doc="'' while streaming; " + " | ".join(FINISH_REASONS)),
    ),
    parameters=("checkpoint", "num_draft_tokens", "max_num_draft_tokens", "block_size", "burst_rounds", "max_ctx",
                "prefix_cache_mb"),
    decoupled=True,
    controls=((START, "CONTROL_SEQUENCE_START"), (END, "CONTROL_SEQUENCE_END"), (CORRID, "CONTROL_SEQUENCE_CORRID")),
)

# -- stage models (called by tandem over BLS; one batched op over many sequences per call) ---------------------
_OP = TensorSpec("OP", "TYPE_STRING", (1,))
_SIDS = TensorSpec("SIDS", "TYPE_INT64", (-1,), doc="sequence ids (uint64 correlation ids, same bits)")
_LENGTHS = TensorSpec("LENGTHS", "TYPE_INT32", (-1,), optional=True, lo=1, doc="rows per sequence")
_PREFIX_KEYS = TensorSpec("PREFIX_KEYS", "TYPE_INT64", (-1,), optional=True,
                          doc="prefix-cache block keys (hash chain), concatenated over sequences")
_PREFIX_LENGTHS = TensorSpec("PREFIX_LENGTHS", "TYPE_INT32", (-1,), optional=True, lo=-1,
                             doc="keys per sequence; prime: -1 = no prefix cache for that sequence")
_NBYTES = TensorSpec("NBYTES", "TYPE_INT64", (-1,), doc="publish: bytes newly stored per sequence")

TRUNK = ModelSpec(
    name="trunk",
    inputs=(
        _OP, _SIDS,
        TensorSpec("TOKENS", "TYPE_INT64", (-1,), optional=True, doc="rows of every sequence, concatenated"),
        _LENGTHS,
        TensorSpec("N_ROWS", "TYPE_INT32", (-1,), optional=True, lo=0,
                   doc="rows of the pending verify kept per sequence (commit; prime / verify: first, 0 = none)"),
        _PREFIX_KEYS, _PREFIX_LENGTHS,
    ),
    outputs=(
        TensorSpec("ARGMAX", "TYPE_INT64", (-1,)),
        TensorSpec("HIDDEN", "TYPE_FP32", (-1, -1), doc="[rows, hidden_size]"),
        TensorSpec("TOP2_GAP", "TYPE_FP32", (-1,), doc="top-1 minus top-2 logit"),
        TensorSpec("FEATURES", "TYPE_FP32", (-1, -1), doc="[rows, n_target * hidden_size] DFlash target-layer features"),
        _NBYTES,
    ),
    parameters=("checkpoint", "dtype", "batch_invariant"),
    ops=("open", "close", "prime", "verify", "commit", "publish", "evict"),
)

DRAFTER_MTP = ModelSpec(
    name="drafter_mtp",
    inputs=(
        _OP, _SIDS,
        TensorSpec("HIDDEN", "TYPE_FP32", (-1, -1), optional=True, doc="[rows, hidden_size] trunk hidden to ingest"),
        TensorSpec("NEXT_TOKENS", "TYPE_INT64", (-1,), optional=True, doc="token after each ingested row"),
        _LENGTHS,
        TensorSpec(NUM_DRAFT_TOKENS, "TYPE_INT32", (-1,), optional=True, lo=0, hi=DEFAULTS.max_num_draft_tokens,
                   doc="drafts per sequence"),
    ),
    outputs=(
        TensorSpec("DRAFTS", "TYPE_INT64", (-1,)),
        TensorSpec("DRAFT_LENGTHS", "TYPE_INT32", (-1,)),
    ),
    parameters=("checkpoint", "dtype", "max_num_draft_tokens"),
    ops=("open", "close", "draft"),
)

DRAFTER_DFLASH = ModelSpec(
    name="drafter_dflash",
    inputs=(
        _OP, _SIDS,
        TensorSpec("FEATURES", "TYPE_FP32", (-1, -1), optional=True, doc="[rows, n_target * hidden_size] to ingest"),
        _LENGTHS,
        TensorSpec("ANCHORS", "TYPE_INT64", (-1,), optional=True, doc="the anchor token per sequence"),
        TensorSpec(NUM_DRAFT_TOKENS, "TYPE_INT32", (-1,), optional=True, lo=0, hi=DEFAULTS.max_num_draft_tokens,
                   doc="drafts per sequence (block size - 1 at most)"),
        TensorSpec(SPEC, "TYPE_STRING", (-1,), optional=True, doc="arm per sequence: " + " | ".join(DFLASH_ARMS)),
        _PREFIX_KEYS, _PREFIX_LENGTHS,
    ),
    outputs=(
        TensorSpec("DRAFTS", "TYPE_INT64", (-1,)),
        TensorSpec("DRAFT_LENGTHS", "TYPE_INT32", (-1,)),
        _NBYTES,
    ),
    parameters=("checkpoint", "dtype", "max_num_draft_tokens"),
    ops=("open", "close", "draft", "publish", "evict"),
)

MODELS = {m.name: m for m in (TRUNK, DRAFTER_MTP, DRAFTER_DFLASH, TANDEM)}


# -- array helpers -------------------------------------------------------------------------------------------
def string_array(s: str) -> np.ndarray:
    """A ``[1]`` TYPE_STRING tensor (numpy ``object`` array of ``bytes``)."""
    return np.array([s.encode()], dtype=np.object_)


def _single(arrays: Arrays, spec: TensorSpec, what: str):
    """The one element of input ``spec``, or None when it is absent and optional (Raises
    :class:`WireError` when it is required and absent, or not exactly one element)."""
    a = arrays.get(spec.name)
    if a is None:
        if spec.optional:
            return None
        raise WireError(f"{spec.name} is required" + ("" if what == "string" else " (an INT32 tensor of shape [1])"))
    a = np.asarray(a).reshape(-1)
    if a.size != 1:
        raise WireError(f"{spec.name} must hold exactly 1 {what}, got {a.size}")
    return a[0]


def get_string(arrays: Arrays, spec: TensorSpec) -> str:
    """The single string of input ``spec`` (its default when absent and optional).

    Raises :class:`WireError` naming the field when it is missing or not exactly one element."""
    v = _single(arrays, spec, "string")
    if v is None:
        return spec.default
    return v.decode("utf-8", errors="replace") if isinstance(v, (bytes, np.bytes_)) else str(v)


def get_scalar(arrays: Arrays, spec: TensorSpec) -> int | None:
    """The single integer of input ``spec`` (its default when absent and optional; range checks
    are the caller's, see :func:`check_range`). Raises :class:`WireError` naming the field."""
    v = _single(arrays, spec, "value")
    return spec.default if v is None else int(v)


def check_range(spec: TensorSpec, v: int, hi: int | None = None) -> None:
    """Raise :class:`WireError` ``"NAME must be in [lo, hi], got v"`` when ``v`` is outside the
    spec's range (``hi`` overrides ``spec.hi``, e.g. a server configured below the default)."""
    lo, hi = spec.lo, spec.hi if hi is None else hi
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise WireError(f"{spec.name} must be {'in ' if hi is not None else ''}{rng}, got {v}")


def get_vector(arrays: Arrays, spec: TensorSpec, ndim: int = 1) -> np.ndarray:
    """Input ``spec`` as an array of its numpy dtype with ``ndim`` dimensions.

    Raises :class:`WireError` naming the field when it is missing or has another rank."""
    a = arrays.get(spec.name)
    if a is None:
        raise WireError(f"{spec.name} is required for this op")
    a = np.asarray(a)
    if a.ndim != ndim:
        raise WireError(f"{spec.name} must be {ndim}-D, got shape {list(a.shape)}")
    return a.astype(NUMPY[spec.dtype], copy=False)


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
    return [a[offs[i]: offs[i + 1]] for i in range(len(offs) - 1)]


def lengths_of(arrays: Arrays, n_sids: int, total: int, of: str) -> list[int]:
    """``LENGTHS`` checked against ``n_sids`` entries summing to ``total`` rows of input ``of``.
    Raises :class:`WireError`."""
    lengths = [int(x) for x in get_vector(arrays, _LENGTHS)]
    if len(lengths) != n_sids:
        raise WireError(f"LENGTHS has {len(lengths)} entries for {n_sids} SIDS")
    if any(n < 1 for n in lengths):
        raise WireError(f"LENGTHS entries must be >= 1, got {min(lengths)}")
    if sum(lengths) != total:
        raise WireError(f"LENGTHS sum to {sum(lengths)} but {of} has {total} rows")
    return lengths


def prefixes_to_wire(prefixes: list[list[int] | None]) -> Arrays:
    """Per-sequence prefix keys (None = no prefix cache for that sequence) -> ``PREFIX_KEYS`` [sum n]
    int64 and ``PREFIX_LENGTHS [S]`` int32 (-1 for None)."""
    return {_PREFIX_KEYS.name: np.array([k for p in prefixes if p for k in p], dtype=np.int64),
            _PREFIX_LENGTHS.name: np.array([-1 if p is None else len(p) for p in prefixes], dtype=np.int32)}


def prefixes_from_wire(arrays: Arrays, n_sids: int) -> list[list[int] | None]:
    """Inverse of :func:`prefixes_to_wire`; all None when ``PREFIX_LENGTHS`` is absent. Raises
    :class:`WireError` when the counts disagree with ``SIDS`` or ``PREFIX_KEYS``."""
    if _PREFIX_LENGTHS.name not in arrays:
        return [None] * n_sids
    lens = [int(x) for x in get_vector(arrays, _PREFIX_LENGTHS)]
    keys = get_vector(arrays, _PREFIX_KEYS) if _PREFIX_KEYS.name in arrays else np.zeros(0, np.int64)
    if len(lens) != n_sids or any(n < -1 for n in lens) or sum(max(0, n) for n in lens) != keys.size:
        raise WireError(f"PREFIX_LENGTHS {lens} must hold one entry >= -1 per SIDS ({n_sids}) summing (over entries "
                        f">= 0) to the {keys.size} PREFIX_KEYS")
    offs = np.cumsum([0] + [max(0, n) for n in lens])
    return [None if n < 0 else keys[offs[i]:offs[i + 1]].tolist() for i, n in enumerate(lens)]


def check_tokens(name: str, toks: np.ndarray, vocab: int) -> None:
    """Raise :class:`WireError` unless every id of ``toks`` is in ``[0, vocab)``."""
    if toks.size and (toks.min() < 0 or toks.max() >= vocab):
        bad = int(toks.min()) if toks.min() < 0 else int(toks.max())
        raise WireError(f"{name}: token ids must be in [0, {vocab}), got {bad}")


def get_op(arrays: Arrays, spec: ModelSpec) -> str:
    """The ``OP`` of a stage request, checked against ``spec.ops``. Raises :class:`WireError`."""
    op = get_string(arrays, _OP)
    if op not in spec.ops:
        raise WireError(f"OP must be one of {spec.ops}, got {op!r}")
    return op


def get_sids(arrays: Arrays) -> list[int]:
    """``SIDS`` as uint64 sequence ids, each at most once. Raises :class:`WireError`."""
    sids = sids_from_wire(get_vector(arrays, _SIDS))
    if len(set(sids)) != len(sids):
        raise WireError("SIDS: a sequence id appears twice in one request")
    return sids


def describe(spec: ModelSpec) -> str:
    """A Markdown table of a model's tensors: name, direction, dtype, dims, optional, default, range, meaning."""
    rows = [f"`{spec.name}`" + (" (decoupled; sequence controls " + ", ".join(n for n, _ in spec.controls) + ")"
                                if spec.decoupled else "") + (f"; OP: {' | '.join(spec.ops)}" if spec.ops else ""), "",
            "| tensor | in/out | dtype | dims | optional | default | range | meaning |", "|---|---|---|---|---|---|---|---|"]
    for io, ts in (("in", spec.inputs), ("out", spec.outputs)):
        for t in ts:
            rng = "" if t.lo is None and t.hi is None else f"{'' if t.lo is None else t.lo}..{'' if t.hi is None else t.hi}"
            rows.append(f"| `{t.name}` | {io} | {t.dtype[5:]} | {list(t.dims)} | {'yes' if t.optional else ''} | "
                        f"{'' if t.default in (None, ()) else t.default} | {rng} | {t.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print("\n\n".join(describe(m) for m in MODELS.values()))
    print("\nServing defaults:", DEFAULTS)
