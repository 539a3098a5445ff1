"""The paper's model-size and per-frame figures, computed from the module tree.

Every count walks `named_parameters()` / `named_modules()` of a real `Drama3ForSpeechGeneration`
(built on the `meta` device, so the full-size model costs no memory) and classifies each tensor by
its name; no figure is a formula that restates config numbers. The config only supplies what a
module tree cannot: how many experts a token is routed to, and the FP8 block size of the routed
experts.

What is counted:

- **total parameters**: every parameter of the model.
- **backbone active parameters per token**: the backbone layers without their routed experts
  (attention / Gated DeltaNet, router, shared expert, norms, final norm), plus
  `num_experts_per_tok` routed experts in each layer, plus the full `lm_head`. The input embedding
  is not counted: it is a lookup, not a matrix product. The tower is not counted (it runs per
  frame, not per backbone token; it is in the per-frame figures below).
- **weights read per frame** (decimal GB), the three parts of the paper's figure:
  - backbone without routed experts, bf16: the layers and final norm as above, one row of
    `embed_tokens`, and of `lm_head` only the rows a decode step computes (the semantic band and
    eos, see `Drama3ForSpeechGeneration.speech_logits`);
  - tower, bf16: the 13 tower layers and 9 heads; of each layer's code embedding one row, and of
    `audio_decoder.codebook_embeddings` the rows of the input frame's codes 1..9 (codes 1..K are
    fused into the backbone input, K+1..9 go to the first shared layer);
  - routed experts, FP8: the `num_experts_per_tok` active experts of each layer at 1 byte per
    parameter, plus their float32 `weight_scale_inv` blocks, counted on the published layout
    (separate gate, up and down matrices per expert).
- **sequential layers after the backbone**: the tower layers a frame runs one after another.
- **layers whose KV cache grows with context**: the backbone's full-attention layers and the tower
  layers (each keeps a causal KV cache over the whole sequence); Gated DeltaNet layers keep a
  constant-size state and are not counted.

`round_trip_memory` counts what a model loaded from the published checkpoint keeps so that
`save_pretrained` writes it back byte for byte (`checkpoint/loaded_checkpoint.py`), in the same way.

`python -m transformers_drama3.placement.accounting` prints the default (full-size) model's table next to
the paper's, and that cost.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeAttention, Qwen3_5MoeGatedDeltaNet

from ..configuration_drama3 import Drama3Config
from ..checkpoint.loaded_checkpoint import FLOAT32_PARAMETER_SUFFIXES, must_keep
from ..modeling_drama3 import Drama3ForSpeechGeneration, Drama3TowerAttention

BF16_BYTES = 2
FP8_BYTES = 1
SCALE_BYTES = 4  # weight_scale_inv is float32
# The published quantization_config's weight_block_size; a "bsgemm-moe" config's own size wins.
DEFAULT_FP8_BLOCK = (128, 128)
GB = 1e9


@dataclass(frozen=True)
class PaperFigures:
    """The figures the paper states for Drama 3 (None where it states none)."""

    total_parameters: float
    active_parameters_per_token: float
    weights_read_per_frame_gb: float
    backbone_without_routed_experts_gb: float
    tower_gb: float
    sequential_layers_after_backbone: int
    growing_kv_cache_layers: int


# drama3-paper-digest.md §1 ("~35B parameters total, ... ~3B active per token") and the Drama 3
# column of the §8 table (weights read per frame and its parts, sequential layers, KV layers).
PAPER_DRAMA3 = PaperFigures(
    total_parameters=35e9,
    active_parameters_per_token=3e9,
    weights_read_per_frame_gb=6.0,
    backbone_without_routed_experts_gb=2.9,
    tower_gb=2.1,
    sequential_layers_after_backbone=13,
    growing_kv_cache_layers=23,
)

# How each parameter is classified, by its published name (first match wins).
PARAMETER_KINDS = (
    (r"^model\.language_model\.embed_tokens\.weight$", "text_embedding"),
    (r"^model\.language_model\.layers\.\d+\.mlp\.experts\.", "routed_experts"),
    (r"^model\.language_model\.(layers\.\d+\.|norm\.)", "backbone"),
    (r"^lm_head\.weight$", "lm_head"),
    (r"^audio_decoder\.codebook_embeddings\.weight$", "codebook_embeddings"),
    (r"^audio_decoder_mtp(_shared)?\.layers\.\d+\.(semantic|codebook)_embedding\.weight$", "tower_embedding"),
    (r"^audio_decoder_mtp(_shared)?\.", "tower"),
)


@dataclass(frozen=True)
class Drama3Accounting:
    """Parameter counts and per-frame weight traffic of one Drama 3 model (see the module docstring)."""

    total_parameters: int
    active_parameters_per_token: int
    backbone_parameters_per_frame: int
    tower_parameters_per_frame: int
    routed_expert_parameters_per_frame: int
    routed_expert_scales_per_frame: int
    sequential_layers_after_backbone: int
    growing_kv_cache_layers: int
    backbone_full_attention_layers: int
    backbone_linear_attention_layers: int
    active_experts_per_layer: int

    @property
    def backbone_bytes_per_frame(self) -> int:
        return self.backbone_parameters_per_frame * BF16_BYTES

    @property
    def tower_bytes_per_frame(self) -> int:
        return self.tower_parameters_per_frame * BF16_BYTES

    @property
    def routed_expert_bytes_per_frame(self) -> int:
        return self.routed_expert_parameters_per_frame * FP8_BYTES + self.routed_expert_scales_per_frame * SCALE_BYTES

    @property
    def weights_bytes_per_frame(self) -> int:
        return self.backbone_bytes_per_frame + self.tower_bytes_per_frame + self.routed_expert_bytes_per_frame


def parameter_kind(name: str) -> str:
    """The accounting class of a parameter, from its name; raises on a name it does not know."""
    for pattern, kind in PARAMETER_KINDS:
        if re.match(pattern, name):
            return kind
    raise ValueError(f"parameter {name!r} has no accounting class; add it to PARAMETER_KINDS")


def account_model(model: Drama3ForSpeechGeneration) -> Drama3Accounting:
    """Count `model`'s parameters and per-frame weight traffic from its module tree."""
    text_config = model.config.text_config
    top_k = text_config.num_experts_per_tok
    block = _fp8_block(model.config)
    lm_head_rows = model.speech_token_ids(torch.device("cpu")).numel()
    codebook_rows = model.num_codebooks - 1

    total = backbone = lm_head = embedding_row = tower = 0
    expert_params = expert_scales = 0  # of one expert in each layer, summed over layers
    for name, parameter in model.named_parameters():
        kind = parameter_kind(name)
        total += parameter.numel()
        if kind == "backbone":
            backbone += parameter.numel()
        elif kind == "routed_experts":
            params, scales = _one_expert(name, parameter.shape, block)
            expert_params += params
            expert_scales += scales
        elif kind == "lm_head":
            lm_head = parameter.numel()
            lm_head_row = parameter.shape[1]
        elif kind == "text_embedding":
            embedding_row = parameter.shape[1]
        elif kind == "codebook_embeddings":
            tower += codebook_rows * parameter.shape[1]
        elif kind == "tower_embedding":
            tower += parameter.shape[1]
        else:
            tower += parameter.numel()

    modules = list(model.modules())
    full_attention = sum(isinstance(m, Qwen3_5MoeAttention) for m in modules)
    linear_attention = sum(isinstance(m, Qwen3_5MoeGatedDeltaNet) for m in modules)
    tower_attention = sum(isinstance(m, Drama3TowerAttention) for m in modules)
    return Drama3Accounting(
        total_parameters=total,
        active_parameters_per_token=backbone + top_k * expert_params + lm_head,
        backbone_parameters_per_frame=backbone + embedding_row + lm_head_rows * lm_head_row,
        tower_parameters_per_frame=tower,
        routed_expert_parameters_per_frame=top_k * expert_params,
        routed_expert_scales_per_frame=top_k * expert_scales,
        sequential_layers_after_backbone=len(model.tower_layers),
        growing_kv_cache_layers=full_attention + tower_attention,
        backbone_full_attention_layers=full_attention,
        backbone_linear_attention_layers=linear_attention,
        active_experts_per_layer=top_k,
    )


def account(config: Drama3Config | None = None) -> Drama3Accounting:
    """Build the model for `config` (default: full-size Drama 3) on the meta device and count it."""
    with torch.device("meta"):
        model = Drama3ForSpeechGeneration(config or Drama3Config())
    return account_model(model)


@dataclass(frozen=True)
class RoundTripMemory:
    """Memory of a model loaded from the published layout (bf16, float32 `A_log`, FP8 routed
    experts) that computes in `compute_dtype` with dense experts, as on a CPU, and of the loaded
    tensors it keeps for `save_pretrained` (with FP8 experts, on a GPU with FP8 kernels, it keeps
    only the narrowed float32 tensors)."""

    compute_dtype: torch.dtype
    model_bytes: int
    kept_bytes: int
    routed_expert_parameters: int
    kept_routed_expert_bytes: int

    @property
    def overhead(self) -> float:
        """kept / model bytes."""
        return self.kept_bytes / self.model_bytes

    @property
    def kept_bytes_per_routed_expert_parameter(self) -> float:
        return self.kept_routed_expert_bytes / self.routed_expert_parameters


def round_trip_memory(config: Drama3Config | None = None, compute_dtype: torch.dtype = torch.bfloat16) -> RoundTripMemory:
    """The memory `loaded_checkpoint` keeps beside a model of `config` (default: full size), from
    its meta-device module tree and the same keep rule (`must_keep`)."""
    config = config or Drama3Config()
    with torch.device("meta"):
        model = Drama3ForSpeechGeneration(config)
    block = _fp8_block(config)
    model_bytes = kept = expert_parameters = expert_kept = 0
    element = torch.empty((), dtype=compute_dtype).element_size()
    for name, parameter in model.named_parameters():
        model_bytes += parameter.numel() * element
        if parameter_kind(name) == "routed_experts":
            params, scales = _one_expert(name, parameter.shape, block)
            expert_parameters += parameter.shape[0] * params
            expert_kept += parameter.shape[0] * (params * FP8_BYTES + scales * SCALE_BYTES)
            continue
        stored = torch.float32 if name.endswith(FLOAT32_PARAMETER_SUFFIXES) else torch.bfloat16
        if must_keep(name, stored, {name: compute_dtype}):
            kept += parameter.numel() * torch.empty((), dtype=stored).element_size()
    return RoundTripMemory(compute_dtype, model_bytes, kept + expert_kept, expert_parameters, expert_kept)


def format_round_trip(memory: RoundTripMemory) -> str:
    return (
        f"kept for a byte-faithful save ({str(memory.compute_dtype).removeprefix('torch.')} compute, dense experts): "
        f"{memory.kept_bytes / GB:.2f} GB beside {memory.model_bytes / GB:.2f} GB of weights "
        f"(+{100 * memory.overhead:.0f}%; {memory.kept_bytes_per_routed_expert_parameter:.5f} bytes per routed expert parameter)"
    )


def format_table(accounting: Drama3Accounting, paper: PaperFigures = PAPER_DRAMA3) -> str:
    """The computed figures beside the paper's, one per line."""
    a = accounting
    layers = a.backbone_full_attention_layers + a.backbone_linear_attention_layers
    experts = f"{a.active_experts_per_layer} routed experts x {layers} layers (FP8)"
    rows = [
        ("total parameters", f"{a.total_parameters / 1e9:.2f} B", f"~{paper.total_parameters / 1e9:g} B"),
        ("backbone active parameters per token", f"{a.active_parameters_per_token / 1e9:.2f} B",
         f"~{paper.active_parameters_per_token / 1e9:g} B"),
        ("weights read per frame", f"{a.weights_bytes_per_frame / GB:.2f} GB",
         f"~{paper.weights_read_per_frame_gb} GB"),
        ("  backbone without routed experts (bf16)", f"{a.backbone_bytes_per_frame / GB:.2f} GB",
         f"{paper.backbone_without_routed_experts_gb} GB"),
        ("  Codebook-MTP tower (bf16)", f"{a.tower_bytes_per_frame / GB:.2f} GB", f"{paper.tower_gb} GB"),
        (f"  {experts}", f"{a.routed_expert_bytes_per_frame / GB:.2f} GB", "-"),
        ("sequential layers after the backbone", str(a.sequential_layers_after_backbone),
         str(paper.sequential_layers_after_backbone)),
        ("layers whose KV cache grows with context", str(a.growing_kv_cache_layers),
         str(paper.growing_kv_cache_layers)),
    ]
    header = ("figure", "computed", "paper (Drama 3)")
    width = max(len(row[0]) for row in (header, *rows))
    lines = [f"{header[0]:<{width}}  {header[1]:>10}  {header[2]:>15}"]
    lines += [f"{label:<{width}}  {computed:>10}  {stated:>15}" for label, computed, stated in rows]
    return "\n".join(lines)


def main() -> None:
    """Print the full-size model's table next to the paper's."""
    print(format_table(account()))
    for dtype in (torch.bfloat16, torch.float32):
        print(format_round_trip(round_trip_memory(compute_dtype=dtype)))


def _fp8_block(config: Drama3Config) -> tuple[int, int]:
    published = config.published_quantization_config or {}
    return tuple(published.get("weight_block_size", DEFAULT_FP8_BLOCK))


def _one_expert(name: str, shape: torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    """Parameters and float32 scales of one expert of a fused `[experts, out, in]` tensor.

    transformers fuses each expert's gate and up matrices into `gate_up_proj` (gate rows first);
    the published checkpoint stores them, and their scale grids, separately.
    """
    if len(shape) != 3:
        raise ValueError(f"routed expert tensor {name!r} has shape {tuple(shape)}; expected [experts, out, in]")
    _, out, inp = shape
    matrices = [(out // 2, inp)] * 2 if name.endswith("gate_up_proj") else [(out, inp)]
    scales = sum(math.ceil(rows / block[0]) * math.ceil(cols / block[1]) for rows, cols in matrices)
    return out * inp, scales


if __name__ == "__main__":
    main()
