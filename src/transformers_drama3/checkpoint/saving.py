"""`save_pretrained` / `push_to_hub` of a Drama 3 model in the published layout.

`save_model` is what `Drama3ForSpeechGeneration.save_pretrained` does: the published layout
through `save_published`, or transformers' own writer for what only it does (adapters, variants,
distributed or offloaded models), with the routed experts quantised afresh after it.

The folder holds `config.json` (the model's config with `dtype` set to the dtype the weights are
stored in, `architectures` and the published `quantization_config` kept), `generation_config.json`
and the weights (`loaded_checkpoint.published_state_dict`, written by `writer`). An
untouched model loaded from a published checkpoint saves the tensors it was loaded from, byte for
byte, into the same shard files.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping

import torch
from transformers.utils import logging

from ..integrations import start_hub_upload
from .loaded_checkpoint import published_state_dict
from .quantization import quantize_saved_experts
from .quantization.block_fp8 import DEFAULT_BLOCK, FP8_DTYPE, SCALE_SUFFIX
from .quantization.quantized_loading import check_saveable, weight_quantizer
from .writer import shard_layout, write_checkpoint

logger = logging.get_logger(__name__)


def save_model(
    model,
    save_directory,
    transformers_save_pretrained: Callable[..., None],
    *,
    is_main_process: bool = True,
    state_dict=None,
    push_to_hub: bool = False,
    max_shard_size: int | str = "50GB",
    variant: str | None = None,
    token=None,
    save_peft_format: bool = True,
    save_original_format: bool = True,
    **kwargs,
) -> list[str]:
    """`model.save_pretrained(save_directory, ...)` (see `Drama3ForSpeechGeneration.save_pretrained`);
    `transformers_save_pretrained` is transformers' own `save_pretrained` bound to `model`. Returns
    the routed expert weights quantised from the model's weights (none through transformers' writer)."""
    check_saveable(model)
    if needs_transformers_writer(model, variant, save_original_format, kwargs):
        transformers_save_pretrained(
            save_directory, is_main_process=is_main_process, state_dict=state_dict, push_to_hub=push_to_hub,
            max_shard_size=max_shard_size, variant=variant, token=token, save_peft_format=save_peft_format,
            save_original_format=save_original_format, **kwargs,
        )
        if model.config.is_block_fp8 and is_main_process and not getattr(model, "_hf_peft_config_loaded", False):
            quantize_saved_experts(save_directory, fp8_block(model.config))
        return []
    if os.path.isfile(save_directory):
        raise ValueError(f"save_directory must be a directory; {os.fspath(save_directory)!r} is a file")
    if not is_main_process:
        return []
    os.makedirs(save_directory, exist_ok=True)
    upload = start_hub_upload(model, save_directory, token, kwargs) if push_to_hub else None
    quantized = save_published(model, save_directory, state_dict, max_shard_size)
    if upload is not None:
        upload()
    return quantized


def needs_transformers_writer(model, variant: str | None, save_original_format: bool, kwargs: Mapping) -> bool:
    """Whether the save is one only transformers' writer does: adapter-only (PEFT), a `variant`,
    `save_original_format=False`, a distributed checkpoint, a model sharded by transformers'
    `distributed_config` or offloaded by a device map, a model whose weights torchao or
    bitsandbytes quantised (their own serialisation; `quantization.quantized_loading`)."""
    offloaded = {"cpu", "disk"} & set((getattr(model, "hf_device_map", None) or {}).values())
    return bool(
        getattr(model, "_hf_peft_config_loaded", False)
        or weight_quantizer(getattr(model.config, "quantization_config", None)) is not None
        or variant is not None
        or not save_original_format
        or kwargs.get("distributed_checkpoint")
        or offloaded
        or getattr(model.config, "distributed_config", None) is not None
    )


def fp8_block(config) -> tuple[int, int]:
    """The block size of the routed experts' block-FP8 weights the config records."""
    return tuple(config.published_quantization_config.get("weight_block_size", DEFAULT_BLOCK))


def save_published(
    model, directory: str | os.PathLike, state_dict: Mapping[str, torch.Tensor] | None, max_shard_size: int | str
) -> list[str]:
    """Write `model` (or its `state_dict`) to `directory` in the published layout. Returns the
    routed expert weights quantised from compute weights (changed since loading)."""
    block = fp8_block(model.config) if model.config.is_block_fp8 else None
    state = model.state_dict() if state_dict is None else state_dict
    record = model.loaded_checkpoint
    tensors, quantized = published_state_dict(state, record, block)
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
