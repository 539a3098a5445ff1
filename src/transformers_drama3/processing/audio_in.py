"""Audio in: clips (codes, waveforms, files, URLs, base64) -> checked codes [num_codebooks, frames],
through the feature extractor and the codec, and the checks every reference passes."""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers.utils import logging

from ..decoding.budget import speech_shortfall
from ..feature_extraction_drama3 import seconds_over
from ..prompting import Clip, check_codes

# The processor's warnings keep the logger they were always given, the one users capture or silence
# by name (`processing_drama3.logger` is this same logger).
logger = logging.get_logger("transformers_drama3.processing_drama3")


class AudioInputMixin:
    """The audio-in methods of `Drama3Processor`.

    Reads the processor's `feature_extractor`, `codec` (None for codes-only use), `sampling_rate`,
    `num_codebooks`, `codebook_size`, `frame_rate`, `max_reference_seconds`,
    `short_reference_seconds` and `min_reference_fraction`."""

    def load_waveform(self, clip: Clip, location: str, max_seconds: float | None = None) -> np.ndarray:
        """A clip given as a waveform or a file -> checked mono float32 samples at the codec's rate
        (see `Drama3FeatureExtractor.load`)."""
        audio = clip.path if clip.path is not None else clip.waveform
        return self.feature_extractor.load(audio, clip.sampling_rate, location, max_seconds)

    def encode_audio(self, samples: np.ndarray, location: str) -> torch.Tensor:
        """Mono samples at the codec rate -> codes [num_codebooks, frames] (long)."""
        if self.codec is None:
            raise ValueError(
                f"{location}: audio needs a codec to become codes; load the processor with a codec or "
                f"give codes [num_codebooks, frames] instead"
            )
        audio = torch.from_numpy(samples)[None]  # [1, samples]
        with torch.no_grad():
            encoded = self.codec.encode(audio, sampling_rate=self.sampling_rate)
        return encoded.audio_codes[0, :, : int(encoded.lengths[0])].to("cpu", torch.long)

    def given_codes(self, clip: Clip, location: str) -> torch.Tensor | None:
        """The codes a clip was given as, checked, or None for a waveform or a file: the one gate of
        codes input. Integer codes of any dtype (uint16/32/64 included) are taken as int64; float
        codes are refused, and so is a float "waveform" that is shaped and valued like codes
        (`[num_codebooks, frames]`, whole numbers beyond [-1, 1]): encoding it as audio would
        silently speak noise."""
        if clip.codes is not None:
            return check_codes(clip.codes, self.num_codebooks, self.codebook_size, location)
        waveform = clip.waveform
        if waveform is not None and getattr(waveform, "ndim", 0) == 2 and waveform.shape[0] == self.num_codebooks:
            values = torch.as_tensor(waveform).double()
            if values.numel() and bool((values == values.round()).all()) and float(values.abs().max()) > 1:
                raise ValueError(
                    f"{location}: a float array [{self.num_codebooks}, frames] of whole numbers looks like codes "
                    f"given as floats; give codes as an integer array (e.g. .long()), or a waveform in [-1, 1]"
                )
        return None

    def codes_of(self, clip: Clip, location: str, is_reference: bool = False) -> torch.Tensor:
        """Any clip -> checked codes [num_codebooks, frames]; references are held to the length cap,
        measured on their codes whatever they came as (`max_reference_frames`)."""
        codes = self.given_codes(clip, location)
        if codes is None:
            # the audio's own length first: a cheap refusal before encoding (a clip of at most
            # max_reference_seconds codes to at most max_reference_frames frames)
            samples = self.load_waveform(clip, location, self.max_reference_seconds if is_reference else None)
            codes = check_codes(self.encode_audio(samples, location), self.num_codebooks, self.codebook_size, location)
        if is_reference:
            self._check_reference_length(codes.shape[1], location)
            self._warn_if_short(codes.shape[1] / self.frame_rate, location)
        return codes

    @property
    def max_reference_frames(self) -> int:
        """The most frames a reference may have: those of `max_reference_seconds` of audio, the codec
        rounding a part frame up. The one measure of a reference's length: a clip stored as a
        voice is held to it as audio when it arrives and as codes at every later use."""
        return math.ceil(self.max_reference_seconds * self.frame_rate)

    def _check_reference_length(self, frames: int, location: str) -> None:
        if frames > self.max_reference_frames:
            seconds = seconds_over(frames / self.frame_rate, self.max_reference_seconds)
            raise ValueError(
                f"{location}: the reference is {seconds} s long ({frames} frames); references may be at most "
                f"{self.max_reference_seconds:g} s ({self.max_reference_frames} frames; cut a representative part)"
            )

    def _warn_if_short(self, seconds: float, location: str) -> None:
        if self.short_reference_seconds is not None and seconds < self.short_reference_seconds:
            logger.warning(
                f"{location}: the reference is {seconds:.1f} s long; this model clones reliably from references "
                f"of at least {self.short_reference_seconds:g} s, and from a shorter one it may lose the voice "
                f"or stop after a word or two (give a longer clip of the voice)"
            )

    def check_reference_covers(self, codes: torch.Tensor, transcript: str, location: str) -> None:
        """Refuse reference codes [num_codebooks, frames] far too short to be a recording of
        `transcript` (under `min_reference_fraction` of its expected duration; 0 turns this off)."""
        if self.min_reference_fraction <= 0:
            return
        problem = speech_shortfall(codes.shape[1] / self.frame_rate, transcript, self.min_reference_fraction)
        if problem is not None:
            raise ValueError(f"{location}: {problem}; give the whole recording of its transcript")
