"""Quantised weight formats of the published checkpoint."""

from .block_fp8 import (
    DEFAULT_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    QUANTIZATION_METHOD,
    dequantize_block_fp8,
    dequantize_block_fp8_reference,
    dequantize_state_dict,
    expert_projections,
    fuse_expert_weights,
    is_block_fp8_config,
    is_routed_expert_weight,
    quantize_block_fp8,
    quantize_block_fp8_power_of_two,
    quantize_state_dict,
    quantizer_for_rule,
    scale_grid_shape,
    scale_rule,
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
    "expert_projections",
    "fp8_quantization_config_for_cuda",
    "fuse_expert_weights",
    "is_block_fp8_config",
    "is_routed_expert_weight",
    "quantize_block_fp8",
    "quantize_block_fp8_power_of_two",
    "quantize_saved_experts",
    "quantize_state_dict",
    "quantizer_for_rule",
    "scale_grid_shape",
    "scale_rule",
    "split_expert_weights",
    "transformers_quantization_config",
]
