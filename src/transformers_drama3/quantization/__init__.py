"""Quantised weight formats of the published checkpoint."""

from .block_fp8 import (
    DEFAULT_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    QUANTIZATION_METHOD,
    dequantize_block_fp8,
    dequantize_block_fp8_reference,
    dequantize_state_dict,
    fuse_expert_weights,
    is_block_fp8_config,
    is_routed_expert_weight,
    quantize_block_fp8,
    quantize_state_dict,
    scale_grid_shape,
    split_expert_weights,
    weight_block_size,
)
from .checkpoint import quantize_saved_experts
from .transformers_fp8 import (
    NON_EXPERT_MODULES,
    fp8_quantization_config_for_cuda,
    transformers_quantization_config,
)


__all__ = [
    "DEFAULT_BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "NON_EXPERT_MODULES",
    "QUANTIZATION_METHOD",
    "dequantize_block_fp8",
    "dequantize_block_fp8_reference",
    "dequantize_state_dict",
    "fp8_quantization_config_for_cuda",
    "fuse_expert_weights",
    "is_block_fp8_config",
    "is_routed_expert_weight",
    "quantize_block_fp8",
    "quantize_saved_experts",
    "quantize_state_dict",
    "scale_grid_shape",
    "split_expert_weights",
    "transformers_quantization_config",
]
