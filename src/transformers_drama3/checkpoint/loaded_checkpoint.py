"""What a model was loaded from, and the published-layout tensors that write it back unchanged.

A published checkpoint stores most tensors in bfloat16, `linear_attn.A_log` in float32 and the
routed experts in block-FP8 (`weight` e4m3 + float32 `weight_scale_inv`). A loaded model computes
in one dtype with fused experts, dense on a CPU, so its state dict alone cannot give those bytes
back: dequantisation drops the FP8 codes and scales, and a float32 tensor loaded in bfloat16 has
lost bits. `LoadedCheckpoint` records every stored tensor's name, dtype and shard file, and keeps,
byte for byte on the CPU, only the stored tensors that the compute weights cannot reproduce:

- a routed expert's FP8 weight and scales when the model holds that expert dense (on a GPU with
  FP8 kernels transformers keeps the experts in FP8: nothing is kept);
- a dense tensor stored in a dtype the compute dtype narrows (float32 `A_log` in a bf16 model);
- a stored tensor the model deliberately does not load (`_keys_to_ignore_on_load_unexpected`,
  e.g. `mtp.*`), written back as loaded. Other names the model does not hold (a checkpoint read
  through a `key_mapping`) are only listed.

A tensor stored in the compute dtype, or in one the compute dtype widens exactly (bf16 stored,
float32 compute), needs nothing: casting back returns its bytes.

`published_state_dict` writes each tensor in its stored dtype. A kept tensor is written as loaded
while the compute weight still equals what loading made of it (the FP8 bytes dequantised in
float32 and cast to the compute dtype, as transformers' loader and `dequantize_block_fp8` do; a
dense tensor cast); otherwise it changed and is written from the compute weight: a routed expert
re-quantised with the scale rule read off its loaded scales (`scale_rule`; amax / 448 when none
can be read off), a dense tensor cast to its stored dtype.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from .quantization.block_fp8 import (
    FP8_DTYPE,
    FUSED_EXPERT_SCALE,
    FUSED_EXPERT_WEIGHT,
    SCALE_SUFFIX,
    Block,
    expert_as_stored,
    expert_projections,
    is_routed_expert_weight,
)

# safetensors' dtype names (`safe_open(...).get_slice(name).get_dtype()`).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# (stored, compute) pairs whose cast back to the stored dtype returns the stored bytes.
EXACT_WIDENINGS = {
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64), (torch.float16, torch.float64), (torch.float32, torch.float64),
}
# The published layout keeps the Gated DeltaNet decay parameter in float32 whatever the rest is.
FLOAT32_PARAMETER_SUFFIXES = (".linear_attn.A_log",)


@dataclass
class LoadedCheckpoint:
    """The tensors of the checkpoint a model was loaded from (published names).

    dtypes: every stored tensor's dtype, in file order. shards: each stored tensor's file name
    (empty for a one-file checkpoint). kept: the stored tensors the compute weights cannot
    reproduce, as loaded (CPU).
    """

    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    shards: dict[str, str] = field(default_factory=dict)
    kept: dict[str, torch.Tensor] = field(default_factory=dict)
    # The `dtype` entries of the loaded config.json ("" = top level, else a sub-config's key), as
    # written there: loading overwrites them with the compute dtype.
    config_dtypes: dict[str, str | None] = field(default_factory=dict)

    @property
    def kept_bytes(self) -> int:
        """Memory the record holds besides the model: the kept tensors' bytes."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self.kept.values())


def record_files(
    files: Iterable[str | os.PathLike], model_state: Mapping[str, torch.Tensor], ignored: Sequence[str] = ()
) -> LoadedCheckpoint:
    """Read the record of safetensors `files` that were loaded into a model with `model_state`
    (its state dict after loading), and of the config.json beside them. `ignored`: the model's
    `_keys_to_ignore_on_load_unexpected` patterns. Only the kept tensors are read in full."""
    files = list(files)
    compute = _Holdings(model_state, ignored)
    record = LoadedCheckpoint(config_dtypes=config_dtypes(os.path.join(os.path.dirname(files[0]), "config.json")))
    for file in files:
        with safe_open(os.fspath(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                stored = _stored_dtype(handle, name)
                record.dtypes[name] = stored
                if len(files) > 1:
                    record.shards[name] = os.path.basename(file)
                if compute.keeps(name, stored):
                    record.kept[name] = handle.get_tensor(name)
    return record


def record_state_dict(
    state_dict: Mapping[str, torch.Tensor], model_state: Mapping[str, torch.Tensor], ignored: Sequence[str] = ()
) -> LoadedCheckpoint:
    """The record of a published-layout `state_dict` loaded into a model with `model_state`
    (its state dict before loading). Kept tensors are the given ones, not copies."""
    compute = _Holdings(model_state, ignored)
    record = LoadedCheckpoint()
    for name, tensor in state_dict.items():
        record.dtypes[name] = tensor.dtype
        if compute.keeps(name, tensor.dtype):
            record.kept[name] = tensor.detach().cpu()
    return record


def config_dtypes(path: str | os.PathLike) -> dict[str, str | None]:
    """The `dtype` entries of a config.json (top level: "", sub-configs by key); {} if none."""
    if not os.path.isfile(path):
        return {}
    config = json.loads(open(path, encoding="utf-8").read())
    dtypes = {"": config["dtype"]} if "dtype" in config else {}
    for key, value in config.items():
        if isinstance(value, dict) and "dtype" in value:
            dtypes[key] = value["dtype"]
    return dtypes


def compute_dtypes(model_state: Mapping[str, torch.Tensor]) -> dict[str, torch.dtype]:
    """The dtype the model holds each published tensor in: dense names as they are, fused experts
    (`P.gate_up_proj: [E, 2I, H]`, `P.down_proj`, and their FP8 scale grids) per expert."""
    dtypes: dict[str, torch.dtype] = {}
    for name, tensor in model_state.items():
        match = FUSED_EXPERT_WEIGHT.match(name) or FUSED_EXPERT_SCALE.match(name)
        if match is None:
            dtypes[name] = tensor.dtype
            continue
        suffix = ".weight" + (SCALE_SUFFIX if name.endswith(SCALE_SUFFIX) else "")
        projections = ("gate_proj", "up_proj") if match["projection"] == "gate_up_proj" else ("down_proj",)
        for expert in range(tensor.shape[0]):
            for projection in projections:
                dtypes[f"{match['experts']}.{expert}.{projection}{suffix}"] = tensor.dtype
    return dtypes


def must_keep(name: str, stored: torch.dtype, compute: Mapping[str, torch.dtype]) -> bool:
    """Whether the stored tensor `name` (dtype `stored`) cannot be rebuilt by casting the model's
    copy (dtype `compute[name]`) back: the model holds it in another dtype that is not an exact
    widening (FP8 dequantised, float32 narrowed to bf16, ...), or holds the expert weight of a
    stored `weight_scale_inv` dense."""
    held = compute.get(name)
    if held is None:
        weight = name.removesuffix(SCALE_SUFFIX)
        return _is_expert_scale(name) and compute.get(weight) not in (None, FP8_DTYPE)
    return not (held == stored or (stored, held) in EXACT_WIDENINGS)


class _Holdings(dict):
    """`compute_dtypes` of a model state, plus the names the model ignores on load."""

    def __init__(self, model_state: Mapping[str, torch.Tensor], ignored: Sequence[str]):
        super().__init__(compute_dtypes(model_state))
        self.ignored = [re.compile(pattern) for pattern in ignored]

    def keeps(self, name: str, stored: torch.dtype) -> bool:
        if name not in self and any(pattern.search(name) for pattern in self.ignored):
            return True
        return must_keep(name, stored, self)


def published_state_dict(
    model_state: Mapping[str, torch.Tensor],
    record: LoadedCheckpoint | None,
    fp8_block: Block | None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The tensors to save, in the published layout, from a model's state dict.

    fp8_block: the `weight_block_size` when routed experts are saved as block-FP8 ("bsgemm-moe"),
    None to save them dense. Returns the tensors (per-expert names; loaded order first) and the
    names of the expert weights quantised from compute weights (changed since loading, or never
    loaded in FP8). Tensors may be views of the model's parameters or the record's kept tensors.
    """
    tensors: dict[str, torch.Tensor] = {}
    quantized: list[str] = []
    fused = _fused_experts(model_state)
    for name, tensor in model_state.items():
        match = FUSED_EXPERT_WEIGHT.match(name) or FUSED_EXPERT_SCALE.match(name)
        if match is None:
            tensors[name] = dense_as_stored(name, tensor, record)
            continue
        experts = match["experts"]
        if f"{experts}.0.gate_proj.weight" in tensors:
            continue
        for expert_name, part in expert_projections(experts, fused[experts]):
            if expert_name.endswith(SCALE_SUFFIX) or part.dtype == FP8_DTYPE:
                tensors[expert_name] = part  # transformers' FP8Experts: the loaded bytes themselves
            elif fp8_block is None:
                tensors[expert_name] = dense_as_stored(expert_name, part, record)
            else:
                weight, scale, was_quantized = expert_as_stored(expert_name, part, record, fp8_block)
                tensors[expert_name], tensors[expert_name + SCALE_SUFFIX] = weight, scale
                if was_quantized:
                    quantized.append(expert_name)
    if record is not None:
        for name in record.kept:
            if name not in tensors and not _is_expert_scale(name):
                tensors[name] = record.kept[name]  # stored, but not a tensor of this model
    return _in_loaded_order(tensors, record), quantized


def dense_as_stored(name: str, tensor: torch.Tensor, record: LoadedCheckpoint | None) -> torch.Tensor:
    """A dense tensor in its stored dtype: the kept bytes while unchanged, else a cast."""
    tensor = tensor.detach()
    kept = None if record is None else record.kept.get(name)
    if kept is not None and kept.shape == tensor.shape and torch.equal(kept.to(tensor.dtype), tensor.cpu()):
        return kept
    stored = None if record is None else record.dtypes.get(name)
    if stored is None or stored == FP8_DTYPE:  # FP8 needs scales: dense experts keep their dtype
        stored = torch.float32 if name.endswith(FLOAT32_PARAMETER_SUFFIXES) else tensor.dtype
    return tensor.to(stored)


def _fused_experts(model_state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in model_state.items():
        match = FUSED_EXPERT_WEIGHT.match(name) or FUSED_EXPERT_SCALE.match(name)
        if match:
            suffix = SCALE_SUFFIX if name.endswith(SCALE_SUFFIX) else ""
            fused.setdefault(match["experts"], {})[match["projection"] + suffix] = tensor
    return fused


def _is_expert_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX) and is_routed_expert_weight(name.removesuffix(SCALE_SUFFIX))


def _in_loaded_order(tensors: dict[str, torch.Tensor], record: LoadedCheckpoint | None) -> dict[str, torch.Tensor]:
    if record is None:
        return tensors
    ordered = {name: tensors[name] for name in record.dtypes if name in tensors}
    ordered.update((name, tensor) for name, tensor in tensors.items() if name not in ordered)
    return ordered


def _stored_dtype(handle, name: str) -> torch.dtype:
    dtype = SAFETENSORS_DTYPES.get(handle.get_slice(name).get_dtype())
    return dtype if dtype is not None else handle.get_tensor(name).dtype
