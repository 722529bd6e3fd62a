"""The wire: every Triton model's tensors (name, dtype, dims, optional, default, limits), the serving
defaults and limits, and the array helpers both sides of a BLS call use. Written once here; the
``config.pbtxt`` files are checked against it (``tests/test_schema.py``) and the engine, the
serving layer, the client, the load test and the tests read names and defaults from it.

numpy only (no torch, no Triton): the client imports it. Sequence ids are Triton correlation ids (uint64);
between tandem's own models they travel as int64 with the same 64 bits (:func:`sids_to_wire`)."""

from __future__ import annotations

import dataclasses
import re
import signal
from typing import Any

import numpy as np

# re-exported: the engine, serving layer, client and tests reach the wire's types and helpers here
from .wire import (
    NUMPY as NUMPY,
    Arrays as Arrays,
    ModelWire as ModelWire,
    TensorWire as TensorWire,
    WireError as WireError,
    check_range as check_range,
    check_size as check_size,
    check_tokens as check_tokens,
    describe as describe,
    get_scalar as get_scalar,
    get_string as get_string,
    get_strings as get_strings,
    get_vector as get_vector,
    sids_from_wire as sids_from_wire,
    sids_to_wire as sids_to_wire,
    split_rows as split_rows,
    string_array as string_array,
)

#: Tokens per prefix-cache block: prompts are published and reused in whole blocks, and with the
#: prefix cache on every prime and DFlash ingest is computed in pieces ending at multiples of it (a
#: multiple of the KDA chunk, 16, and of ``index_kpool``), so warm and cold starts are bit-identical.
PREFIX_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Serving defaults and limits (each written once; config.pbtxt ``parameters`` carry the same values, checked by a
    test). ``num_draft_tokens``: drafts per verify round (MTP) when a request does not say; ``max_num_draft_tokens``:
    the most a request may ask for; ``block_size``: the DFlash block (anchor + drafts; the DFlash specs draft
    ``block_size - 1`` tokens unless a request asks for fewer); ``burst_rounds``: verify rounds per streamed response
    at most; ``burst_ms``: a burst also ends at the first round boundary after this many ms of rounds (0: by rounds
    only); ``max_ctx``: tokens per session (prompt + generated, all turns), also the ``MAX_TOKENS`` limit;
    ``idle_timeout_s``: a session with no turn running for longer (counted from the end of its last turn) is closed;
    ``max_sessions``: open sessions at most (a new sequence beyond it waits up to ``admission_wait_s`` for one to
    close, then gets a "no free session" error); ``stage_timeout_s``: a stage call (BLS) that has not answered by then
    fails the turns waiting on it; ``prefill_budget``: prompt rows primed per burst at most, shared by every prompt
    waiting, shortest first (vLLM's ``max_num_batched_tokens`` for prefill; :mod:`tandem.engine.prefill`), so streams
    keep getting bursts and short prompts are not held behind long ones; a prompt beyond it is primed in pieces (cut
    anywhere under CPU ``batch_invariant``, where rows are bit-identical for any pieces; otherwise, with the prefix
    cache on, at multiples of ``PREFIX_BLOCK``); 0: every prompt whole at its admission; ``spec``: the default spec (the fastest measured; without its drafter:
    ``mtp``, then ``off``); ``checkpoint``: weights folder relative to the model repository; ``dtype``: compute dtype
    of the stage models (:data:`DTYPES`; ``auto``: fp32 on the CPU with bf16 GEMM inputs, both measured faster, bf16
    on CUDA; ``fp32``: fp32 GEMM inputs too); ``device``: where the stage models hold their weights and run (``auto``:
    ``cuda`` when torch sees a GPU, else ``cpu``; or ``cpu``, ``cuda``, ``cuda:N``; resolved, and refused when absent,
    at load by :func:`tandem.model.device.resolve_device`); ``prefix_cache_mb``: memory bound of the prefix cache
    (published prompt blocks: trunk state and DFlash drafter tails), 0 turns it off; ``max_state_mb``: memory bound
    of the sessions' state plus the prefix cache's bound (:mod:`tandem.engine.state_size` estimates a session at its
    turn's largest context: trunk MLA rows and KDA state, drafter KV, the prompt rows its drafter has not read); a
    turn that does not fit waits like one beyond ``max_sessions``, then is refused; 0: no bound. The default, 4096,
    holds the default 256 sessions at about 1,500 tokens of context each on the shipped checkpoint (~11 MB a session)
    next to the 256 MB prefix cache, and stays under half of a 16 GB machine's memory with the processes' own ~3 GB;
    ``dflash_checkpoint`` /
    ``dflash2_checkpoint``: a drafter folder of its own (``config.json`` + ``model.safetensors``, relative to the
    model repository) instead of ``<checkpoint>/dflash[2]``; ``kernels``: which implementation the stage models take
    (:data:`KERNEL_MODES`; :mod:`tandem.ops.dispatch`): ``auto`` the Triton kernels on CUDA and torch / numba on
    the CPU, ``triton`` the Triton kernels everywhere, ``torch`` the reference; ``batch_invariant``: a row's logits
    bit-identical alone (plain decoding), in a verify block or in a batch of sessions: on the CPU the trunk's verify
    passes take the row-invariant GEMM (:mod:`tandem.ops.cpu.gemm`), faster here than MKL, so on by default; off,
    they take MKL, whose rounding depends on the rows; ``colocate``: the drafters run in the engine core's process, the ``tandem`` model's, beside the trunk (sharing
    its embedding and LM head, as in-process), so a round crosses no process; off, they run in the ``drafter_mtp`` /
    ``drafter_dflash`` models (loaded only then) and a round makes a BLS call to each drafter it uses;
    ``decode_threads``: a round's compiled passes (plain steps, verify) and a prime of several sequences in up to
    this many groups side by side; ``split_threads``: a call with one group (one session's verify or draft, a
    prime of one prompt) splits its large GEMMs' columns and its MoE's experts across this many threads (1: never;
    above 1 pays where cores stay idle beside the server and its clients, see docs/cpu-kernels.md);
    ``compute_nice`` (-20..19, 0: leave them): the nice value of the engine core's thread and its decode threads, so
    the server's other threads and its clients do not time-slice them (below 0 it needs CAP_SYS_NICE; refused:
    logged, the threads left as they are); ``amx`` (stage models): bfloat16 GEMMs on Intel AMX tiles where the CPU has them (:mod:`tandem.ops.cpu.amx`).

    ``adaptive_draft``: each round's drafts per session chosen for the batch's expected tokens a second from the
    sessions' measured acceptance and this machine's measured round costs, down to none (a plain row), the
    request's ``num_draft_tokens`` (or the DFlash block) the most; off, every speculating session drafts that many
    every round; ``probe_rounds``: a session drafting none drafts its most again after this many rounds (the
    interval doubling after each probe that does not bring it back); both explained in
    :mod:`tandem.engine.draft_length`.

    ``compiled_spec_rounds``: while the active sessions that draft use one DFlash spec and
    the others decode plain (all greedy, no stop strings, no structured output), a burst's speculative rounds
    (draft, verify, accept walk, commit) run in one compiled call on the CPU (:mod:`tandem.engine.compiled_rounds`),
    bit-identical to the rounds one call at a time; off, each round is a drafter call and a verify call.

    ``tensor_parallel``: the trunk split over this many ranks (:mod:`tandem.model.parallel`: attention heads, MLPs
    and vocabulary by tensor parallelism, routed experts by expert parallelism), rank 0 in the ``tandem`` model's
    process and the others started by it (:mod:`tandem.engine.ranks`); above 1 the stages run without the compiled
    CPU kernels (single-rank: the torch path on the CPU, the Triton kernels but the DSA indexer's on CUDA), the MTP
    spec is not served and ``colocate`` must be on.

    ``fp8_weights`` (:data:`FP8_MODES`): an FP8 checkpoint's block-scaled weights dequantized to bfloat16 values at
    load (``dequantize``), or held in FP8 (``keep``: a byte a weight plus its scales; block-scaled FP8 GEMMs on CUDA, the torch
    path dequantizing per call on the CPU); ``auto``: keep on CUDA, dequantize on the CPU
    (:func:`tandem.model.checkpoint.load_trunk`)."""

    num_draft_tokens: int = 3
    max_num_draft_tokens: int = 8
    spec: str = "off"
    burst_rounds: int = 32
    burst_ms: float = 25.0
    block_size: int = 8
    checkpoint: str = "weights/tandem-tiny"
    dflash_checkpoint: str = ""
    dflash2_checkpoint: str = ""
    max_ctx: int = 4096
    idle_timeout_s: float = 600.0
    max_sessions: int = 256
    prefill_budget: int = 32
    admission_wait_s: float = 5.0
    stage_timeout_s: float = 30.0
    dtype: str = "auto"
    device: str = "auto"
    prefix_cache_mb: int = 256
    max_state_mb: int = 4096
    batch_invariant: bool = True
    colocate: bool = True
    decode_threads: int = 2
    split_threads: int = 1
    compute_nice: int = -10
    amx: bool = True
    kernels: str = "auto"
    adaptive_draft: bool = True
    probe_rounds: int = 16
    compiled_spec_rounds: bool = True
    tensor_parallel: int = 1
    fp8_weights: str = "auto"

    def __post_init__(self) -> None:
        if not 2 <= self.block_size <= self.max_num_draft_tokens + 1:
            raise ValueError(f"block_size must be in [2, {self.max_num_draft_tokens + 1}], got {self.block_size}")
        if not 1 <= self.num_draft_tokens <= self.max_num_draft_tokens:
            raise ValueError(
                f"num_draft_tokens must be in [1, {self.max_num_draft_tokens}], got {self.num_draft_tokens}"
            )
        if self.spec not in SPECS:
            raise ValueError(f"spec must be one of {SPECS}, got {self.spec!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not re.fullmatch(DEVICE_PATTERN, self.device):
            raise ValueError(f"device must be one of {DEVICES} (N a GPU index), got {self.device!r}")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {self.kernels!r}")
        if self.fp8_weights not in FP8_MODES:
            raise ValueError(f"fp8_weights must be one of {FP8_MODES}, got {self.fp8_weights!r}")
        if self.tensor_parallel > 1 and not self.colocate:
            raise ValueError(
                f"tensor_parallel {self.tensor_parallel} runs the drafters beside the trunk on every rank: set colocate true"
            )
        if self.tensor_parallel > 1 and self.spec == MTP:
            raise ValueError(
                f"spec 'mtp' is not served with tensor_parallel {self.tensor_parallel} (the MTP layer is not split): "
                "use off, dflash or dflash2"
            )
        for name in (
            "burst_rounds",
            "max_ctx",
            "max_sessions",
            "decode_threads",
            "split_threads",
            "probe_rounds",
            "tensor_parallel",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "stage_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not -20 <= self.compute_nice <= 19:
            raise ValueError(f"compute_nice must be in [-20, 19], got {self.compute_nice}")
        if self.prefill_budget < 0:
            raise ValueError(f"prefill_budget must be 0 (off) or a positive number of rows, got {self.prefill_budget}")
        if self.max_state_mb and self.max_state_mb <= self.prefix_cache_mb:
            raise ValueError(
                f"max_state_mb ({self.max_state_mb}) must exceed prefix_cache_mb "
                f"({self.prefix_cache_mb}), which it includes (0: no limit)"
            )
        for name in (
            "prefix_cache_mb",
            "max_state_mb",
            "burst_ms",
            "admission_wait_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_parameters(cls, params: dict[str, str], **overrides) -> "ServingConfig":
        """From a model's config.pbtxt ``parameters`` (strings), then ``overrides``. Raises ``ValueError`` naming an
        unknown parameter or a value that does not parse."""
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


MTP, DFLASH, DFLASH2, OFF = "mtp", "dflash", "dflash2", "off"  # specs: native MTP, DFlash, DFlash2, plain
SPECS = (MTP, DFLASH, DFLASH2, OFF)
DFLASH_SPECS = (DFLASH, DFLASH2)  # the specs served by the ``drafter_dflash`` model
DTYPES = ("auto", "bf16", "fp32")  # auto: fp32 on the CPU, bf16 on CUDA
DEVICES = ("auto", "cpu", "cuda", "cuda:N")  # ServingConfig.device / $TANDEM_DEVICE
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"
KERNEL_MODES = ("auto", "triton", "torch")  # ServingConfig.kernels / $TANDEM_KERNELS
FP8_MODES = ("auto", "keep", "dequantize")  # ServingConfig.fp8_weights
DEFAULTS = ServingConfig()


def env_name(parameter: str) -> str:
    """The environment variable that overrides a model parameter: ``TANDEM_`` + its name in capitals."""
    return "TANDEM_" + parameter.upper()


#: the signal on which a stage process writes every thread's Python stack to the server log
STACK_DUMP_SIGNAL = signal.SIGUSR1
FINISH_REASONS = (
    "stop",
    "length",
    "context",
    CANCELLED := "cancelled",
)  # cancelled: by its client (it left, or a CANCEL)

# -- the tandem model ----------------------------------------------------------------------------------------
INPUT_IDS, MAX_TOKENS, SPEC, NUM_DRAFT_TOKENS = "INPUT_IDS", "MAX_TOKENS", "SPEC", "NUM_DRAFT_TOKENS"
STOP_TOKEN_IDS = "STOP_TOKEN_IDS"
MAX_STOP_TOKEN_IDS = 16  # stop token ids a turn may add to the template's
STOP, STREAM, CANCEL, SESSION_ID = "STOP", "STREAM", "CANCEL", "SESSION_ID"
#: a turn's number (``TURN``, in each of its responses) and the one a ``CANCEL`` request names (``CANCEL_TURN``)
TURN, CANCEL_TURN = "TURN", "CANCEL_TURN"
MAX_STOPS, MAX_STOP_CHARS = 8, 64  # stop strings per turn, and characters per stop string, at most
#: the prefix-cache namespace of a sequence (:mod:`tandem.engine.prefix`), at most this many UTF-8 bytes
CACHE_SALT, MAX_CACHE_SALT_BYTES = "CACHE_SALT", 256
#: structured output (:mod:`tandem.engine.structured`): a JSON object shaped as OpenAI's ``response_format``,
#: at most this many UTF-8 bytes; its ``type`` one of :data:`RESPONSE_FORMAT_TYPES` (``text``: unconstrained;
#: ``regex`` and ``grammar``, an EBNF grammar, are tandem's, as vLLM's ``structured_outputs`` and SGLang's
#: ``regex`` / ``ebnf``)
RESPONSE_FORMAT, MAX_RESPONSE_FORMAT_BYTES = "RESPONSE_FORMAT", 1 << 16
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar")
#: ``PRECEDING_IDS``: the turn's tokens sent before a response's, at most this many (a detokenizer's
#: context: a UTF-8 character spans at most 4 byte-level tokens)
DETOKENIZE_WINDOW = 6
#: a turn's sequence fields, as tritonclient's ``(async_stream_)infer`` names them; Triton passes them as the
#: request's correlation id and flags (``tandem`` has no sequence batcher: the worker owns every session)
SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END = "sequence_id", "sequence_start", "sequence_end"
FLAG_START, FLAG_END = 1, 2  # TRITONSERVER_RequestFlag bits of a request's ``flags()``
#: sequence ids from here up are tandem's one-turn sessions (a request with no sequence id, as Triton's
#: HTTP generate endpoint sends); a client's own ids must be below
ONE_TURN_SEQUENCE_IDS = 1 << 63
#: gRPC metadata (an HTTP/2 request header) on every turn's stream, ``x-tandem-session: <sequence id>``:
#: the key a proxy routes a session by (tritonclient carries the sequence id inside the protobuf body,
#: which no proxy reads on a stream)
ROUTING_HEADER = "x-tandem-session"
#: fixed markers ending an error message, for clients to type it: this server holds no such session
#: (unknown sequence id, or the server is shutting down): re-prime under a new sequence id; no free
#: session slot: retry the first turn under a new sequence id (a proxy routes it by load)
SESSION_LOST_MARKER, AT_CAPACITY_MARKER = "[tandem: session lost]", "[tandem: at capacity]"


def sequence_name(sid: int) -> str:
    """How an error names a sequence: ``"sequence 7"``, or ``"this request (it has no sequence id)"`` for a one-turn session."""
    return "this request (it has no sequence id)" if sid >= ONE_TURN_SEQUENCE_IDS else f"sequence {sid}"


OUTPUT_IDS, ROUNDS, DRAFTED, ACCEPTED, FINISH_REASON = "OUTPUT_IDS", "ROUNDS", "DRAFTED", "ACCEPTED", "FINISH_REASON"
PRECEDING_IDS, STOP_STRING = "PRECEDING_IDS", "STOP_STRING"
#: the turn's usage so far, in every response (the final one: the turn's usage)
PROMPT_TOKENS, COMPLETION_TOKENS, TOTAL_ROUNDS, MEAN_ACCEPTANCE_LENGTH = (
    "PROMPT_TOKENS",
    "COMPLETION_TOKENS",
    "TOTAL_ROUNDS",
    "MEAN_ACCEPTANCE_LENGTH",
)
TEMPERATURE, TOP_K, TOP_P, SEED, SAMPLING = "TEMPERATURE", "TOP_K", "TOP_P", "SEED", "SAMPLING"
#: speculative sampling modes: ``rejection`` (lossless rejection sampling, Leviathan et al. 2023) and
#: ``coupled`` (Gumbel-max over session-owned noise: token-identical to plain sampling, demote-eligible)
REJECTION, COUPLED = "rejection", "coupled"
SAMPLING_MODES = (REJECTION, COUPLED)
#: the per-turn sampling inputs of ``tandem``
#: (``SAMPLING`` there as INT32: the mode's index in :data:`SAMPLING_MODES`)
SAMPLING_INPUTS = (
    TensorWire(
        TEMPERATURE,
        "TYPE_FP32",
        (1,),
        optional=True,
        default=0.0,
        lo=0.0,
        hi=10.0,
        doc="softmax temperature; 0 = greedy",
    ),
    TensorWire(
        TOP_K,
        "TYPE_INT32",
        (1,),
        optional=True,
        default=0,
        lo=0,
        hi=1 << 20,
        doc="keep the k most likely tokens; 0 = all",
    ),
    TensorWire(
        TOP_P,
        "TYPE_FP32",
        (1,),
        optional=True,
        default=1.0,
        lo=0.0,
        hi=1.0,
        lo_open=True,
        doc="keep the smallest set of tokens with this probability mass; 1 = all",
    ),
    TensorWire(
        SEED,
        "TYPE_INT64",
        (1,),
        optional=True,
        lo=0,
        doc="Philox key of the turn's noise (absent: a fresh random seed)",
    ),
    TensorWire(SAMPLING, "TYPE_STRING", (1,), optional=True, default=REJECTION, doc=" | ".join(SAMPLING_MODES)),
)

TANDEM = ModelWire(
    name="tandem",
    inputs=(
        TensorWire(
            INPUT_IDS,
            "TYPE_INT32",
            (-1,),
            optional=True,
            default=(),
            max_items=DEFAULTS.max_ctx,
            doc="new tokens of this turn (at most max_ctx)",
        ),
        TensorWire(MAX_TOKENS, "TYPE_INT32", (1,), lo=1, hi=DEFAULTS.max_ctx, doc="tokens to generate at most"),
        TensorWire(
            SPEC,
            "TYPE_STRING",
            (1,),
            optional=True,
            doc=" | ".join(SPECS) + f" (default {DEFAULTS.spec}; later turns keep the sequence's spec)",
        ),
        TensorWire(
            NUM_DRAFT_TOKENS,
            "TYPE_INT32",
            (1,),
            optional=True,
            default=DEFAULTS.num_draft_tokens,
            lo=1,
            hi=DEFAULTS.max_num_draft_tokens,
            doc="drafts per verify round",
        ),
        *SAMPLING_INPUTS,
        TensorWire(
            STOP_TOKEN_IDS,
            "TYPE_INT32",
            (-1,),
            optional=True,
            default=(),
            max_items=MAX_STOP_TOKEN_IDS,
            doc=f"token ids that also end this turn (emitted, nothing after them; at most {MAX_STOP_TOKEN_IDS})",
        ),
        TensorWire(
            STOP,
            "TYPE_STRING",
            (-1,),
            optional=True,
            default=(),
            max_items=MAX_STOPS,
            max_bytes=4 * MAX_STOP_CHARS,
            doc=f"stop strings (at most {MAX_STOPS} of 1-{MAX_STOP_CHARS} characters): the ids run through the "
            "token completing one, the text ends before it",
        ),
        TensorWire(
            STREAM,
            "TYPE_BOOL",
            (1,),
            optional=True,
            default=True,
            doc="true: one response per burst; false: one response with the whole turn",
        ),
        TensorWire(
            CANCEL,
            "TYPE_BOOL",
            (1,),
            optional=True,
            default=False,
            doc="true: cancel the running turn of the session SESSION_ID names (the request's sequence id); "
            "answered at once with an empty final response (postprocessing sends it for a client that left)",
        ),
        TensorWire(
            CANCEL_TURN,
            "TYPE_INT64",
            (1,),
            optional=True,
            lo=1,
            doc="with CANCEL: only the turn of this number (its responses' TURN) is cancelled; absent: the "
            "session's running turn",
        ),
        TensorWire(
            CACHE_SALT,
            "TYPE_STRING",
            (1,),
            optional=True,
            default="",
            max_bytes=MAX_CACHE_SALT_BYTES,
            doc=f"prefix-cache namespace (at most {MAX_CACHE_SALT_BYTES} UTF-8 bytes): only sequences primed "
            "with the same salt share cached prompt blocks; '' (default) = the shared namespace",
        ),
        TensorWire(
            RESPONSE_FORMAT,
            "TYPE_STRING",
            (1,),
            optional=True,
            default="",
            max_bytes=MAX_RESPONSE_FORMAT_BYTES,
            doc="structured output: a JSON object as OpenAI's response_format, type "
            + " | ".join(RESPONSE_FORMAT_TYPES)
            + ' (e.g. {"type": "json_schema", "json_schema": {"schema": {...}}}, {"type": "regex", "regex": "..."}, '
            '{"type": "grammar", "grammar": "<EBNF>"}); every generated token keeps the text a prefix of the '
            f"format; '' (default) = none; at most {MAX_RESPONSE_FORMAT_BYTES} bytes",
        ),
    ),
    outputs=(
        TensorWire(OUTPUT_IDS, "TYPE_INT32", (-1,), doc="tokens of this burst"),
        TensorWire(
            PRECEDING_IDS,
            "TYPE_INT32",
            (-1,),
            doc=f"the turn's last tokens before OUTPUT_IDS (at most {DETOKENIZE_WINDOW}: a detokenizer's context)",
        ),
        TensorWire(ROUNDS, "TYPE_INT32", (1,), doc="verify rounds in this burst"),
        TensorWire(DRAFTED, "TYPE_INT32", (1,), doc="draft tokens proposed in this burst"),
        TensorWire(ACCEPTED, "TYPE_INT32", (1,), doc="draft tokens accepted in this burst"),
        TensorWire(FINISH_REASON, "TYPE_STRING", (1,), doc="'' while streaming; " + " | ".join(FINISH_REASONS)),
        TensorWire(
            STOP_STRING,
            "TYPE_STRING",
            (1,),
            doc="the stop string that ended the turn ('' otherwise): its text ends where this string starts",
        ),
        TensorWire(
            SESSION_ID,
            "TYPE_INT64",
            (1,),
            doc="the session's id (the sequence id, or a one-turn session's own; "
            "uint64 bits): what a CANCEL request names",
        ),
        TensorWire(
            TURN,
            "TYPE_INT64",
            (1,),
            doc="the turn's number (1, 2, ... over the server's life): what a CANCEL "
            "request names in CANCEL_TURN, so a cancel never reaches a later turn of the session",
        ),
        TensorWire(PROMPT_TOKENS, "TYPE_INT32", (1,), doc="the turn's context: earlier turns + this prompt (usage)"),
        TensorWire(COMPLETION_TOKENS, "TYPE_INT32", (1,), doc="tokens this turn has generated so far (usage)"),
        TensorWire(TOTAL_ROUNDS, "TYPE_INT32", (1,), doc="verify rounds of this turn so far (usage)"),
        TensorWire(
            MEAN_ACCEPTANCE_LENGTH,
            "TYPE_FP32",
            (1,),
            doc="this turn's tau so far: 1 + accepted / rounds (0 before any round; usage)",
        ),
    ),
    parameters=(
        "checkpoint",
        "dflash_checkpoint",
        "dflash2_checkpoint",
        "spec",
        "num_draft_tokens",
        "max_num_draft_tokens",
        "block_size",
        "burst_rounds",
        "burst_ms",
        "max_ctx",
        "idle_timeout_s",
        "max_sessions",
        "prefill_budget",
        "admission_wait_s",
        "stage_timeout_s",
        "prefix_cache_mb",
        "max_state_mb",
        "adaptive_draft",
        "probe_rounds",
        "compiled_spec_rounds",
        "colocate",
        "dtype",
        "device",
        "kernels",
        "fp8_weights",
        "batch_invariant",
        "decode_threads",
        "split_threads",
        "compute_nice",
        "amx",
        "tensor_parallel",
    ),
    decoupled=True,
)

# -- stage models (called by tandem over BLS; one batched op over many sequences per call) ---------------------
_OP, _SIDS = (
    TensorWire("OP", "TYPE_STRING", (1,)),
    TensorWire("SIDS", "TYPE_INT64", (-1,), doc="sequence ids (uint64 correlation ids, same bits)"),
)
#: every stage request carries the server's internal key (:mod:`tandem.internal_key`); one without it is
#: refused before it touches state: the stage models answer only tandem's own models
_AUTH = TensorWire(
    "AUTH", "TYPE_STRING", (1,), optional=True, doc="the server's internal key (tandem's own calls only)"
)
_LENGTHS = TensorWire("LENGTHS", "TYPE_INT32", (-1,), optional=True, lo=1, doc="rows per sequence")
_PREFIX_KEYS = TensorWire(
    "PREFIX_KEYS",
    "TYPE_INT64",
    (-1,),
    optional=True,
    doc="prefix-cache block keys (hash chain), concatenated over sequences",
)
_PREFIX_LENGTHS = TensorWire(
    "PREFIX_LENGTHS",
    "TYPE_INT32",
    (-1,),
    optional=True,
    lo=-1,
    doc="keys per sequence; prime: -1 = no prefix cache for that sequence",
)
_NBYTES = TensorWire("NBYTES", "TYPE_INT64", (-1,), doc="publish: bytes newly stored per sequence")
_NUM_DRAFTS = TensorWire(
    NUM_DRAFT_TOKENS,
    "TYPE_INT32",
    (-1,),
    optional=True,
    lo=0,
    hi=DEFAULTS.max_num_draft_tokens,
    doc="drafts per sequence",
)
_DRAFTS, _DRAFT_LENGTHS = (
    TensorWire("DRAFTS", "TYPE_INT64", (-1,), doc="drafted tokens of every sequence, concatenated"),
    TensorWire("DRAFT_LENGTHS", "TYPE_INT32", (-1,), doc="drafts per sequence"),
)
DRAFTER_MTP = ModelWire(
    name="drafter_mtp",
    inputs=(
        _OP,
        _SIDS,
        _AUTH,
        TensorWire("HIDDEN", "TYPE_FP32", (-1, -1), optional=True, doc="[rows, hidden_size] trunk hidden to ingest"),
        TensorWire("NEXT_TOKENS", "TYPE_INT64", (-1,), optional=True, doc="token after each ingested row"),
        _LENGTHS,
        _NUM_DRAFTS,
    ),
    outputs=(_DRAFTS, _DRAFT_LENGTHS),
    parameters=("checkpoint", "dtype", "device", "kernels", "fp8_weights", "amx", "max_num_draft_tokens"),
    ops=("open", "close", "draft"),
)

DRAFTER_DFLASH = ModelWire(
    name="drafter_dflash",
    inputs=(
        _OP,
        _SIDS,
        _AUTH,
        TensorWire("FEATURES", "TYPE_FP32", (-1, -1), optional=True, doc="[rows, n_target * hidden_size] to ingest"),
        _LENGTHS,
        TensorWire("ANCHORS", "TYPE_INT64", (-1,), optional=True, doc="the anchor token per sequence"),
        dataclasses.replace(_NUM_DRAFTS, doc="drafts per sequence (block size - 1 at most)"),
        TensorWire(SPEC, "TYPE_STRING", (-1,), optional=True, doc="spec per sequence: " + " | ".join(DFLASH_SPECS)),
        _PREFIX_KEYS,
        _PREFIX_LENGTHS,
    ),
    outputs=(_DRAFTS, _DRAFT_LENGTHS, _NBYTES),
    parameters=(
        "checkpoint",
        "dflash_checkpoint",
        "dflash2_checkpoint",
        "dtype",
        "device",
        "kernels",
        "fp8_weights",
        "amx",
        "max_num_draft_tokens",
    ),
    ops=("open", "close", "draft", "publish", "evict"),
)

MODELS = {m.name: m for m in (DRAFTER_MTP, DRAFTER_DFLASH, TANDEM)}


# -- array helpers of the stage models ------------------------------------------------------------------
def lengths_of(arrays: Arrays, n_sids: int, total: int, of: str) -> list[int]:
    """``LENGTHS`` checked against ``n_sids`` entries summing to ``total`` rows of input ``of``. Raises :class:`WireError`."""
    lengths = [int(x) for x in get_vector(arrays, _LENGTHS)]
    if len(lengths) != n_sids:
        raise WireError(f"LENGTHS has {len(lengths)} entries for {n_sids} SIDS")
    if any(n < 1 for n in lengths):
        raise WireError(f"LENGTHS entries must be >= 1, got {min(lengths)}")
    if sum(lengths) != total:
        raise WireError(f"LENGTHS sum to {sum(lengths)} but {of} has {total} rows")
    return lengths


def prefixes_to_wire(prefixes: list[list[int] | None]) -> Arrays:
    """Per-sequence prefix keys (None: no prefix cache) -> ``PREFIX_KEYS [sum n]`` int64, ``PREFIX_LENGTHS [S]`` int32 (-1: None)."""
    return {
        _PREFIX_KEYS.name: np.array([k for p in prefixes if p for k in p], dtype=np.int64),
        _PREFIX_LENGTHS.name: np.array([-1 if p is None else len(p) for p in prefixes], dtype=np.int32),
    }


def prefixes_from_wire(arrays: Arrays, n_sids: int) -> list[list[int] | None]:
    """Inverse of :func:`prefixes_to_wire`; all None when ``PREFIX_LENGTHS`` is absent. Raises
    :class:`WireError` when the counts disagree with ``SIDS`` or ``PREFIX_KEYS``."""
    if _PREFIX_LENGTHS.name not in arrays:
        return [None] * n_sids
    lens = [int(x) for x in get_vector(arrays, _PREFIX_LENGTHS)]
    keys = get_vector(arrays, _PREFIX_KEYS) if _PREFIX_KEYS.name in arrays else np.zeros(0, np.int64)
    if len(lens) != n_sids or any(n < -1 for n in lens) or sum(max(0, n) for n in lens) != keys.size:
        raise WireError(
            f"PREFIX_LENGTHS {lens} must hold one entry >= -1 per SIDS ({n_sids}) summing (over entries "
            f">= 0) to the {keys.size} PREFIX_KEYS"
        )
    offs = np.cumsum([0] + [max(0, n) for n in lens])
    return [None if n < 0 else keys[offs[i] : offs[i + 1]].tolist() for i, n in enumerate(lens)]


def get_op(arrays: Arrays, wire: ModelWire) -> str:
    """The ``OP`` of a stage request, checked against ``wire.ops``. Raises :class:`WireError`."""
    op = get_string(arrays, _OP)
    if op not in wire.ops:
        raise WireError(f"OP must be one of {wire.ops}, got {op!r}")
    return op


def get_sids(arrays: Arrays) -> list[int]:
    """``SIDS`` as uint64 sequence ids, each at most once. Raises :class:`WireError`."""
    sids = sids_from_wire(get_vector(arrays, _SIDS))
    if len(set(sids)) != len(sids):
        raise WireError("SIDS: a sequence id appears twice in one request")
    return sids


if __name__ == "__main__":
    print("\n\n".join(describe(m) for m in MODELS.values()) + f"\n\nServing defaults: {DEFAULTS}")
