"""fish-speech `codec.pth` -> Hugging Face folder (config.json + model.safetensors).

Command line: `python -m transformers_drama3.codec.convert codec.pth OUT_DIR [--config config.json]`.
The file format and the name mapping live in `codec.fish_speech`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .configuration_codec import Drama3CodecConfig
from .fish_speech import (  # noqa: F401  (the format's functions, also reachable from here)
    CheckpointReadError,
    from_fish_speech_key,
    load_fish_speech_codec,
    read_fish_speech_state_dict,
    to_fish_speech_key,
    to_fish_speech_state_dict,
)
from .modeling_codec import Drama3CodecModel


def convert_codec_checkpoint(src_pth, out_dir, config: Drama3CodecConfig | None = None) -> Path:
    """Write fish-speech's `codec.pth` at `src_pth` as a Hugging Face folder (config.json +
    model.safetensors) at `out_dir`; returns `out_dir`."""
    model = load_fish_speech_codec(Drama3CodecModel, src_pth, config=config)
    # Loaded tensors may be memory-mapped views of the .pth; give safetensors plain copies.
    for parameter in model.parameters():
        parameter.data = parameter.data.clone()
    model.save_pretrained(out_dir)
    return Path(out_dir)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Convert fish-speech's codec.pth to a Hugging Face folder.")
    parser.add_argument("src", help="codec.pth (plain or {'state_dict': {'generator.*': ...}})")
    parser.add_argument("out", help="output folder (config.json + model.safetensors)")
    parser.add_argument("--config", help="config.json of the codec's sizes (default: the published codec)")
    arguments = parser.parse_args(argv)
    config = Drama3CodecConfig.from_json_file(arguments.config) if arguments.config else None
    print(convert_codec_checkpoint(arguments.src, arguments.out, config=config))


if __name__ == "__main__":
    main()
