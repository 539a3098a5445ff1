"""The codec saved beside a processor: `codec/` (written by `save_pretrained`, any codec
registered with `AutoConfig` and `AutoModel`) or the published `codec.pth` (the S2 codec)."""

from __future__ import annotations

import json
import os

from transformers import AutoConfig, AutoModel

from ..codec import Drama3CodecConfig, Drama3CodecModel, Drama3MelCodecConfig, Drama3PhoneCodecConfig
from ..integrations import hub_keywords, optional_file

# The codecs of this package; a codec of another model_type loads once registered with
# AutoConfig and AutoModel (it needs the interface the processor uses: `encode` returning
# `audio_codes` + `lengths`, `decode` returning `audio_values`, `num_codebooks`, `sampling_rate`,
# `frame_rate`).
PACKAGE_CODECS = (Drama3CodecConfig.model_type, Drama3MelCodecConfig.model_type, Drama3PhoneCodecConfig.model_type)


def codec_beside(path: str | os.PathLike, kwargs: dict):
    """The codec saved beside a processor (`codec/`, loaded through `AutoModel`), or the published
    `codec.pth` (the S2 codec); None if neither."""
    hub = hub_keywords(kwargs)
    config_file = optional_file(path, "codec/config.json", **hub)
    if config_file is not None:
        return load_saved_codec(path, config_file, hub)
    checkpoint = optional_file(path, "codec.pth", **hub)
    if checkpoint is not None:
        return Drama3CodecModel.from_pretrained(checkpoint)
    return None


def load_saved_codec(path: str | os.PathLike, config_file: str, hub: dict):
    """The codec in the `codec/` subfolder of `path` (a folder or Hub repo), built by `AutoModel`
    from the model_type of its config.json."""
    check_codec_model_type(config_file)
    if os.path.isdir(path):
        return AutoModel.from_pretrained(os.path.join(path, "codec"))
    return AutoModel.from_pretrained(path, subfolder="codec", **hub)


def check_codec_model_type(config_file: str) -> None:
    """A saved codec's config.json names a model_type that AutoConfig knows."""
    with open(config_file, encoding="utf-8") as reader:
        model_type = json.load(reader).get("model_type")
    try:
        AutoConfig.for_model(model_type)
    except ValueError:
        raise ValueError(
            f"{config_file}: codec model_type {model_type!r} is not a known codec; known: {sorted(PACKAGE_CODECS)} "
            f"(or any codec registered with transformers' AutoConfig.register and AutoModel.register)"
        ) from None
