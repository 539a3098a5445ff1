"""A device map that splits Drama 3 over several devices (pipeline split of the backbone) for
`from_pretrained(device_map=...)`.

The decode step reads some weights outside their module's `forward`: the semantic band of
`lm_head.weight` (`speech_logits`), the codebook table of `audio_decoder` and the tower's heads.
accelerate's hooks move weights and inputs only around a module's `forward`, so these modules must
sit, whole, on the device that runs the step, never offloaded; `device_map="auto"` does not know
that (offloading `lm_head` to disk gave other greedy frames in a test). `speech_device_map` keeps
every module but the backbone's decoder layers on the first device of `max_memory` and fills the
decoder layers into the devices in order (the hooks carry the hidden states from one to the next):

    device_map = speech_device_map("fishaudio/drama-3", {0: "60GiB", 1: "80GiB"}, dtype=torch.bfloat16)
    model = AutoModel.from_pretrained("fishaudio/drama-3", dtype=torch.bfloat16, device_map=device_map)

A "cpu" or "disk" entry of `max_memory` offloads the decoder layers that do not fit the devices
before it (pass `offload_folder=` for "disk").
"""

from __future__ import annotations

import torch
from accelerate import init_empty_weights
from accelerate.utils import compute_module_sizes, convert_file_size_to_int

from ..configuration_drama3 import Drama3Config
from ..modeling_drama3 import Drama3ForSpeechGeneration

BACKBONE_LAYERS = "model.language_model.layers"


def speech_device_map(
    model_or_config, max_memory: dict, dtype: torch.dtype | None = None
) -> dict[str, int | str]:
    """Module name -> device for `from_pretrained(device_map=...)`.

    Args:
        model_or_config: a `Drama3Config`, or a checkpoint folder / Hub id to read it from.
        max_memory: device -> bytes (or "40GiB"), in the order to fill; the first device holds
            everything but the backbone's decoder layers.
        dtype: the dtype the weights will be loaded in (default: the config's, else float32).
    """
    config = model_or_config if isinstance(model_or_config, Drama3Config) else Drama3Config.from_pretrained(model_or_config)
    if not max_memory:
        raise ValueError("max_memory must name at least one device, e.g. {0: '70GiB', 1: '70GiB'}")
    with init_empty_weights():
        model = Drama3ForSpeechGeneration(config)
    dtype = dtype or (config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32)
    sizes = compute_module_sizes(model, dtype=dtype)
    devices = list(max_memory)
    budget = {device: convert_file_size_to_int(size) if isinstance(size, str) else int(size)
              for device, size in max_memory.items()}

    layers = [f"{BACKBONE_LAYERS}.{i}" for i in range(len(model.backbone.layers))]
    rest = sizes[""] - sum(sizes[name] for name in layers)
    main = devices[0]
    if rest > budget[main]:
        raise ValueError(
            f"max_memory[{main!r}] is {budget[main]} bytes; the modules kept on the first device (embeddings, "
            f"lm_head, codebook tables, tower) need {rest} bytes in {dtype}"
        )
    budget[main] -= rest
    device_map: dict[str, int | str] = {}
    for name, _ in model.named_children():
        if name != "model":
            device_map[name] = main
    for name, _ in model.backbone.named_children():
        if name != "layers":
            device_map[f"model.language_model.{name}"] = main
    position = 0
    for name in layers:
        while position < len(devices) and sizes[name] > budget[devices[position]]:
            position += 1
        if position == len(devices):
            raise ValueError(
                f"max_memory is too small: decoder layer {name} ({sizes[name]} bytes in {dtype}) fits in none of "
                f"{devices} after the layers before it; add a device, or 'cpu' / 'disk' to offload"
            )
        device_map[name] = devices[position]
        budget[devices[position]] -= sizes[name]
    return device_map
