"""The text front's wire: the ``preprocessing`` and ``postprocessing`` models and the ``ensemble``
that chains ``preprocessing -> tandem -> postprocessing`` (text in, text out), with the conventional
names of Triton's LLM backends (TensorRT-LLM's and vLLM's ``text_input``, ``max_tokens``,
``stream``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``text_output``) and tandem's
own fields (``spec``, ``num_draft_tokens``, ``sampling``, ``cache_salt``, ``response_format``) under the lowercase names of the
``tandem`` tensors they feed. Written once here; the config.pbtxt files are checked against it.

numpy only, like :mod:`tandem.schema`.
"""

from __future__ import annotations

import dataclasses

from . import schema
from .schema import ModelWire, TensorWire

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
MAX_TOKENS_IN, STREAM_IN = "max_tokens", "stream"
#: max_tokens when a text request sends none
DEFAULT_MAX_TOKENS = 128

#: ``tandem`` inputs an ensemble request may send straight through (optional; absent: tandem's default)
DIRECT_INPUTS = (
    schema.TEMPERATURE,
    schema.TOP_P,
    schema.TOP_K,
    schema.SEED,
    schema.STOP,
    schema.SPEC,
    schema.NUM_DRAFT_TOKENS,
    schema.SAMPLING,
    schema.CACHE_SALT,
    schema.RESPONSE_FORMAT,
)
#: ``tandem`` outputs that ``postprocessing`` passes through under their lowercase names
PASSED_THROUGH = (
    schema.FINISH_REASON,
    schema.STOP_STRING,
    schema.ROUNDS,
    schema.DRAFTED,
    schema.ACCEPTED,
    schema.PROMPT_TOKENS,
    schema.COMPLETION_TOKENS,
    schema.TOTAL_ROUNDS,
    schema.MEAN_ACCEPTANCE_LENGTH,
)

#: optional on the wire so that a request without it gets preprocessing's error (Triton answers an ensemble
#: request lacking a required input with no response at all on HTTP generate / generate_stream)
#: bytes of ``text_input`` at most, whatever the context; ``preprocessing`` refuses any text longer than
#: ``max_ctx`` tokens could cover before it tokenizes (:class:`tandem.serving.text.Preprocessor`)
MAX_TEXT_BYTES = 1 << 20
_TEXT_IN = TensorWire(
    TEXT_INPUT,
    "TYPE_STRING",
    (1,),
    optional=True,
    max_bytes=MAX_TEXT_BYTES,
    doc="the user message, required (rendered with the chat template; at most max_ctx x the longest token's bytes)",
)
#: genai-perf's tensorrtllm requests send it; tandem never echoes the prompt, so only true is accepted
EXCLUDE_INPUT = "exclude_input_in_output"
_EXCLUDE = TensorWire(
    EXCLUDE_INPUT,
    "TYPE_BOOL",
    (1,),
    optional=True,
    default=True,
    doc="true (default): the output holds only generated text (false is refused)",
)
_MAX_TOKENS = TensorWire(
    MAX_TOKENS_IN,
    "TYPE_INT32",
    (1,),
    optional=True,
    default=DEFAULT_MAX_TOKENS,
    doc=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})",
)
_STREAM = TensorWire(
    STREAM_IN,
    "TYPE_BOOL",
    (1,),
    optional=True,
    default=False,
    doc="true: a response per burst (generate_stream); false (default): one response",
)

PREPROCESSING = ModelWire(
    name="preprocessing",
    inputs=(_TEXT_IN, _MAX_TOKENS, _STREAM, _EXCLUDE),
    outputs=tuple(
        dataclasses.replace(schema.TANDEM.input(n), optional=False)
        for n in (schema.INPUT_IDS, schema.MAX_TOKENS, schema.STREAM)
    ),
    parameters=("checkpoint",),
)

_TEXT_OUT = TensorWire(TEXT_OUTPUT, "TYPE_STRING", (1,), doc="this response's text (UTF-8, whole characters)")
_PASSED = tuple(
    dataclasses.replace(schema.TANDEM.outputs[schema.TANDEM.output_names.index(n)], name=n.lower())
    for n in PASSED_THROUGH
)

POSTPROCESSING = ModelWire(
    name="postprocessing",
    inputs=tuple(
        schema.TANDEM.outputs[schema.TANDEM.output_names.index(n)]
        for n in (schema.OUTPUT_IDS, schema.PRECEDING_IDS, schema.SESSION_ID, schema.TURN) + PASSED_THROUGH
    ),
    outputs=(_TEXT_OUT, *_PASSED),
    parameters=("checkpoint",),
)

ENSEMBLE = ModelWire(
    name="ensemble",
    inputs=(
        _TEXT_IN,
        _MAX_TOKENS,
        _STREAM,
        _EXCLUDE,
        *(dataclasses.replace(schema.TANDEM.input(n), name=n.lower(), optional=True) for n in DIRECT_INPUTS),
    ),
    outputs=(_TEXT_OUT, *_PASSED),
    parameters=(),
)

MODELS = {m.name: m for m in (PREPROCESSING, POSTPROCESSING, ENSEMBLE)}
