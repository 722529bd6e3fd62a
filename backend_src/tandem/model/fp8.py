"""Block-scaled FP8 weights held as FP8 in the model (the ``fp8_weights`` setting ``keep``; on CUDA its default).

GLM-5.3-Flash's release stores its FP8 set (:func:`tandem.model.layout.in_fp8_set`) as ``float8_e4m3fn`` with a
float32 ``weight_scale_inv`` per ``bn x bc`` block (:mod:`tandem.ops.fp8`). Kept, such a weight costs one byte an
element plus its scales, against two in bf16: the difference between the real model fitting 8 x 80 GB or not
(``make plan``). :func:`keep_fp8` swaps the modules whose checkpoint weights are FP8 for the two here before the
weights are allocated; the checkpoint loader (:func:`tandem.model.checkpoint.load_trunk`) fills them.

* :class:`Fp8Linear` for a linear ``[O, I]``: ``weight`` ``float8_e4m3fn [O, I]``, ``weight_scale_inv``
  ``[ceil(O / br), ceil(I / bc)]`` (the release's names);
* :class:`Fp8Experts` for the routed experts: ``gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]`` in FP8, each
  with ``*_scale_inv [E, ., .]``.

A module's ``block`` is the release's block, or ``(1, bc)`` where its rows join pieces that do not start on a block
boundary (an expert's gate and up rows when ``I`` is not a multiple of ``br``; a tensor-parallel part of rows): the
scales are then repeated per row, so the product is unchanged.

Where the Triton kernels run (:func:`tandem.ops.dispatch.fp8_linear`: CUDA, or Triton's interpreter) a GEMM reads
the FP8 bytes and scales each block's partial sums (:mod:`tandem.ops.triton.fp8_gemm`). Elsewhere the reference
runs: each call dequantizes the weight as the loader's ``dequantize`` mode does once at load (``w * scale_inv``
rounded to bfloat16, the release's own dtype) into the serving layout's input-major strides, so on the CPU a
kept model's tokens equal the dequantized model's (``tests/test_fp8_weights.py``), at one dequantization a call.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import dispatch
from ..ops.fp8 import SCALE_SUFFIX, dequantize
from ..ops.settings import DEFAULT, KernelSettings
from .layers import Experts, clamped_swiglu, local_slots, routed_experts

FP8 = torch.float8_e4m3fn


def _scales(rows: int, cols: int, block: tuple[int, int], lead: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.empty(*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]), dtype=torch.float32)


def _weight(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The reference's weight: ``w [R, C]`` dequantized as the loader's ``dequantize`` mode (bfloat16 values), in
    ``dtype``, with the serving layout's input-major strides (:func:`~tandem.model.layers.input_major_linears`)."""
    return dequantize(w, scale_inv, block).to(torch.bfloat16).to(dtype).t().contiguous().t()


class Fp8Linear(nn.Module):
    """``y [..., O] = x [..., I] @ W^T`` for ``W`` held in block-scaled FP8 (see the module text); no bias."""

    kernels: KernelSettings = DEFAULT

    def __init__(self, out_features: int, in_features: int, block: tuple[int, int]) -> None:
        super().__init__()
        self.out_features, self.in_features, self.block = out_features, in_features, tuple(block)
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        self.register_buffer("weight" + SCALE_SUFFIX, _scales(out_features, in_features, self.block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = getattr(self, "weight" + SCALE_SUFFIX)
        y = dispatch.fp8_linear(self.kernels, x, self.weight, s, self.block)
        return F.linear(x, _weight(self.weight, s, self.block, x.dtype)) if y is None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block={self.block}"


class Fp8Experts(nn.Module):
    """:class:`~tandem.model.layers.Experts` with both stacks held in block-scaled FP8: ``gate_up_proj [E, 2I, D]``
    (block ``up_block``) and ``down_proj [E, D, I]`` (``down_block``), each with ``*_scale_inv``. ``forward`` as
    :meth:`Experts.forward <tandem.model.layers.Experts.forward>`: on the Triton path one FP8 GEMM pair per expert
    a token chose; on the reference path :func:`~tandem.model.layers.routed_experts` over the dequantized stacks."""

    kernels: KernelSettings = DEFAULT
    dense_rows = Experts.dense_rows

    def __init__(self, like: Experts, up_block: tuple[int, int], down_block: tuple[int, int]) -> None:
        super().__init__()
        e, i2, d = like.gate_up_proj.shape
        self.limit, self.num_experts, self.first = like.limit, like.num_experts, like.first
        self.up_block, self.down_block = tuple(up_block), tuple(down_block)
        self.register_buffer("gate_up_proj", torch.empty(e, i2, d, dtype=FP8))
        self.register_buffer("gate_up_proj" + SCALE_SUFFIX, _scales(i2, d, self.up_block, (e,)))
        self.register_buffer("down_proj", torch.empty(e, d, i2 // 2, dtype=FP8))
        self.register_buffer("down_proj" + SCALE_SUFFIX, _scales(d, i2 // 2, self.down_block, (e,)))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x [N, D]``, ``idx [N, k]`` expert ids, ``w [N, k]`` weights -> ``[N, D]``."""
        su, sd = getattr(self, "gate_up_proj" + SCALE_SUFFIX), getattr(self, "down_proj" + SCALE_SUFFIX)
        if not dispatch.fp8_kernel(self.kernels, x):
            e, i2, d = self.gate_up_proj.shape
            up = torch.stack([_weight(self.gate_up_proj[j], su[j], self.up_block, x.dtype) for j in range(e)])
            up = up.reshape(e * i2, d).t().contiguous().t().view(e, i2, d)  # as the fused serving layout holds it
            down = torch.stack([_weight(self.down_proj[j], sd[j], self.down_block, x.dtype) for j in range(e)])
            down = down.transpose(1, 2).contiguous().transpose(1, 2)
            return routed_experts(x, idx, w, up, down, self.limit, self.first, self.num_experts, self.dense_rows)
        k = self.kernels
        idx, w = local_slots(idx, w, self.first, self.num_experts)
        out = torch.zeros_like(x)
        for j in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == j)
            g, u = dispatch.fp8_linear(k, x[tok], self.gate_up_proj[j], su[j], self.up_block).chunk(2, dim=-1)
            h = dispatch.fp8_linear(k, clamped_swiglu(g, u, self.limit), self.down_proj[j], sd[j], self.down_block)
            out.index_add_(0, tok, (h * w[tok, slot, None].to(h.dtype)).to(out.dtype))
        return out


def keep_fp8(model: nn.Module, forms: dict[str, tuple[int, int]]) -> int:
    """Swap, in ``model`` (on the meta device, before its weights are allocated), each module whose weights
    ``forms`` names (a linear's ``X.weight``, an experts' ``X.gate_up_proj`` and ``X.down_proj``, both needed) for
    its FP8 form with that block. Returns the number of modules swapped."""
    n = 0
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and m.bias is None and (b := forms.get(f"{name}.weight")):
            model.set_submodule(name, Fp8Linear(m.out_features, m.in_features, b))
            n += 1
        elif (
            isinstance(m, Experts)
            and (up := forms.get(f"{name}.gate_up_proj"))
            and (dn := forms.get(f"{name}.down_proj"))
        ):
            model.set_submodule(name, Fp8Experts(m, up, dn))
            n += 1
    return n
