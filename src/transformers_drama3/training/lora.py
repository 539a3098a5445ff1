"""LoRA presets for voice fine-tuning with PEFT.

- "light": LoRA on the backbone's attention (q/k/v/o), its Gated DeltaNet projections
  (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj), the shared expert (gate/up/down), and
  every tower linear (eh_proj, wqkv, wo, w1/w2/w3); the tower's codebook heads and the codebook
  embedding tables are trained in full (`modules_to_save`): a new voice mostly lives in its acoustic
  detail. The routed experts and the router stay frozen.
- "heavy": "light" plus LoRA on the routed experts' stacked weights through PEFT's
  `target_parameters` (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`; PEFT >= 0.17). Use it
  with gradient checkpointing: the expert adapters multiply the activation memory.

`merge_and_save` folds the adapter into the weights and writes a full checkpoint in the published
layout (per-expert tensor names, block-FP8 experts when the config says so), which engines that
read that layout (SGLang-Omni) serve as is. Tensors the adapter did not change are written byte
for byte as loaded (`save_pretrained`, docs/saving.md).
"""

from __future__ import annotations

import os

from peft import LoraConfig, PeftModel, get_peft_model

from ..layers.lora_targets import EXPERT_PARAMETERS, LIGHT_TARGET_MODULES, PRESETS, full_trained_modules  # noqa: F401


def lora_config(model, preset: str = "light", r: int = 16, alpha: int | None = None, dropout: float = 0.0) -> LoraConfig:
    """The `LoraConfig` of a preset for `model` (a `Drama3ForSpeechGeneration`)."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}; got {preset!r}")
    return LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        lora_dropout=dropout,
        target_modules=LIGHT_TARGET_MODULES,
        target_parameters=list(EXPERT_PARAMETERS) if preset == "heavy" else None,
        modules_to_save=full_trained_modules(model),
        bias="none",
    )


def apply_lora(model, preset: str = "light", r: int = 16, alpha: int | None = None, dropout: float = 0.0,
               gradient_checkpointing: bool | None = None) -> PeftModel:
    """Wrap `model` with the preset's adapters. "heavy" turns gradient checkpointing on unless
    `gradient_checkpointing=False`."""
    if gradient_checkpointing is None:
        gradient_checkpointing = preset == "heavy"
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(model, lora_config(model, preset, r, alpha, dropout))


def merge_and_save(peft_model: PeftModel, save_directory: str | os.PathLike, **save_kwargs):
    """Merge the adapter into the base weights and save a full checkpoint in the published layout.
    Returns the merged model (the adapter's base model, modified in place)."""
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(save_directory, **save_kwargs)
    return merged
