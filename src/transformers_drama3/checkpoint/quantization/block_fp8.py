"""Block-scaled FP8 weights, the format of Drama 3's routed experts ("bsgemm-moe").

A weight `w: [out, in]` is cut into blocks of `block = (block_out, block_in)` elements
(`[128, 128]` in the published checkpoint; the last row and column of blocks may be partial).
Each block b keeps one float32 number `scale_inv[b]` and its elements as float8 e4m3:

    w[i, j] ~= float(w_fp8[i, j]) * scale_inv[i // block_out, j // block_in]

`scale_inv: [ceil(out / block_out), ceil(in / block_in)]`. The name follows the checkpoint:
it is the inverse of the factor that maps the weight onto the FP8 range, that is the factor
that maps FP8 back to the weight.

Quantisation maps each block's largest magnitude onto the largest e4m3 value, 448:
`scale_inv = amax / 448` in float32 (the "amax" rule, `quantize_block_fp8`). A block of zeros
gets `scale_inv = 1`: its FP8 elements are all zero, so any scale reproduces it; a finite,
non-zero value keeps `1 / scale_inv` finite for kernels that divide by it (transformers' FP8
quantiser makes the same choice). Some quantisers round the scale up to a power of two instead
(the "power_of_two" rule, `quantize_block_fp8_power_of_two`): the largest element then maps to a
value in (224, 448]. `scale_rule` reads off which rule a stored weight's scales follow.

Accuracy of a quantise-then-dequantise round trip (round to nearest even, s = scale_inv
of the element's block): e4m3 has 3 stored mantissa bits, so an element in the normal range
(|w / s| >= 2^-6) moves by at most 2^-4 of its own magnitude; in the subnormal range the
spacing is 2^-9, so it moves by at most 2^-10 * s. Together, per element:

    |dequantize(quantize(w)) - w| <= 2^-4 * |w| + 2^-10 * s

plus float32 rounding of the scale arithmetic (a few units of 2^-24, relative).

The state-dict helpers below work on the published tensor names (section 2 of the
checkpoint spec): routed experts are
`model.language_model.layers.N.mlp.experts.E.{gate,up,down}_proj.{weight,weight_scale_inv}`,
every other tensor is dense bfloat16.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ...kernels.block_scales import FP8_DTYPE as KERNEL_FP8_DTYPE, dequantize_blocks


FP8_DTYPE = KERNEL_FP8_DTYPE
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
QUANTIZATION_METHOD = "bsgemm-moe"
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"

ROUTED_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
PER_EXPERT_WEIGHT = re.compile(
    r"^(?P<experts>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<projection>gate|up|down)_proj\.weight$"
)
FUSED_EXPERT_WEIGHT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<projection>gate_up_proj|down_proj)$")
# transformers' FP8Experts (CUDA, compute capability >= 8.9) keep the fused weights in FP8 next to
# their fused scale grids.
FUSED_EXPERT_SCALE = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<projection>gate_up_proj|down_proj)_scale_inv$")
AMAX_RULE, POWER_OF_TWO_RULE = "amax", "power_of_two"

Block = tuple[int, int]


def scale_grid_shape(weight_shape: torch.Size | tuple[int, ...], block: Block = DEFAULT_BLOCK) -> tuple[int, ...]:
    """`[..., out, in]` -> `[..., ceil(out / block_out), ceil(in / block_in)]`."""
    *leading, rows, columns = weight_shape
    return (*leading, math.ceil(rows / block[0]), math.ceil(columns / block[1]))


def quantize_block_fp8(
    weight: torch.Tensor, block: Block = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `weight: [..., out, in]` block by block.

    Returns `(weight_fp8: [..., out, in] float8_e4m3fn,
    scale_inv: [..., ceil(out / block_out), ceil(in / block_in)] float32)`.
    """
    blocks, amax = _blocks_and_amax(weight, block)
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return _scaled_to_fp8(weight, blocks, scale_inv)


def quantize_block_fp8_power_of_two(
    weight: torch.Tensor, block: Block = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_block_fp8` with each block's scale rounded up to a power of two:
    `scale_inv = 2 ** ceil(log2(amax / 448))` (zero blocks: 1). Same shapes and dtypes."""
    blocks, amax = _blocks_and_amax(weight, block)
    exact = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale_inv = torch.exp2(torch.ceil(torch.log2(exact)))
    return _scaled_to_fp8(weight, blocks, scale_inv)


def scale_rule(weight_fp8: torch.Tensor, scale_inv: torch.Tensor, block: Block = DEFAULT_BLOCK) -> str | None:
    """Which rule a stored block-FP8 weight's scales follow: "amax" when every non-zero block's
    largest FP8 magnitude is 448 (scale = amax / 448), "power_of_two" when every scale is a power
    of two, None when neither can be read off."""
    _check_pair(weight_fp8, scale_inv, block)
    _, code_amax = _blocks_and_amax(weight_fp8.float(), block)
    if bool(((code_amax == FP8_MAX) | (code_amax == 0)).all()):
        return AMAX_RULE
    if bool((torch.frexp(scale_inv.float()).mantissa == 0.5).all()):
        return POWER_OF_TWO_RULE
    return None


def quantizer_for_rule(rule: str | None) -> Callable[[torch.Tensor, Block], tuple[torch.Tensor, torch.Tensor]]:
    """The quantiser of a `scale_rule` result; the amax rule when no rule could be read off."""
    return quantize_block_fp8_power_of_two if rule == POWER_OF_TWO_RULE else quantize_block_fp8


def _blocks_and_amax(weight: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight: [..., out, in]` -> (blocks `[..., block_rows, block_out, block_columns, block_in]`
    float32, zero-padded at the edges; amax `[..., block_rows, block_columns]`)."""
    _check_block(block)
    *leading, rows, columns = weight.shape
    block_rows, block_columns = scale_grid_shape(weight.shape, block)[-2:]
    # Zero padding completes the edge blocks; zeros never raise a block's amax.
    padded = F.pad(
        weight.float(), (0, block_columns * block[1] - columns, 0, block_rows * block[0] - rows)
    )
    blocks = padded.unflatten(-1, (block_columns, block[1])).unflatten(-3, (block_rows, block[0]))
    return blocks, blocks.abs().amax(dim=(-3, -1))


def _scaled_to_fp8(
    weight: torch.Tensor, blocks: torch.Tensor, scale_inv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, columns = weight.shape[-2:]
    scaled = blocks / scale_inv[..., :, None, :, None]
    # amax / (amax / 448) can land one float32 ulp above 448, which e4m3fn cannot hold.
    weight_fp8 = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    weight_fp8 = weight_fp8.flatten(-4, -3).flatten(-2, -1)[..., :rows, :columns].contiguous()
    return weight_fp8, scale_inv.contiguous()


def dequantize_block_fp8(
    weight_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: Block = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`weight_fp8: [..., out, in]`, `scale_inv: [..., ceil(out/bo), ceil(in/bi)]` -> dense
    `[..., out, in]` in `dtype`; the product is formed in float32."""
    _check_pair(weight_fp8, scale_inv, block)
    return dequantize_blocks(weight_fp8, scale_inv, block, dtype)


def dequantize_block_fp8_reference(
    weight_fp8: torch.Tensor, scale_inv: torch.Tensor, block: Block = DEFAULT_BLOCK
) -> torch.Tensor:
    """Plain float64 dequantisation of one `[out, in]` weight, one block at a time."""
    rows, columns = weight_fp8.shape
    dense = torch.empty(rows, columns, dtype=torch.float64)
    for block_row in range(math.ceil(rows / block[0])):
        for block_column in range(math.ceil(columns / block[1])):
            row_slice = slice(block_row * block[0], (block_row + 1) * block[0])
            column_slice = slice(block_column * block[1], (block_column + 1) * block[1])
            scale = float(scale_inv[block_row, block_column])
            dense[row_slice, column_slice] = weight_fp8[row_slice, column_slice].double() * scale
    return dense


def is_block_fp8_config(quantization_config: Mapping[str, Any] | Any | None) -> bool:
    """True for the published experts' config, `{"quant_method": "bsgemm-moe", ...}`
    (a dict, or an object with a `quant_method` attribute)."""
    if quantization_config is None:
        return False
    if isinstance(quantization_config, Mapping):
        quant_method = quantization_config.get("quant_method")
    else:
        quant_method = getattr(quantization_config, "quant_method", None)
    return str(getattr(quant_method, "value", quant_method)) == QUANTIZATION_METHOD


def weight_block_size(quantization_config: Mapping[str, Any]) -> Block:
    """The `(block_out, block_in)` of a "bsgemm-moe" config; raises on any other config."""
    if not is_block_fp8_config(quantization_config):
        raise ValueError(
            f"quantization_config must have quant_method={QUANTIZATION_METHOD!r}; got {quantization_config!r}"
        )
    block = quantization_config.get("weight_block_size")
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(size, int) and size > 0 for size in block)
    ):
        raise ValueError(f"weight_block_size must be two positive integers, e.g. [128, 128]; got {block!r}")
    return (block[0], block[1])


def is_routed_expert_weight(name: str) -> bool:
    """True for `...mlp.experts.E.{gate,up,down}_proj.weight` (one routed expert's projection)."""
    return ROUTED_EXPERT_WEIGHT.search(name) is not None


def dequantize_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    block: Block = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Replace every FP8 `X.weight` that has an `X.weight_scale_inv` by its dense weight.

    Returns a new dict (same order, scale entries removed; other tensors are the same objects)
    and the names of the weights that were dequantised, in order.
    """
    dense: dict[str, torch.Tensor] = {}
    dequantized: list[str] = []
    for name, tensor in state_dict.items():
        if name.endswith(".weight" + SCALE_SUFFIX):
            weight_name = name.removesuffix(SCALE_SUFFIX)
            if weight_name not in state_dict:
                raise ValueError(f"{name!r} has no weight {weight_name!r} in the state dict")
            continue
        scale_name = name + SCALE_SUFFIX
        if scale_name in state_dict:
            if tensor.dtype != FP8_DTYPE:
                raise ValueError(f"{name!r} has a {scale_name!r} but is {tensor.dtype}, expected {FP8_DTYPE}")
            dense[name] = dequantize_block_fp8(tensor, state_dict[scale_name], block, dtype)
            dequantized.append(name)
        elif tensor.dtype == FP8_DTYPE:
            raise ValueError(f"{name!r} is {FP8_DTYPE} but the state dict has no {scale_name!r}")
        else:
            dense[name] = tensor
    return dense, dequantized


def quantize_state_dict(
    state_dict: Mapping[str, torch.Tensor],
    predicate: Callable[[str], bool] = is_routed_expert_weight,
    block: Block = DEFAULT_BLOCK,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The inverse of `dequantize_state_dict`: every `X.weight` whose name satisfies `predicate`
    becomes FP8, followed by its `X.weight_scale_inv`.

    Returns a new dict and the names of the weights that were quantised, in order.
    """
    quantized_state: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    for name, tensor in state_dict.items():
        if not predicate(name):
            quantized_state[name] = tensor
            continue
        if not name.endswith(".weight") or not tensor.is_floating_point() or tensor.dtype == FP8_DTYPE:
            raise ValueError(f"{name!r} ({tensor.dtype}) is not a dense floating-point `.weight` to quantise")
        quantized_state[name], quantized_state[name + SCALE_SUFFIX] = quantize_block_fp8(tensor, block)
        quantized.append(name)
    return quantized_state, quantized


def fuse_expert_weights(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Published per-expert projections -> transformers' fused `Qwen3_5MoeExperts` parameters.

    For every `P = ...mlp.experts` with `P.E.gate_proj.weight, P.E.up_proj.weight: [I, H]` and
    `P.E.down_proj.weight: [H, I]` for E = 0..num_experts-1:

        P.gate_up_proj: [num_experts, 2 * I, H]  rows [gate | up]  (the forward chunks gate first)
        P.down_proj:    [num_experts, H, I]

    The fused entries take the place of the expert's first per-expert entry; other tensors pass
    through. Dense weights only: dequantise an FP8 state dict first.
    """
    groups: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        if name.endswith(".weight" + SCALE_SUFFIX) and PER_EXPERT_WEIGHT.match(name.removesuffix(SCALE_SUFFIX)):
            raise ValueError(f"{name!r}: fuse_expert_weights takes dense weights; dequantize_state_dict first")
        match = PER_EXPERT_WEIGHT.match(name)
        if match:
            groups.setdefault(match["experts"], {})[(int(match["expert"]), match["projection"])] = tensor

    fused: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        match = PER_EXPERT_WEIGHT.match(name)
        if match is None:
            fused[name] = tensor
            continue
        experts = match["experts"]
        if experts + ".gate_up_proj" in fused:
            continue
        projections = groups[experts]
        num_experts = _complete_expert_count(experts, projections)
        fused[experts + ".gate_up_proj"] = torch.stack(
            [torch.cat([projections[(e, "gate")], projections[(e, "up")]]) for e in range(num_experts)]
        )
        fused[experts + ".down_proj"] = torch.stack([projections[(e, "down")] for e in range(num_experts)])
    return fused


def split_expert_weights(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_expert_weights`: `P.gate_up_proj: [E, 2I, H]` and
    `P.down_proj: [E, H, I]` -> `P.e.{gate,up,down}_proj.weight` for e = 0..E-1 (expert-major,
    gate, up, down). The per-expert tensors are copies, so they can be saved with safetensors.

    FP8 experts (transformers' `FP8Experts`) also carry `P.gate_up_proj_scale_inv:
    [E, 2 ceil(I/bo), ceil(H/bi)]` and `P.down_proj_scale_inv`; each expert's weight is then
    followed by its own `weight_scale_inv` grid.
    """
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        match = FUSED_EXPERT_WEIGHT.match(name) or FUSED_EXPERT_SCALE.match(name)
        if match:
            suffix = SCALE_SUFFIX if name.endswith(SCALE_SUFFIX) else ""
            fused.setdefault(match["experts"], {})[match["projection"] + suffix] = tensor

    split: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        match = FUSED_EXPERT_WEIGHT.match(name) or FUSED_EXPERT_SCALE.match(name)
        if match is None:
            split[name] = tensor
            continue
        experts = match["experts"]
        if f"{experts}.0.gate_proj.weight" in split:
            continue
        for per_expert_name, part in expert_projections(experts, fused[experts]):
            split[per_expert_name] = part.clone()
    return split


def expert_projections(experts: str, fused: Mapping[str, torch.Tensor]):
    """Yield `(P.e.{gate,up,down}_proj.weight[_scale_inv], view)` for the fused parameters of one
    experts module `P` (`gate_up_proj`, `down_proj`, and their `_scale_inv` grids when FP8), in the
    published order: expert-major, gate, up, down, each weight followed by its scales. The views
    share the fused storage."""
    gate_up, down = _fused_pair(experts, fused)
    intermediate = gate_up.shape[1] // 2
    scales = _fused_scales(experts, fused)
    for expert in range(gate_up.shape[0]):
        parts = {
            "gate_proj": gate_up[expert, :intermediate],
            "up_proj": gate_up[expert, intermediate:],
            "down_proj": down[expert],
        }
        for projection, weight in parts.items():
            yield f"{experts}.{expert}.{projection}.weight", weight
            if scales is not None:
                yield f"{experts}.{expert}.{projection}.weight{SCALE_SUFFIX}", scales[projection][expert]


def _fused_scales(
    experts: str, fused: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """Per-projection views of the fused scale grids, or None for dense experts."""
    gate_up_scale = fused.get("gate_up_proj" + SCALE_SUFFIX)
    down_scale = fused.get("down_proj" + SCALE_SUFFIX)
    if gate_up_scale is None and down_scale is None:
        return None
    if gate_up_scale is None or down_scale is None or gate_up_scale.shape[1] % 2:
        raise ValueError(
            f"{experts}: FP8 experts need gate_up_proj_scale_inv [E, 2 ceil(I/block), ceil(H/block)] and "
            f"down_proj_scale_inv; got {None if gate_up_scale is None else tuple(gate_up_scale.shape)} and "
            f"{None if down_scale is None else tuple(down_scale.shape)}"
        )
    # transformers fuses the gate and up grids by concatenation, so each half is one projection's grid.
    rows = gate_up_scale.shape[1] // 2
    return {"gate_proj": gate_up_scale[:, :rows], "up_proj": gate_up_scale[:, rows:], "down_proj": down_scale}


def _check_block(block: Block) -> None:
    if len(block) != 2 or not all(isinstance(size, int) and size > 0 for size in block):
        raise ValueError(f"block must be two positive integers (block_out, block_in); got {block!r}")


def _check_pair(weight_fp8: torch.Tensor, scale_inv: torch.Tensor, block: Block) -> None:
    _check_block(block)
    if weight_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"weight_fp8 must be {FP8_DTYPE}; got {weight_fp8.dtype}")
    expected = scale_grid_shape(weight_fp8.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv for a weight of shape {tuple(weight_fp8.shape)} with block {tuple(block)} must have "
            f"shape {expected}; got {tuple(scale_inv.shape)}"
        )


def _complete_expert_count(experts: str, projections: Mapping[tuple[int, str], torch.Tensor]) -> int:
    num_experts = 1 + max(expert for expert, _ in projections)
    missing = [
        f"{expert}.{projection}_proj"
        for expert in range(num_experts)
        for projection in ("gate", "up", "down")
        if (expert, projection) not in projections
    ]
    if missing:
        raise ValueError(f"{experts} lacks {len(missing)} expert projections, e.g. {missing[:4]}")
    return num_experts


def _fused_pair(experts: str, fused: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if not {"gate_up_proj", "down_proj"} <= set(fused):
        raise ValueError(f"{experts} needs both gate_up_proj and down_proj; got {sorted(fused)}")
    gate_up, down = fused["gate_up_proj"], fused["down_proj"]
    if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[1] % 2 or gate_up.shape[0] != down.shape[0]:
        raise ValueError(
            f"{experts}: expected gate_up_proj [E, 2I, H] and down_proj [E, H, I]; got "
            f"{tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    return gate_up, down


def expert_as_stored(
    name: str, weight: torch.Tensor, record, block: Block
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """One routed expert weight `[out, in]` as block-FP8: `(weight_fp8, scale_inv, quantized)`;
    `record`: the model's `LoadedCheckpoint` (its `kept` FP8 bytes and scales), or None.

    The kept FP8 bytes and scales while the weight is what loading made of them; otherwise the
    weight quantised (quantized=True) with the rule its loaded scales follow, amax / 448 if none.
    """
    weight = weight.detach()
    kept_weight = None if record is None else record.kept.get(name)
    kept_scale = None if record is None else record.kept.get(name + SCALE_SUFFIX)
    rule = None
    if kept_weight is not None and kept_scale is not None and kept_weight.dtype == FP8_DTYPE:
        if kept_weight.shape == weight.shape:
            loaded = dequantize_block_fp8(kept_weight, kept_scale, block, dtype=weight.dtype)
            if torch.equal(loaded, weight.cpu()):
                return kept_weight, kept_scale, False
        rule = scale_rule(kept_weight, kept_scale, block)
    weight_fp8, scale_inv = quantizer_for_rule(rule)(weight, block)
    return weight_fp8, scale_inv, True
