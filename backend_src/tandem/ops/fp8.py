"""Block-scaled FP8 weights as torch (the reference of :mod:`tandem.ops.triton.fp8_gemm`, and what the checkpoint
loader, :mod:`tandem.model.layout`, dequantizes with): a weight ``W [R, C]`` stored ``float8_e4m3fn`` with
``scale_inv [ceil(R / br), ceil(C / bc)]`` float32 is ``w_fp8 * scale_inv`` per ``br x bc`` block (DeepSeek-V3's
format, 128 x 128 in GLM-5.3-Flash's release; transformers' ``_dequantize_fp8_weight``)."""

from __future__ import annotations

import math

import torch

#: the suffix of a block-scaled FP8 weight's scales in a checkpoint
SCALE_SUFFIX = "_scale_inv"


def check_scales(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``w [R, C]`` is float8_e4m3fn and ``scale_inv`` is ``[ceil(R /
    br), ceil(C / bc)]``."""
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2:
        raise ValueError(f"{name}: a block-scaled weight must be 2-D float8_e4m3fn, got {w.dtype} {list(w.shape)}")
    (R, C), (br, bc) = w.shape, block
    want = (math.ceil(R / br), math.ceil(C / bc))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}, the {list(w.shape)} weight in {br}x{bc} blocks "
            f"wants {list(want)}"
        )


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight") -> torch.Tensor:
    """``w [R, C]`` float8_e4m3fn times its per-block scales ``scale_inv [ceil(R / br), ceil(C / bc)]`` as float32.
    Raises ``ValueError`` naming ``name`` when the dtypes or the scales' shape do not fit (:func:`check_scales`)."""
    check_scales(w, scale_inv, block, name)
    (R, C), (br, bc) = w.shape, block
    s = scale_inv.float().repeat_interleave(br, 0)[:R].repeat_interleave(bc, 1)[:, :C]
    return w.float() * s


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-scaled FP8 form of ``w [R, C]``: (``float8_e4m3fn [R, C]``, ``scale_inv [ceil(R / br), ceil(C /
    bc)]`` float32), each block scaled so its largest magnitude maps to e4m3's largest (448; an all-zero block:
    scale 1). :func:`dequantize` inverts it to within e4m3's rounding."""
    (R, C), (br, bc) = w.shape, block
    x = w.float()
    pad = torch.zeros(math.ceil(R / br) * br, math.ceil(C / bc) * bc)
    pad[:R, :C] = x
    amax = pad.abs().unflatten(0, (-1, br)).unflatten(2, (-1, bc)).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(amax))
    full = scale.repeat_interleave(br, 0)[:R].repeat_interleave(bc, 1)[:, :C]
    return (x / full).to(torch.float8_e4m3fn), scale
