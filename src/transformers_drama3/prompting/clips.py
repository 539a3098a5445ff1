"""Audio as a layout sees it: a `Clip` (codes, a waveform or a file) and the check of codes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from ..codec.audio import check_codes as check_codec_codes


@dataclass(frozen=True, eq=False)  # compared by identity: tensors have no single truth value
class Clip:
    """Audio given as precomputed codes `[num_codebooks, frames]`, a waveform, or a file path / URL.

    `waveform` is `[samples]` or `[channels, samples]` float at `sampling_rate` (the codec's rate
    when None)."""

    codes: torch.Tensor | np.ndarray | None = None
    waveform: np.ndarray | torch.Tensor | None = None
    sampling_rate: int | None = None
    path: str | None = None

    def __post_init__(self):
        given = sum(value is not None for value in (self.codes, self.waveform, self.path))
        if given != 1:
            raise ValueError(f"a Clip needs exactly one of codes, waveform or path; got {given}")


AudioLike = Union[Clip, torch.Tensor, np.ndarray, str, os.PathLike]


def _is_integer_array(audio: Any) -> bool:
    if isinstance(audio, np.ndarray):
        return audio.dtype.kind in "iu"
    return isinstance(audio, torch.Tensor) and not audio.is_floating_point() and audio.dtype != torch.bool


def as_clip(audio: AudioLike, location: str, sampling_rate: int | None = None) -> Clip:
    """Integer arrays are codes `[num_codebooks, frames]`; float arrays are waveforms; strings are paths."""
    if isinstance(audio, Clip):
        return audio
    if isinstance(audio, (str, os.PathLike)):
        return Clip(path=os.fspath(audio))
    if _is_integer_array(audio):
        return Clip(codes=audio)
    if isinstance(audio, (torch.Tensor, np.ndarray)):
        return Clip(waveform=audio, sampling_rate=sampling_rate)
    raise ValueError(
        f"{location}: audio must be codes (an int tensor [num_codebooks, frames]), a float waveform, "
        f"a path or a Clip; got {type(audio).__name__}"
    )


def _refuse_pcm_as_codes(codes: Any, num_codebooks: int, codebook_size: int, location: str) -> None:
    """Integer arrays are taken for codes, so int16 PCM (what soundfile and wave return for
    dtype="int16") lands here; when it is not valid codes, say it is audio and how to pass it."""
    if isinstance(codes, np.ndarray) and codes.dtype == np.int16:
        codes = torch.from_numpy(codes)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int16:
        return
    shaped = codes.ndim == 2 and codes.shape[0] == num_codebooks
    if shaped and codes.numel() and 0 <= int(codes.min()) and int(codes.max()) < codebook_size:
        return
    raise ValueError(
        f"{location}: an int16 array of shape {tuple(codes.shape)} looks like 16-bit PCM audio, not codes "
        f"[{num_codebooks}, frames] in [0, {codebook_size}); pass audio as float samples in [-1, 1] "
        f"(pcm / 32768) or as a file path"
    )


def check_codes(codes: Any, num_codebooks: int, codebook_size: int, location: str) -> torch.Tensor:
    """One clip's codes as an int64 CPU tensor `[num_codebooks, frames]` with at least one frame.

    The codec's `check_codes` (any signed or unsigned integer dtype, numpy or torch; floats and
    bools refused; values in [0, codebook_size)) plus the clip's rules: no batch, one frame at least,
    and int16 arrays that are not valid codes named as what they likely are (16-bit PCM audio)."""
    _refuse_pcm_as_codes(codes, num_codebooks, codebook_size, location)
    if isinstance(codes, (torch.Tensor, np.ndarray)) and codes.ndim != 2:
        raise ValueError(f"{location}: codes must be [{num_codebooks}, frames]; got {tuple(codes.shape)}")
    batch, _ = check_codec_codes(codes, num_codebooks, name=location, codebook_size=codebook_size)
    if batch.shape[-1] == 0:
        raise ValueError(f"{location}: codes must be [{num_codebooks}, frames] with at least one frame; got no frames")
    return batch[0].to(device="cpu")
