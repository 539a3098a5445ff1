"""Block-FP8 routed experts in saved checkpoint files."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from .block_fp8 import DEFAULT_BLOCK, is_routed_expert_weight, quantize_state_dict

INDEX_NAME = "model.safetensors.index.json"


def quantize_saved_experts(directory: str | Path, block: tuple[int, int] = DEFAULT_BLOCK) -> list[str]:
    """Rewrite the safetensors shards in `directory` with every routed expert weight in block-FP8
    (plus its `weight_scale_inv`), as the published checkpoint stores them. Returns the names
    quantised. The shard index, when there is one, gains the scale names and its new total size.

    Every expert is quantised afresh (amax / 448): this builds a block-FP8 checkpoint from a dense
    one. A model loaded from block-FP8 experts saves its own bytes through `save_pretrained`.
    """
    directory = Path(directory)
    quantised: list[str] = []
    index_path = directory / INDEX_NAME
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for shard in sorted(directory.glob("*.safetensors")):
        tensors = load_file(shard)
        if not any(is_routed_expert_weight(name) for name in tensors):
            continue
        converted, names = quantize_state_dict(tensors, is_routed_expert_weight, block)
        save_file({k: v.contiguous() for k, v in converted.items()}, shard, metadata={"format": "pt"})
        quantised.extend(names)
        if index is not None:
            for name in names:
                index["weight_map"][name + "_scale_inv"] = shard.name
    if index is not None:
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index.setdefault("metadata", {})["total_size"] = sum(
            tensor.numel() * tensor.element_size()
            for shard in sorted(directory.glob("*.safetensors"))
            for tensor in load_file(shard).values()
        )
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    return quantised
