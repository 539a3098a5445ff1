"""Quantised weights: the published checkpoint's block-FP8 experts (`block_fp8`, `checkpoint`,
`transformers_fp8`; held and computed in FP8 by `fp8_experts`), and the model through transformers' weight quantisers, torchao and
bitsandbytes, routed experts included (`quantized_loading`, `experts`).

The bytes a weight takes under each option, for memory plans: `weights.quantized_bytes(shape,
option, device, dtype, group_size)`; what a loaded model holds: `weights.held_bytes(model)`.
"""

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
from .fp8_expert_layer import Drama3FP8Experts, quantize_experts_fp8, replace_transformers_fp8_experts
from .experts import Drama3RoutedExperts, routed_experts_from_fused, split_routed_experts
from .quantized_loading import (
    DEFAULT_MODULES_TO_NOT_CONVERT,
    WEIGHT_OPTIONS,
    QuantizationRefused,
    check_weight_quantization,
    quantization_config_for,
    quantized_lora_config,
)
from .weights import held_bytes, quantized_bytes
from .transformers_fp8 import (
    NON_EXPERT_MODULES,
    fp8_quantization_config_for_cuda,
    transformers_quantization_config,
)


__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_MODULES_TO_NOT_CONVERT",
    "Drama3FP8Experts",
    "Drama3RoutedExperts",
    "QuantizationRefused",
    "WEIGHT_OPTIONS",
    "check_weight_quantization",
    "held_bytes",
    "quantization_config_for",
    "quantized_bytes",
    "quantized_lora_config",
    "replace_transformers_fp8_experts",
    "routed_experts_from_fused",
    "split_routed_experts",
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
    "quantize_experts_fp8",
    "quantize_saved_experts",
    "quantize_state_dict",
    "quantizer_for_rule",
    "scale_grid_shape",
    "scale_rule",
    "split_expert_weights",
    "transformers_quantization_config",
]
