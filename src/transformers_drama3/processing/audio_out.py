"""Audio out: generated codes (or generate()'s rows) -> waveforms through the codec, and a
waveform -> a WAV or FLAC file."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import soundfile
import torch

from ..output_files import atomic_output
from ..prompting import IM_END, check_codes
from ..prompting.bare_rows import spoken_frames

AUDIO_FORMATS = {".wav": "WAV", ".flac": "FLAC"}


class AudioOutputMixin:
    """The audio-out methods of `Drama3Processor`.

    Reads the processor's `codec`, `num_codebooks`, `codebook_size`, `token_ids`,
    `audio_separator_token_id`, `sampling_rate` and `samples_per_frame`."""

    def batch_decode(self, codes: torch.Tensor | Sequence[torch.Tensor], lengths: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Generated codes -> waveforms through the codec.

        Args:
            codes: [batch, frames, num_codebooks] (generate()'s takes, `audio_codes`), a list of
                [frames, num_codebooks] tensors of any lengths, or generate()'s `sequences`
                [batch, rows, 1 + num_codebooks] (rows `[main_id, c0..c9]`: each item's voice turn
                is decoded, `spoken_frames`; what transformers' text-to-speech pipeline hands over).
            lengths: frames of each item (default: all frames); not with `sequences`.

        Returns:
            A list of 1-D float32 waveforms at `sampling_rate`, each `frames * samples_per_frame` long.
        """
        if self.codec is None:
            raise ValueError("batch_decode needs a codec; load the processor with one")
        if isinstance(codes, torch.Tensor) and codes.ndim == 3 and codes.shape[-1] == self.num_codebooks + 1:
            if lengths is not None:
                raise ValueError("lengths: sequences (rows of 1 + num_codebooks values) end where their voice turn ends; "
                                 "give no lengths")
            codes = [self.spoken_frames(item) for item in codes]
        if isinstance(codes, torch.Tensor):
            if codes.ndim != 3 or codes.shape[-1] != self.num_codebooks:
                raise ValueError(f"codes: expected [batch, frames, {self.num_codebooks}]; got {tuple(codes.shape)}")
            items = list(codes)
        else:
            items = list(codes)
        if lengths is not None:
            if len(lengths) != len(items):
                raise ValueError(f"lengths: {len(lengths)} lengths for {len(items)} items")
            items = [item[: int(length)] for item, length in zip(items, lengths)]
        checked = [
            check_codes(item.T, self.num_codebooks, self.codebook_size, f"codes[{index}]") if len(item) else item.T
            for index, item in enumerate(items)
        ]
        frames = [item.shape[1] for item in checked]
        longest = max(frames)
        if longest == 0:
            return [torch.zeros(0) for _ in items]
        stacked = torch.zeros(len(items), self.num_codebooks, longest, dtype=torch.long)
        for index, item in enumerate(checked):
            stacked[index, :, : item.shape[1]] = item
        device = next(self.codec.parameters()).device
        with torch.no_grad():
            audio = self.codec.decode(stacked.to(device)).audio_values  # [batch, samples]
        audio = audio.reshape(len(items), -1).float().cpu()
        return [audio[index, : count * self.samples_per_frame] for index, count in enumerate(frames)]

    def decode(self, codes: torch.Tensor | Sequence[torch.Tensor], lengths: Sequence[int] | None = None):
        """One item ([frames, num_codebooks], or rows [rows, 1 + num_codebooks]) -> a waveform; a
        batch -> a list (see `batch_decode`)."""
        if isinstance(codes, torch.Tensor) and codes.ndim == 2:
            return self.batch_decode(codes[None], lengths)[0]
        return self.batch_decode(codes, lengths)

    def spoken_frames(self, rows: torch.Tensor) -> torch.Tensor:
        """The frames [frames, num_codebooks] of the voice turn one item's rows [rows, 1 +
        num_codebooks] end in (`prompting.bare_rows.spoken_frames`): of `generate()`'s `sequences`,
        its take (and any frames the prompt's voice turn already held)."""
        ids = self.token_ids
        rows = torch.as_tensor(rows).long().cpu()
        if rows.ndim != 2 or rows.shape[-1] != self.num_codebooks + 1:
            raise ValueError(f"rows: expected [rows, 1 + {self.num_codebooks}]; got {tuple(rows.shape)}")
        return spoken_frames(rows, ids.semantic_start, ids.codebook_size, ids.special[IM_END], ids.pad, self.audio_separator_token_id)

    def save_audio(self, audio: torch.Tensor | np.ndarray, path: str | os.PathLike, sampling_rate: int | None = None) -> None:
        """Write a 1-D waveform as WAV or FLAC (from the file extension), 16-bit PCM, through a
        temporary file beside `path`: a failed write leaves an existing file as it was."""
        extension = os.path.splitext(os.fspath(path))[1].lower()
        if extension not in AUDIO_FORMATS:
            raise ValueError(f"path: write .wav or .flac; got {os.fspath(path)!r}")
        if isinstance(audio, torch.Tensor):
            audio = audio.detach().to("cpu", torch.float32).numpy()
        samples = np.asarray(audio, dtype=np.float32).squeeze()
        if samples.ndim != 1:
            raise ValueError(f"audio: expected one waveform [samples]; got shape {samples.shape}")
        with atomic_output(path) as temporary:
            soundfile.write(
                temporary, np.clip(samples, -1.0, 1.0), sampling_rate or self.sampling_rate,
                format=AUDIO_FORMATS[extension], subtype="PCM_16",
            )
