"""`save_pretrained` / `push_to_hub` of a Drama 3 model in the published layout.

The folder holds `config.json` (the model's config with `dtype` set to the dtype the weights are
stored in, `architectures` and the published `quantization_config` kept), `generation_config.json`
and the weights (`loaded_checkpoint.published_state_dict`, written by `checkpoint_writer`). An
untouched model loaded from a published checkpoint saves the tensors it was loaded from, byte for
byte, into the same shard files.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping

import torch
from transformers.utils import logging

from .checkpoint_writer import shard_layout, write_checkpoint
from .loaded_checkpoint import published_state_dict
from .quantization.block_fp8 import DEFAULT_BLOCK, FP8_DTYPE, SCALE_SUFFIX

logger = logging.get_logger(__name__)


def save_published(
    model, directory: str | os.PathLike, state_dict: Mapping[str, torch.Tensor] | None, max_shard_size: int | str
) -> list[str]:
    """Write `model` (or its `state_dict`) to `directory` in the published layout. Returns the
    routed expert weights quantised from compute weights (changed since loading)."""
    fp8_block = None
    if model.config.is_block_fp8:
        fp8_block = tuple(model.config.published_quantization_config.get("weight_block_size", DEFAULT_BLOCK))
    state = model.state_dict() if state_dict is None else state_dict
    record = model.loaded_checkpoint
    tensors, quantized = published_state_dict(state, record, fp8_block)
    published_config(model.config, tensors, record.config_dtypes if record else {}).save_pretrained(directory)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    write_checkpoint(directory, tensors, shard_layout(tensors, max_shard_size, record.shards if record else None))
    if quantized:
        logger.info(f"re-quantised {len(quantized)} routed expert weights (changed since loading): {quantized}")
    return quantized


def published_config(config, tensors: Mapping[str, torch.Tensor], loaded_dtypes: Mapping[str, str | None]):
    """A copy of `config` whose `dtype` entries are the loaded config.json's (`loaded_dtypes`, see
    `LoadedCheckpoint.config_dtypes`), else, at the top level, the dtype the weights are stored in."""
    saved = copy.deepcopy(config)
    saved.dtype = loaded_dtypes.get("", stored_dtype(tensors))
    for key in saved.sub_configs:
        if key in loaded_dtypes and getattr(saved, key, None) is not None:
            getattr(saved, key).dtype = loaded_dtypes[key]
    return saved


def stored_dtype(tensors: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype holding the most elements among the dense tensors (FP8 weights and
    their scales excluded): bfloat16 for the published checkpoint."""
    elements: dict[torch.dtype, int] = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and tensor.dtype != FP8_DTYPE and not name.endswith(SCALE_SUFFIX):
            elements[tensor.dtype] = elements.get(tensor.dtype, 0) + tensor.numel()
    return max(elements, key=elements.get)
