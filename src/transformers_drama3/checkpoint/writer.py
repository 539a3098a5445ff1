"""Write a state dict as safetensors shards + index, the way transformers names them, without
ever leaving a half-written file: each file is written beside its target and renamed over it.

Shards: a model loaded from several shards saves into the same files (same names, same tensors
in each) as long as every one of them fits `max_shard_size`; otherwise, and for a model loaded
from one file, tensors fill shards in order up to `max_shard_size` (one tensor larger than that
gets a shard of its own), named `model.safetensors` or `model-0000i-of-0000n.safetensors`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.utils.hub import convert_file_size_to_int

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def shard_layout(
    tensors: Mapping[str, torch.Tensor], max_shard_size: int | str, loaded_shards: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """File name -> tensor names, in order. `loaded_shards` (tensor name -> file name) is the layout
    the model was loaded from; tensors it does not name join its last file."""
    limit = convert_file_size_to_int(max_shard_size)
    if loaded_shards:
        files = list(dict.fromkeys(loaded_shards.values()))
        layout: dict[str, list[str]] = {file: [] for file in files}
        for name in tensors:
            layout[loaded_shards.get(name, files[-1])].append(name)
        layout = {file: names for file, names in layout.items() if names}
        if all(sum(tensor_bytes(tensors[n]) for n in names) <= limit for names in layout.values()):
            return layout
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor_bytes(tensor) > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensor_bytes(tensor)
    if len(shards) == 1:
        return {WEIGHTS_NAME: shards[0]}
    return {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": names for i, names in enumerate(shards)}


def write_checkpoint(
    directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor], layout: Mapping[str, list[str]]
) -> None:
    """Write `tensors` into the files of `layout` (and the index when there are several), then
    remove weight files of an earlier save in `directory` that this save does not rewrite."""
    directory = Path(directory)
    for file, names in layout.items():
        shard = {name: _owned(tensors[name]) for name in names}
        _atomic_write(directory / file, lambda path: save_file(shard, path, metadata={"format": "pt"}))
        del shard
    sharded = len(layout) > 1
    if sharded:
        index = {
            "metadata": {"total_size": sum(tensor_bytes(tensors[name]) for name in tensors)},
            "weight_map": {name: file for file, names in layout.items() for name in sorted(names)},
        }
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        _atomic_write(directory / INDEX_NAME, lambda path: Path(path).write_text(text))
    for stale in directory.iterdir():
        is_weights = stale.name == WEIGHTS_NAME or SHARD_NAME.fullmatch(stale.name)
        if (is_weights and stale.name not in layout) or (stale.name == INDEX_NAME and not sharded):
            stale.unlink()


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its whole storage (safetensors refuses views into a shared one)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.untyped_storage().nbytes() != tensor_bytes(tensor) or tensor.storage_offset():
        tensor = tensor.clone()
    return tensor


def _atomic_write(path: Path, write: Callable[[str], None]) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(temporary)
        os.chmod(temporary, 0o644)  # mkstemp makes the file private; a checkpoint is shared
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
