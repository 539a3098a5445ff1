"""The routed experts held as the published block-FP8 bytes (1 byte a weight) and computed from them.

`Drama3FP8Experts` stands in `mlp.experts` in place of transformers' `Qwen3_5MoeExperts` (dense) or
`FP8Experts` (its FP8 experts, whose matmuls come from the `kernels` package, fetched from the Hub
on first use). It holds the fused parameters under transformers' names, the scale grids of each
projection kept as the checkpoint has them:

    gate_up_proj: [E, 2I, H] e4m3   gate_up_proj_scale_inv: [E, 2 ceil(I/bo), ceil(H/bi)] float32 (gate grid, then up grid)
    down_proj:    [E, H, I]  e4m3   down_proj_scale_inv:    [E, ceil(H/bo), ceil(I/bi)]   float32

and computes with `kernels.fp8_experts.fp8_experts`: one op that runs the fused dequantise-GEMM
Triton kernels on CUDA tensors and, elsewhere, the reference, which dequantises one chunk of
experts at a time (`experts_per_chunk`).

How a model gets it:

- `from_pretrained` of a block-FP8 ("bsgemm-moe") checkpoint where transformers keeps the experts
  in FP8 (CUDA, compute capability >= 8.9): transformers builds `FP8Experts` and reads the bytes
  and scales into them; the loader (`quantized_loading.load_pretrained_weights`) then puts a
  `Drama3FP8Experts` holding the very same tensors in each one's place
  (`replace_transformers_fp8_experts`). Everywhere else transformers loads dense experts, as before.
- `quantize_experts_fp8(model, block_size)`: dense fused experts become FP8, one expert projection
  at a time, on the device they are on. A model loaded from block-FP8 experts (dequantised, on a
  CPU) gets the checkpoint's own bytes back for every expert it still holds unchanged (kept by
  `model.loaded_checkpoint`), the rest are quantised afresh (amax / 448 per block).

Saving: the parameter names are those of transformers' `FP8Experts`, which
`loaded_checkpoint.published_state_dict` already splits per expert: `save_pretrained` writes the
held bytes and scales in the published layout.

The FP8 weights are frozen (no gradient); a gradient flows through to the hidden states and the
routing weights (the reference runs then). `module.to(dtype)` and `.half()` move these tensors
between devices but keep their dtypes: a cast would turn the codes into dense weights and round
the float32 scales.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...kernels import fp8_expert_gemm as kernel
from .block_fp8 import (
    DEFAULT_BLOCK, FP8_DTYPE, QUANTIZATION_METHOD, SCALE_SUFFIX, expert_as_stored, expert_projections, weight_block_size,
)

ACTIVATION = "silu"
"""The experts' activation the kernels apply (Qwen3.5-MoE's `hidden_act`)."""


class Drama3FP8Experts(nn.Module):
    """The routed experts of one MoE layer in block-FP8 (the module docstring): forward
    `(hidden_states [rows, H], top_k_index [rows, k], top_k_weights [rows, k]) -> [rows, H]`, as
    transformers' experts modules."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        block: tuple[int, int] = DEFAULT_BLOCK,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if len(block) != 2 or not all(isinstance(size, int) and size > 0 for size in block):
            raise ValueError(f"block must be two positive integers (block_out, block_in); got {block!r}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_size, intermediate_size
        self.block = tuple(block)
        self.experts_per_chunk = kernel.EXPERTS_PER_CHUNK
        gate_rows, down_rows = math.ceil(intermediate_size / block[0]), math.ceil(hidden_size / block[0])

        def frozen(shape, dtype):
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.gate_up_proj = frozen((num_experts, 2 * intermediate_size, hidden_size), FP8_DTYPE)
        self.gate_up_proj_scale_inv = frozen((num_experts, 2 * gate_rows, math.ceil(hidden_size / block[1])), torch.float32)
        self.down_proj = frozen((num_experts, hidden_size, intermediate_size), FP8_DTYPE)
        self.down_proj_scale_inv = frozen((num_experts, down_rows, math.ceil(intermediate_size / block[1])), torch.float32)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return kernel.fp8_experts(
            hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.gate_up_proj_scale_inv,
            self.down_proj, self.down_proj_scale_inv, self.block, self.experts_per_chunk,
        )

    def _apply(self, fn, recurse=True):
        def keeping_dtype(tensor):
            applied = fn(tensor)
            return applied if applied.dtype == tensor.dtype else tensor.to(applied.device)

        return super()._apply(keeping_dtype, recurse)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_dim}, "
            f"intermediate_size={self.intermediate_dim}, block={self.block}"
        )


# ----------------------------------------------------------------------------- from transformers' FP8Experts


def holding(experts: nn.Module) -> Drama3FP8Experts:
    """A `Drama3FP8Experts` holding the tensors of transformers' `FP8Experts` `experts` (not copies)."""
    block = getattr(experts, "block_size", None)
    config = getattr(experts, "config", None)
    problems = []
    if block is None:
        problems.append("weight_block_size is None (per-tensor scales)")
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_bias", False):
        problems.append("no fused gate_up projection, or biases")
    if getattr(experts, "activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme={experts.activation_scheme!r}")
    if config is not None and getattr(config, "hidden_act", ACTIVATION) != ACTIVATION:
        problems.append(f"hidden_act={config.hidden_act!r}")
    if getattr(experts, "gate_up_proj", None) is None or experts.gate_up_proj.dtype != FP8_DTYPE:
        problems.append("gate_up_proj is not float8 e4m3")
    if problems:
        raise ValueError(f"{type(experts).__name__} cannot be computed by Drama3FP8Experts: {'; '.join(problems)}")
    num_experts, two_intermediate, hidden_size = experts.gate_up_proj.shape
    replacement = Drama3FP8Experts(num_experts, hidden_size, two_intermediate // 2, tuple(block), device="meta")
    for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        tensor = getattr(experts, name)
        expected = getattr(replacement, name)
        if tensor.shape != expected.shape or tensor.dtype != expected.dtype:
            raise ValueError(
                f"{type(experts).__name__}.{name}: expected {tuple(expected.shape)} {expected.dtype} (block {tuple(block)}), "
                f"got {tuple(tensor.shape)} {tensor.dtype}"
            )
        tensor.requires_grad_(False)
        setattr(replacement, name, tensor)
    replacement._is_hf_initialized = True
    return replacement


def replace_transformers_fp8_experts(model: nn.Module) -> int:
    """Put a `Drama3FP8Experts` holding the same tensors in the place of every transformers
    `FP8Experts` of `model`. Returns the number replaced (0 when transformers loaded dense experts)."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:
        return 0
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, FP8Experts):
            model.set_submodule(name, holding(module))
            replaced += 1
    return replaced


# ----------------------------------------------------------------------------- from dense experts


def is_dense_fused_experts(module: nn.Module) -> bool:
    """transformers' fused experts with float weights (`gate_up_proj: [E, 2I, H]`, `down_proj: [E, H, I]`)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3 and down.dim() == 3
        and gate_up.is_floating_point() and gate_up.dtype != FP8_DTYPE
        and getattr(module, "gate_up_proj_scale_inv", None) is None
    )


def quantize_experts_fp8(model: nn.Module, block_size: tuple[int, int] = DEFAULT_BLOCK) -> int:
    """Turn the routed experts of `model` into `Drama3FP8Experts` (1 byte a weight + one float32
    scale per `block_size` block), one expert projection at a time, on the device each layer is on.

    Dense fused experts are quantised: with the checkpoint's own bytes where `model.loaded_checkpoint`
    kept them and the weight is still what loading made of them, else afresh (amax / 448, or the
    power-of-two rule the loaded scales follow). transformers' `FP8Experts` are taken as they are.
    A Drama 3 config without a block-FP8 `quantization_config` gets the published one for
    `block_size`, so that `save_pretrained` writes the published layout. Returns the number of
    experts modules replaced."""
    block = tuple(block_size)
    if len(block) != 2 or not all(isinstance(size, int) and size > 0 for size in block):
        raise ValueError(f"block_size must be two positive integers (block_out, block_in); got {block_size!r}")
    config = getattr(model, "config", None)
    published = getattr(config, "published_quantization_config", None)
    if published is not None and weight_block_size(published) != block:
        raise ValueError(
            f"block_size={block}: the model's checkpoint stores its experts in blocks of {weight_block_size(published)}; "
            f"pass block_size={weight_block_size(published)}"
        )
    record = getattr(model, "loaded_checkpoint", None)
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, Drama3FP8Experts) or not name.endswith("mlp.experts"):
            continue
        if is_dense_fused_experts(module):
            model.set_submodule(name, quantized(name, module, block, record))
        elif getattr(module, "gate_up_proj_scale_inv", None) is not None:
            model.set_submodule(name, holding(module))
        else:
            raise TypeError(f"{name} is a {type(module).__name__}: expected transformers' fused experts (gate_up_proj, down_proj)")
        replaced += 1
    if replaced and config is not None and hasattr(config, "published_quantization_config") and published is None:
        config.published_quantization_config = {
            "quant_method": QUANTIZATION_METHOD, "activation_scheme": "dynamic", "weight_block_size": list(block),
        }
    return replaced


def quantized(name: str, experts: nn.Module, block: tuple[int, int], record=None) -> Drama3FP8Experts:
    """A `Drama3FP8Experts` with the weights of the dense fused `experts` named `name` in the model
    (`...mlp.experts`), each projection quantised alone (see `quantize_experts_fp8`). The record's
    kept bytes of these experts are dropped: the module now holds them."""
    config = getattr(experts, "config", None)
    if config is not None and getattr(config, "hidden_act", ACTIVATION) != ACTIVATION:
        raise ValueError(f"{name}: hidden_act={config.hidden_act!r}; the FP8 experts compute {ACTIVATION!r} only")
    gate_up, down = experts.gate_up_proj, experts.down_proj
    num_experts, two_intermediate, hidden_size = gate_up.shape
    intermediate = two_intermediate // 2
    fp8 = Drama3FP8Experts(num_experts, hidden_size, intermediate, block, device=gate_up.device)
    gate_rows = fp8.gate_up_proj_scale_inv.shape[1] // 2
    # where each projection of expert e goes: (weight rows, scale rows) of the fused tensors
    targets = {
        "gate_proj": (fp8.gate_up_proj, fp8.gate_up_proj_scale_inv, slice(0, intermediate), slice(0, gate_rows)),
        "up_proj": (fp8.gate_up_proj, fp8.gate_up_proj_scale_inv, slice(intermediate, None), slice(gate_rows, None)),
        "down_proj": (fp8.down_proj, fp8.down_proj_scale_inv, slice(None), slice(None)),
    }
    kept = getattr(record, "kept", {})
    with torch.no_grad():
        for projection_name, weight in expert_projections(name, {"gate_up_proj": gate_up, "down_proj": down}):
            expert, projection = projection_name.removeprefix(name + ".").split(".")[:2]
            weight_fp8, scale_inv, _ = expert_as_stored(projection_name, weight, record, block)
            codes, scales, rows, scale_rows = targets[projection]
            codes[int(expert), rows].copy_(weight_fp8)
            scales[int(expert), scale_rows].copy_(scale_inv)
            kept.pop(projection_name, None)
            kept.pop(projection_name + SCALE_SUFFIX, None)
    fp8._is_hf_initialized = True
    return fp8


__all__ = [
    "Drama3FP8Experts",
    "holding",
    "is_dense_fused_experts",
    "quantize_experts_fp8",
    "replace_transformers_fp8_experts",
]
