"""The published "bsgemm-moe" experts through transformers' own fine-grained FP8 support.

transformers 5.24 does not know "bsgemm-moe": `from_pretrained` warns, skips quantisation,
casts the FP8 expert bytes to the parameter dtype WITHOUT their scales (wrong weights) and
reports every `weight_scale_inv` as unexpected. The same tensors are exactly its "fp8"
format (`FineGrainedFP8Config`: e4m3 weights, float32 `weight_scale_inv` per
`weight_block_size` block, dynamic activations), so a config that states them as "fp8" loads
correctly:

- on CUDA with compute capability >= 8.9, the routed experts become `FP8Experts` (fused
  `gate_up_proj: [E, 2I, H]` and `down_proj: [E, H, I]` in FP8, with `*_scale_inv` grids);
  the per-expert weights AND scales are merged by the qwen3_5_moe_text conversion mapping.
  Its matmuls come from the `kernels` package (DeepGEMM or the `kernels-community/finegrained-fp8`
  Triton kernel, fetched from the Hub on first use), so a Drama 3 load puts the package's own
  `fp8_experts.Drama3FP8Experts` (same tensors, Triton kernels beside a PyTorch reference) in
  their place.
- anywhere else (CPU, older GPUs) transformers sets `dequantize=True` itself and loads dense
  weights, dequantised per block and fused by the same mapping.

`modules_to_not_convert` keeps every other linear dense: it is a regex that matches every module
name except the `...mlp.experts` modules (the checkpoint's other weights are bfloat16).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .block_fp8 import weight_block_size


# Every module whose name does not end in `.mlp.experts`; transformers matches these patterns
# with `re.match` from the start of the module name.
NON_EXPERT_MODULES = r"(?!.*\.mlp\.experts$).*"


def transformers_quantization_config(quantization_config: Mapping[str, Any]) -> dict[str, Any]:
    """The published `{"quant_method": "bsgemm-moe", "activation_scheme": "dynamic",
    "weight_block_size": [128, 128]}` as the dict of transformers' `FineGrainedFP8Config`.

    Store it as the model config's `quantization_config` (not only as a `from_pretrained`
    argument): transformers treats a checkpoint as pre-quantised only when the config holds it.
    """
    block = weight_block_size(quantization_config)
    activation_scheme = quantization_config.get("activation_scheme", "dynamic")
    if activation_scheme != "dynamic":
        raise ValueError(f"bsgemm-moe experts use activation_scheme='dynamic'; got {activation_scheme!r}")
    return {
        "quant_method": "fp8",
        "activation_scheme": activation_scheme,
        "weight_block_size": list(block),
        "modules_to_not_convert": [NON_EXPERT_MODULES],
    }


def fp8_quantization_config_for_cuda(block: tuple[int, int] = (128, 128)):
    """A `FineGrainedFP8Config` that keeps only the routed experts in FP8 (see the module doc
    for what it needs on CUDA)."""
    from transformers import FineGrainedFP8Config

    return FineGrainedFP8Config(
        activation_scheme="dynamic",
        weight_block_size=tuple(block),
        modules_to_not_convert=[NON_EXPERT_MODULES],
    )
