"""Where a checkpoint keeps the trunk's tensors, and how they are stored (:func:`tandem.model.checkpoint.load_trunk`).

Two layouts:

- **flat text** (``config.json`` model_type ``glm5_next_text``): the keys of transformers' ``Glm5NextTextModel``
  plus ``lm_head.weight``, the MTP layer at ``layers.{num_hidden_layers}`` (what ``make model`` writes);
- **released** (model_type ``glm5_next``, ``Glm5NextForConditionalGeneration``, how GLM-5.3-Flash is published):
  the text fields under ``text_config``; the text model under ``model.language_model.``, the MTP layer at
  ``model.language_model.layers.{num_hidden_layers}``, ``lm_head.weight`` at the top; the vision tower under
  ``model.visual.``, which is skipped: never read, never allocated.

In either, a tensor may carry transformers' in-memory name (tandem's own writes) or the name it has on disk in
the release, which transformers converts at load (its ``conversion_mapping`` for ``glm5_next``, and what its
``save_pretrained`` writes back): ``hc_attn_fn`` for ``attn_hc.fn`` (and the other five mHC tensors);
``self_attn.f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log`` for ``self_attn.forget_gate.*``; one
``mlp.experts.{e}.{gate,up,down}_proj.weight`` per routed expert for the stacked ``mlp.experts.gate_up_proj``
``[E, 2I, D]`` (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, D, I]``; and
``self_attn.{q,k,v}_conv1d.weight`` for their concatenation ``self_attn.conv1d.weight``.

**Block-scaled FP8** (``quantization_config``: ``quant_method`` ``fp8``, ``fmt`` ``e4m3``, ``weight_block_size``
``[128, 128]``, ``activation_scheme`` ``dynamic``; DeepSeek-V3's format, which GLM-5.3-Flash's release uses): a
weight ``w [R, C]`` stored ``float8_e4m3fn`` beside ``w_scale_inv [ceil(R / 128), ceil(C / 128)]`` float32 is
``w_fp8 * w_scale_inv`` per 128 x 128 block (transformers' ``_dequantize_fp8_weight``). It is dequantized as it
is read, rounded to bfloat16 (the release's own dtype), so the model holds the load dtype. Any other ``quant_method`` is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch

from ..ops.fp8 import SCALE_SUFFIX, check_scales, dequantize
from .config import is_released_layout, vision_token_ids

#: the released layout's prefixes: the text model (with its MTP layer) and the vision tower (skipped)
TEXT_PREFIX, VISION_PREFIX = "model.language_model.", "model.visual."
#: on-disk name -> in-memory name (transformers' ``conversion_mapping`` renames for ``glm5_next``), applied in order
RENAMES = (
    (re.compile(r"self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)\b"), r"self_attn.forget_gate.\1"),
    (re.compile(r"\bhc_(attn|ffn)_(fn|base|scale)$"), r"\1_hc.\2"),
)
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_CONV = re.compile(r"^(layers\.\d+\.self_attn)\.([qkv])_conv1d\.weight$")
#: bytes per element of a safetensors dtype (for the skipped tensors' size)
_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1}
#: the ``quantization_config`` fields tandem reads (``modules_to_not_convert`` and ``dequantize`` are accepted
#: as they are: each stored tensor's dtype says whether it is FP8)
_FP8_FIELDS = {"quant_method", "fmt", "weight_block_size", "activation_scheme", "modules_to_not_convert", "dequantize"}


@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
    """Block-scaled FP8 weights: ``block`` (rows, columns) per scale."""

    block: tuple[int, int]


def fp8_blocks(d: dict) -> Fp8Blocks | None:
    """The ``quantization_config`` of a ``config.json`` body: None without one, else :class:`Fp8Blocks`.
    Raises ``ValueError`` naming a field tandem cannot honour (another ``quant_method``, an ``fmt`` other than
    ``e4m3``, a ``weight_block_size`` that is not two positive ints, static activation scales, UE8M0 scales,
    an unknown field)."""
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"config.json: quantization_config.quant_method {method!r} is not served: tandem loads block-scaled "
            "'fp8' (e4m3 weights, weight_scale_inv per block)"
        )
    unknown = sorted(set(q) - _FP8_FIELDS - {"scale_fmt"})
    if unknown:
        raise ValueError(f"config.json: quantization_config has unknown field(s) {unknown}: tandem cannot honour them")
    if q.get("scale_fmt") not in (None, "float32"):
        raise ValueError(f"config.json: quantization_config.scale_fmt {q['scale_fmt']!r}: tandem reads float32 scales")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"config.json: quantization_config.fmt must be 'e4m3', got {q['fmt']!r}")
    if str(q.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise ValueError(
            f"config.json: quantization_config.activation_scheme must be 'dynamic', got {q['activation_scheme']!r}"
        )
    block = q.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"config.json: quantization_config.weight_block_size must be [rows, columns], got {block!r}")
    return Fp8Blocks((int(block[0]), int(block[1])))


_STACKED = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_FUSED_CONV = re.compile(r"^(layers\.\d+\.self_attn)\.conv1d\.weight$")
#: in-memory name -> on-disk name (the inverse of :data:`RENAMES`)
_UNRENAMES = (
    (re.compile(r"self_attn\.forget_gate\.(f_a_proj|f_b_proj|dt_bias|A_log)\b"), r"self_attn.\1"),
    (re.compile(r"\b(attn|ffn)_hc\.(fn|base|scale)$"), r"hc_\1_\2"),
)


def release_names(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The on-disk form of the in-memory tensor ``name`` (no layout prefix): what :class:`CheckpointTensors`
    assembles back into it. The stacked experts ``[E, 2I, D]`` / ``[E, D, I]`` become one tensor per expert and
    projection, a KDA layer's ``conv1d.weight [3C, 1, K]`` its q, k and v thirds, the mHC and forget-gate tensors
    take their on-disk names; anything else is returned as it is."""
    if m := _STACKED.match(name):
        if m[2] == "down_proj":
            return {f"{m[1]}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
        out = {}
        for e in range(t.shape[0]):
            gate, up = t[e].chunk(2)
            out[f"{m[1]}.{e}.gate_proj.weight"], out[f"{m[1]}.{e}.up_proj.weight"] = gate, up
        return out
    if m := _FUSED_CONV.match(name):
        return {f"{m[1]}.{c}_conv1d.weight": part for c, part in zip("qkv", t.chunk(3))}
    for pattern, repl in _UNRENAMES:
        name = pattern.sub(repl, name)
    return {name: t}


_MLA_PROJ = re.compile(r"^layers\.(\d+)\.self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight$")
_MLP = re.compile(r"^layers\.\d+\.mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_ONE = re.compile(r"^layers\.\d+\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


def in_fp8_set(name: str, mla_layers: set[int]) -> bool:
    """Whether the tensor of on-disk name ``name`` (:func:`~tandem.model.layout.release_names`, no layout prefix)
    is in the released FP8 set, ``mla_layers`` the MLA/DSA layers' indices (the MTP layer's included)."""
    if m := _MLA_PROJ.match(name):
        return int(m[1]) in mla_layers
    return bool(_MLP.match(name) or _EXPERT_ONE.match(name))


@dataclasses.dataclass(frozen=True)
class Layout:
    """A checkpoint folder's layout: ``released`` (else flat text), ``prefix`` of the text model's keys, ``fp8``
    block scales (None: none), the prompt token ids a text-only server refuses (``vision_token_ids``)."""

    released: bool
    prefix: str
    fp8: Fp8Blocks | None
    vision_token_ids: tuple[int, ...]

    @classmethod
    def read(cls, folder: str | Path) -> "Layout":
        """From ``folder/config.json``. Raises ``ValueError`` as :func:`fp8_blocks` does."""
        d = json.loads((Path(folder) / "config.json").read_text())
        released = is_released_layout(d)
        return cls(released, TEXT_PREFIX if released else "", fp8_blocks(d), vision_token_ids(d))


class CheckpointTensors:
    """The trunk's tensors of a checkpoint, by tandem's (transformers' in-memory) key, read from the files of
    ``files`` (:func:`~tandem.model.checkpoint.weight_map`) in ``layout``: each from its own key, or assembled from
    the release's on-disk names, FP8 dequantized (see the module text). ``keys`` are those it can give;
    ``unexpected`` the stored keys no tandem key takes; ``skipped`` (tensors, bytes) of the vision tower, which it
    never reads."""

    def __init__(self, files: dict[str, Path], layout: Layout) -> None:
        self.files, self.layout = files, layout
        self.unexpected: list[str] = []
        self.skipped = [0, 0]
        self._handles: dict[Path, object] = {}
        self._recipes: dict[str, tuple] = {}
        experts: dict[tuple[str, str], dict[int, str]] = {}
        convs: dict[str, dict[str, str]] = {}
        for key in files:
            name = self._name(key)
            if name is None:
                continue
            if key.endswith(SCALE_SUFFIX):  # read beside its weight; one without a weight is unexpected
                if key.removesuffix(SCALE_SUFFIX) not in files:
                    self.unexpected.append(key)
                continue
            for pattern, repl in RENAMES:
                name = pattern.sub(repl, name)
            if m := _EXPERT.match(name):
                experts.setdefault((m[1], m[3]), {})[int(m[2])] = key
            elif m := _CONV.match(name):
                convs.setdefault(f"{m[1]}.conv1d.weight", {})[m[2]] = key
            else:
                self._recipes[name] = ("one", key)
        gate_up: dict[str, dict[str, list[str]]] = {}
        for (base, proj), by_e in experts.items():
            if sorted(by_e) != list(range(len(by_e))):
                raise KeyError(f"{base}.{proj}: expert ids {sorted(by_e)} are not 0..{len(by_e) - 1}")
            keys = [by_e[e] for e in range(len(by_e))]
            if proj == "down_proj":
                self._recipes[f"{base}.down_proj"] = ("stack", keys)
            else:
                gate_up.setdefault(f"{base}.gate_up_proj", {})[proj] = keys
        for name, parts in gate_up.items():
            if sorted(parts) != ["gate_proj", "up_proj"] or len(parts["gate_proj"]) != len(parts["up_proj"]):
                raise KeyError(f"{name}: needs every expert's gate_proj and up_proj, found {sorted(parts)}")
            self._recipes[name] = ("gate_up", [k for pair in zip(parts["gate_proj"], parts["up_proj"]) for k in pair])
        for name, parts in convs.items():
            if sorted(parts) != ["k", "q", "v"]:
                raise KeyError(f"{name}: needs the q, k and v convolutions, found {sorted(parts)}")
            self._recipes[name] = ("cat", [parts["q"], parts["k"], parts["v"]])

    def _name(self, key: str) -> str | None:
        """A stored key without the layout's prefix; None for a vision tower's (counted in ``skipped``) or, in the
        released layout, one outside it (counted in ``unexpected``)."""
        if not self.layout.released:
            return key
        if key.startswith(VISION_PREFIX):
            if not key.endswith(SCALE_SUFFIX):
                self.skipped[0] += 1
                self.skipped[1] += self._nbytes(key)
            return None
        if key.startswith(TEXT_PREFIX):
            return key[len(TEXT_PREFIX) :]
        if key.removesuffix(SCALE_SUFFIX) == "lm_head.weight":
            return key
        self.unexpected.append(key)
        return None

    def _nbytes(self, key: str) -> int:
        """A stored tensor's size from its file's header (nothing read)."""
        sl = self._file(key).get_slice(key)
        return math.prod(sl.get_shape()) * _BYTES.get(sl.get_dtype(), 2)

    def keys(self) -> set[str]:
        """The tandem keys it can give."""
        return set(self._recipes)

    def drop(self, prefix: str) -> None:
        """Forget the tandem keys starting with ``prefix`` (a layer not loaded): neither read nor reported."""
        self._recipes = {k: r for k, r in self._recipes.items() if not k.startswith(prefix)}

    def sources(self, key: str) -> list[str]:
        """The stored keys tandem key ``key`` is read from."""
        kind, arg = self._recipes[key]
        return [arg] if kind == "one" else list(arg)

    def shape(self, key: str) -> tuple[int, ...]:
        """Tandem key ``key``'s shape, from the files' headers (nothing read)."""
        kind, arg = self._recipes[key]
        one = lambda k: tuple(self._file(k).get_slice(k).get_shape())  # noqa: E731
        if kind == "one":
            return one(arg)
        first = one(arg[0])
        if kind == "stack":
            return (len(arg), *first)
        if kind == "cat":
            return (sum(one(k)[0] for k in arg), *first[1:])
        return (len(arg) // 2, 2 * first[0], *first[1:])  # gate | up per expert

    def read(self, key: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """Tandem key ``key``'s tensor (bfloat16 where it was stored in FP8), or with ``part = (dim, start, end)``
        its rows ``start:end`` along ``dim``: a stored tensor is then read in that slice only (``get_slice``), a
        stack of experts only in the experts asked for (an FP8 weight is read whole, then sliced). Raises
        ``ValueError`` naming a stored key whose FP8 form does not fit (no scales, scales beside a weight not in
        FP8, misshapen scales, FP8 without a ``quantization_config``, another 8-bit float)."""
        kind, arg = self._recipes[key]
        if part is not None and kind in ("stack", "gate_up") and part[0] == 0:  # whole experts of this rank
            d, a, b = part
            arg = arg[a:b] if kind == "stack" else arg[2 * a : 2 * b]
            part = None
        if kind == "one":
            return self._get(arg, part)
        parts = [self._get(k) for k in arg]
        if kind == "stack":
            t = torch.stack(parts)
        elif kind == "cat":
            t = torch.cat(parts)
        else:
            t = torch.stack([torch.cat(parts[i : i + 2]) for i in range(0, len(parts), 2)])  # gate | up per expert
        return t if part is None else t.narrow(part[0], part[1], part[2] - part[1])

    def fp8_form(self, key: str, part: tuple[int, int, int] | None = None) -> tuple[int, int] | None:
        """The block (rows, columns) in which tandem key ``key`` (its part ``part``, as :meth:`read` takes it) can be
        held in FP8 (:mod:`tandem.model.fp8`): the release's block, ``(1, bc)`` where its rows join pieces or start
        a part off a block boundary (the scales then repeat per row), or None: not every stored piece is FP8, or a
        part cuts its columns off a block boundary (it is then dequantized)."""
        if self.layout.fp8 is None:
            return None
        kind, arg = self._recipes[key]
        keys = [arg] if kind == "one" else list(arg)
        if kind == "cat" or any(self._file(k).get_slice(k).get_dtype() != "F8_E4M3" for k in keys):
            return None
        (bn, bc), first = self.layout.fp8.block, tuple(self._file(keys[0]).get_slice(keys[0]).get_shape())
        rb = bn if kind != "gate_up" or first[0] % bn == 0 else 1
        if part is not None and not (kind in ("stack", "gate_up") and part[0] == 0):
            d, a, b = part
            if kind != "one":
                return None
            size, blk = first[d], (rb, bc)[d]
            if a % blk or (b % blk and b != size):
                if d == 1:
                    return None
                rb = 1
        return (rb, bc)

    def read_fp8(self, key: str, block: tuple[int, int], part: tuple[int, int, int] | None = None):
        """Tandem key ``key`` (its part ``part``) as held in FP8 in ``block`` (:meth:`fp8_form`): ``(w
        float8_e4m3fn, scale_inv float32)``, the scales ``[..., ceil(rows / block[0]), ceil(cols / block[1])]``."""
        kind, arg = self._recipes[key]
        if part is not None and kind in ("stack", "gate_up") and part[0] == 0:
            d, a, b = part
            arg, part = (arg[a:b] if kind == "stack" else arg[2 * a : 2 * b]), None
        bn = self.layout.fp8.block[0]

        def one(k: str) -> tuple[torch.Tensor, torch.Tensor]:
            w, s = self._load(k), self._load(k + SCALE_SUFFIX)
            check_scales(w, s, self.layout.fp8.block, k)
            return w, (s.repeat_interleave(bn, 0)[: w.shape[0]] if block[0] != bn else s)

        if kind == "one":
            w, s = one(arg)
        else:
            ws = [one(k) for k in arg]
            if kind == "gate_up":  # gate | up rows per expert
                ws = [tuple(torch.cat([ws[i][j], ws[i + 1][j]]) for j in (0, 1)) for i in range(0, len(ws), 2)]
            w, s = torch.stack([p[0] for p in ws]), torch.stack([p[1] for p in ws])
        if part is not None:
            d, a, b = part
            blk = block[d]
            w, s = w.narrow(d, a, b - a), s.narrow(d, a // blk, -(-b // blk) - a // blk)
        return w, s

    def _get(self, stored: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        scale = stored + SCALE_SUFFIX
        if part is not None:
            d, a, b = part
            sl = self._file(stored).get_slice(stored)
            if sl.get_dtype() not in ("F8_E4M3", "F8_E5M2") and scale not in self.files:
                return sl[(slice(None),) * d + (slice(a, b),)]
            return self._get(stored).narrow(d, a, b - a)
        t = self._load(stored)
        if t.dtype == torch.float8_e4m3fn:
            if scale not in self.files:
                raise ValueError(f"{stored} is float8_e4m3fn without {scale}")
            if self.layout.fp8 is None:
                raise ValueError(f"{stored} is float8_e4m3fn but config.json has no quantization_config")
            # to bfloat16, the release's own dtype (one rounding of each product): the weights stay bf16-exact, so the
            # CPU path keeps its bfloat16 GEMMs and the kernels the shipped weights compiled
            return dequantize(t, self._load(scale), self.layout.fp8.block, stored).to(torch.bfloat16)
        if scale in self.files:
            raise ValueError(f"{scale} scales {stored}, which is {t.dtype}, not float8_e4m3fn")
        if t.dtype.is_floating_point and t.dtype.itemsize == 1:
            raise ValueError(f"{stored} is {t.dtype}: tandem reads float8_e4m3fn weights (quant_method fp8)")
        return t

    def _file(self, stored: str):
        """The open safetensors file holding ``stored`` (each opened once)."""
        from safetensors import safe_open

        f = self.files[stored]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), "pt")
        return self._handles[f]

    def _load(self, stored: str) -> torch.Tensor:
        return self._file(stored).get_tensor(stored)

    def close(self) -> None:
        """Release the files' handles."""
        self._handles.clear()
