"""Block-scaled FP8 weights as dense ones: the one dequantisation the checkpoint code
(`checkpoint.quantization.block_fp8`) and the FP8 experts' reference path (`kernels.fp8_experts`)
share. It sits here, below both, so neither imports the other's package."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
"""The published experts' weight dtype (e4m3)."""


def dequantize_blocks(weight_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """`weight_fp8: [..., out, in]`, `scale_inv: [..., ceil(out/bo), ceil(in/bi)]` -> dense
    `[..., out, in]` in `dtype`: each block's scale repeated over its elements (edges cropped), the
    product formed in float32. No checks: callers check the pair."""
    rows, columns = weight_fp8.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :columns]
    return (weight_fp8.float() * scale).to(dtype)
