"""Audio as a layout sees it: a `Clip` (codes, a waveform or a file) and the check of codes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

# torch has these dtypes but no min/max/compare kernels for them on the CPU: widen first.
_WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


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


def check_codes(codes: Any, num_codebooks: int, codebook_size: int, location: str) -> torch.Tensor:
    """Codes as an int64 CPU tensor `[num_codebooks, frames]` with at least one frame.

    Any signed or unsigned integer dtype is accepted (numpy or torch); floats and bools are refused."""
    if isinstance(codes, np.ndarray):
        if codes.dtype.kind == "u":
            # values past int64 would wrap to negatives below and be refused as out of range
            codes = codes.astype(np.int64)
        codes = torch.from_numpy(codes) if codes.dtype.kind in "iub" else codes
    if not isinstance(codes, torch.Tensor) or codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        kind = codes.dtype if isinstance(codes, (torch.Tensor, np.ndarray)) else type(codes).__name__
        raise ValueError(f"{location}: codes must be an integer tensor [num_codebooks, frames]; got {kind}")
    if codes.dtype in _WIDE_UNSIGNED:
        codes = codes.to(torch.int64)
    if codes.ndim != 2 or codes.shape[0] != num_codebooks or codes.shape[1] == 0:
        raise ValueError(
            f"{location}: codes must be [{num_codebooks}, frames] with at least one frame; "
            f"got {tuple(codes.shape)}"
        )
    if int(codes.min()) < 0 or int(codes.max()) >= codebook_size:
        raise ValueError(f"{location}: codes must lie in [0, {codebook_size})")
    return codes.to(device="cpu", dtype=torch.long)
