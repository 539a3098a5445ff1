"""fish-speech's `codec.pth`: reading it safely and its parameter names <-> ours.

The published file is a float32 state dict in fish-speech's module layout (535 tensors for the
published sizes), sometimes wrapped as `{"state_dict": {"generator." + key: tensor, ...}}` with
the training discriminator beside it. Our modules carry fish-speech's names, so the only
renaming is weight norm's older spelling, used by the quantiser projections:

    fish-speech codec.pth                     Drama3CodecModel
    <conv>.parametrizations.weight.original0  <conv>.parametrizations.weight.original0  (g)
    <conv>.parametrizations.weight.original1  <conv>.parametrizations.weight.original1  (v)
    <proj>.weight_g                           <proj>.parametrizations.weight.original0  (g)
    <proj>.weight_v                           <proj>.parametrizations.weight.original1  (v)

(transformers applies the same renaming to `weight_g` / `weight_v` when it loads a folder.)
`Drama3CodecModel.from_pretrained("codec.pth")` loads through `load_fish_speech_codec`; the
command that writes a Hugging Face folder is `codec.convert`.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import torch

from .configuration_codec import Drama3CodecConfig

_WRAPPER_PREFIX = "generator."
# (fish-speech suffix, our suffix), a readable table applied to key endings.
_KEY_SUFFIXES = (
    (".weight_g", ".parametrizations.weight.original0"),
    (".weight_v", ".parametrizations.weight.original1"),
)


class CheckpointReadError(ValueError, pickle.UnpicklingError):
    """A `codec.pth` that cannot be read safely: a ValueError (bad input, named) that is still the
    UnpicklingError torch.load raises, for callers that catch that."""


# torch.save's legacy format opens with a pickled magic number (LONG1 opcode, 10 bytes).
_LEGACY_MAGIC = b"\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def _is_legacy_checkpoint(path: str) -> bool:
    with open(path, "rb") as reader:
        return _LEGACY_MAGIC in reader.read(32)


def read_fish_speech_state_dict(path) -> dict[str, torch.Tensor]:
    """Read `codec.pth` without executing pickled code (`weights_only=True`); unwrap
    `{"state_dict": ...}` and keep only the `generator.` weights (prefix removed) when present.
    Keys stay in fish-speech's spelling.

    Zip-format files (torch.save's default since 1.6) are memory-mapped; legacy-format files
    are read whole, still with `weights_only=True`. Anything else is a ValueError naming the file."""
    path = os.fspath(path)
    mapped = zipfile.is_zipfile(path)  # mmap works only on the zip format
    if not mapped and not _is_legacy_checkpoint(path):
        raise CheckpointReadError(f"{path}: not a PyTorch checkpoint (neither torch.save's zip nor its legacy format)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except pickle.UnpicklingError as error:
        if "Unsupported global" in str(error):
            raise CheckpointReadError(
                f"{path}: the checkpoint holds Python objects other than tensors; they are never unpickled "
                f"(that could run code), so it cannot be read as a codec state dict"
            ) from None
        raise CheckpointReadError(f"{path}: not a PyTorch checkpoint (torch.save file)") from None
    except (RuntimeError, EOFError, IndexError) as error:  # a damaged file fails deep in the unpickler
        raise CheckpointReadError(f"{path}: not a readable PyTorch checkpoint ({str(error).splitlines()[0]})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a codec state dict; expected a mapping of names to tensors")
    if any(key.startswith(_WRAPPER_PREFIX) for key in state):
        state = {k[len(_WRAPPER_PREFIX) :]: v for k, v in state.items() if k.startswith(_WRAPPER_PREFIX)}
    return state


def from_fish_speech_key(key: str) -> str:
    """fish-speech parameter name -> ours."""
    for theirs, ours in _KEY_SUFFIXES:
        if key.endswith(theirs):
            return key[: -len(theirs)] + ours
    return key


def to_fish_speech_key(key: str, quantizer_projection: bool) -> str:
    """Our parameter name -> fish-speech's (only the quantiser projections change spelling)."""
    if quantizer_projection:
        for theirs, ours in _KEY_SUFFIXES:
            if key.endswith(ours):
                return key[: -len(ours)] + theirs
    return key


def _is_quantizer_projection(key: str) -> bool:
    return key.startswith(("quantizer.semantic_quantizer.", "quantizer.quantizer.")) and (
        ".in_proj." in key or ".out_proj." in key
    )


def to_fish_speech_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under fish-speech's names: what fish-speech's `DAC.state_dict()` holds."""
    return {to_fish_speech_key(k, _is_quantizer_projection(k)): v for k, v in model.state_dict().items()}


def load_fish_speech_codec(
    cls,
    path,
    *,
    config: Drama3CodecConfig | None = None,
    dtype=None,
    output_loading_info: bool = False,
):
    """Build `cls(config)` from fish-speech's `codec.pth` at `path`.

    Any missing or unexpected key is a ValueError listing them (the file must be the codec
    `config` describes; the default config is the published codec).
    """
    config = config or Drama3CodecConfig()
    state = {from_fish_speech_key(k): v for k, v in read_fish_speech_state_dict(path).items()}
    with torch.device("meta"):
        model = cls(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not match the codec config: {len(missing)} missing keys {missing[:5]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:5]}"
        )
    model.load_state_dict(state, strict=True, assign=True)
    if dtype is not None and dtype != "auto":
        model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
    model.eval()
    if output_loading_info:
        return model, {"missing_keys": missing, "unexpected_keys": unexpected, "mismatched_keys": [], "error_msgs": []}
    return model
