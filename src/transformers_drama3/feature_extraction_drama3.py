"""Drama3FeatureExtractor: any audio a user hands over -> checked mono waveforms at the codec's rate.

The codec turns waveforms into codes; this component decides what reaches it. It reads files and
URLs (soundfile), takes arrays, tensors and `{"array", "sampling_rate"}` dicts (the `datasets`
Audio format), down-mixes to mono, resamples with soxr, and refuses audio a codec could not take a
voice from: unreadable, empty, non-finite, silent, or longer than a caller's limit. Every error
names the input it is about.
"""

from __future__ import annotations

import io
import os
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers import BatchFeature
from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor

SAMPLING_RATE = 44100
"""The published S2 codec's rate; a processor built around another codec takes that codec's rate."""
SILENCE_PEAK = 1e-3
"""Peak below -60 dBFS: nothing a codec could take a voice from."""


class Drama3FeatureExtractor(SequenceFeatureExtractor):
    r"""Audio in any common form -> `input_values` [batch, 1, samples] (float32, mono, at `sampling_rate`)
    and `padding_mask` [batch, samples] (1 on real samples, 0 on the right padding).

    Accepted audio: a path or an http(s)/file URL (read with soundfile), a float array or tensor
    `[samples]` or `[channels, samples]`, or a dict `{"array", "sampling_rate"}` (also `{"path"}`).
    Arrays without a rate of their own are taken to be at the call's `sampling_rate`, or at
    `self.sampling_rate` when that is None. Channels are averaged; other rates are resampled (soxr).

    Args:
        feature_size: channels of `input_values` (1: mono).
        sampling_rate: the rate the codec works at (44100 for the published codec).
        padding_value: the value of padded samples.
        silence_peak: audio whose peak stays below this is refused as silent.
    """

    model_input_names = ["input_values", "padding_mask"]

    def __init__(
        self,
        feature_size: int = 1,
        sampling_rate: int = SAMPLING_RATE,
        padding_value: float = 0.0,
        silence_peak: float = SILENCE_PEAK,
        **kwargs,
    ):
        if feature_size != 1:
            raise ValueError(f"feature_size: the Drama 3 codecs take mono audio (1); got {feature_size}")
        super().__init__(feature_size=feature_size, sampling_rate=int(sampling_rate), padding_value=padding_value, **kwargs)
        self.silence_peak = silence_peak

    # ---- one input ----------------------------------------------------------------------------

    def load(
        self,
        audio: Any,
        sampling_rate: int | None = None,
        name: str = "audio",
        max_seconds: float | None = None,
    ) -> np.ndarray:
        """One input -> checked mono float32 samples [samples] at `self.sampling_rate`.

        Args:
            audio: see the class docstring.
            sampling_rate: rate of an array without its own; a dict's or a file's own rate wins.
            name: how errors refer to this input (e.g. "references[0].audio").
            max_seconds: refuse audio longer than this.
        """
        samples, rate = self._read(audio, sampling_rate, name)
        if samples.ndim == 2:
            if samples.shape[0] > samples.shape[1]:
                raise ValueError(
                    f"{name}: a multi-channel waveform must be [channels, samples]; got {samples.shape} "
                    f"(more channels than samples: transpose it)"
                )
            samples = samples.mean(axis=0)
        elif samples.ndim != 1:
            raise ValueError(f"{name}: a waveform must be [samples] or [channels, samples]; got {samples.shape}")
        if samples.size == 0:
            raise ValueError(f"{name}: the audio is empty")
        if not np.isfinite(samples).all():
            raise ValueError(f"{name}: the audio holds NaN or infinite samples")
        if float(np.abs(samples).max()) < self.silence_peak:
            raise ValueError(f"{name}: the audio is silent (peak below {self.silence_peak})")
        seconds = samples.shape[0] / rate
        if max_seconds is not None and seconds > max_seconds:
            raise ValueError(
                f"{name}: the audio is {seconds:.1f} s long; at most {max_seconds:g} s is taken here "
                f"(cut a representative part)"
            )
        if rate != self.sampling_rate:
            import soxr

            samples = soxr.resample(samples, rate, self.sampling_rate).astype(np.float32)
        return np.ascontiguousarray(samples, dtype=np.float32)

    def _read(self, audio: Any, sampling_rate: int | None, name: str) -> tuple[np.ndarray, int]:
        """(samples as float32 [samples] or [channels, samples], their rate)."""
        if isinstance(audio, (str, os.PathLike)):
            return read_audio_file(os.fspath(audio), name)
        if isinstance(audio, Mapping):
            if audio.get("array") is not None:
                own = audio.get("sampling_rate")
                if own is None:
                    raise ValueError(f"{name}: an audio dict with an 'array' needs its 'sampling_rate'")
                if sampling_rate is not None and int(sampling_rate) != int(own):
                    raise ValueError(
                        f"{name}: the audio dict says sampling_rate={own} but sampling_rate={sampling_rate} was given"
                    )
                return _as_float_array(audio["array"], name), check_rate(own, name)
            if audio.get("path") is not None:
                return read_audio_file(os.fspath(audio["path"]), name)
            raise ValueError(f"{name}: an audio dict needs 'array' + 'sampling_rate' or 'path'; got keys {sorted(audio)}")
        rate = self.sampling_rate if sampling_rate is None else check_rate(sampling_rate, name)
        return _as_float_array(audio, name), rate

    # ---- a batch ------------------------------------------------------------------------------

    def __call__(
        self,
        audio: Any,
        sampling_rate: int | None = None,
        return_tensors: str | None = "pt",
        max_seconds: float | None = None,
        names: Sequence[str] | None = None,
        **kwargs,
    ) -> BatchFeature:
        """One input or a list of inputs -> a right-padded batch.

        A list of numbers is one waveform; any other list or tuple is a batch. Returns
        `input_values` [batch, 1, samples] float32 and `padding_mask` [batch, samples] long.

        Args:
            audio: one input or a list (see the class docstring).
            sampling_rate: rate of arrays given without their own.
            return_tensors: "pt" (default), "np", or None for lists.
            max_seconds: refuse inputs longer than this.
            names: how errors refer to each input (default "audio" / "audio[i]").
        """
        if kwargs:
            raise TypeError(f"Drama3FeatureExtractor got unexpected arguments {sorted(kwargs)}")
        batched = isinstance(audio, (list, tuple)) and not all(isinstance(x, (int, float, np.number)) for x in audio)
        items = list(audio) if batched else [audio]
        if not items:
            raise ValueError("audio: the batch is empty")
        if names is None:
            names = [f"audio[{index}]" for index in range(len(items))] if batched else ["audio"]
        if len(names) != len(items):
            raise ValueError(f"names: {len(names)} names for {len(items)} inputs")
        waveforms = [self.load(item, sampling_rate, name, max_seconds) for item, name in zip(items, names)]
        longest = max(waveform.shape[0] for waveform in waveforms)
        input_values = np.full((len(waveforms), 1, longest), self.padding_value, dtype=np.float32)
        padding_mask = np.zeros((len(waveforms), longest), dtype=np.int64)
        for index, waveform in enumerate(waveforms):
            input_values[index, 0, : waveform.shape[0]] = waveform
            padding_mask[index, : waveform.shape[0]] = 1
        data = {"input_values": input_values, "padding_mask": padding_mask}
        if return_tensors is None:
            data = {key: value.tolist() for key, value in data.items()}
        return BatchFeature(data=data, tensor_type=return_tensors)


def check_rate(rate: Any, name: str) -> int:
    """A sampling rate as a positive int, or a ValueError naming the input."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}: sampling_rate must be a positive number of Hz; got {rate!r}")
    if not rate > 0 or int(rate) != rate:
        raise ValueError(f"{name}: sampling_rate must be a positive whole number of Hz; got {rate!r}")
    return int(rate)


def _as_float_array(audio: Any, name: str) -> np.ndarray:
    if isinstance(audio, torch.Tensor):
        if not audio.is_floating_point():
            raise ValueError(f"{name}: a waveform must hold floats; got a {audio.dtype} tensor (codes?)")
        return audio.detach().to("cpu", torch.float32).numpy()
    if isinstance(audio, (np.ndarray, list, tuple)):
        array = np.asarray(audio)
        if array.dtype.kind not in "fiu" or (array.dtype.kind in "iu" and isinstance(audio, np.ndarray)):
            raise ValueError(f"{name}: a waveform must hold floats; got dtype {array.dtype}")
        return array.astype(np.float32)
    raise ValueError(
        f"{name}: audio must be a path, a URL, a float array or tensor, or a dict with 'array' and "
        f"'sampling_rate'; got {type(audio).__name__}"
    )


def read_audio_file(path: str, name: str) -> tuple[np.ndarray, int]:
    """Mono float32 samples [samples] and their rate from a local path, a file:// or http(s) URL."""
    import soundfile

    scheme = urllib.parse.urlparse(path).scheme
    try:
        if scheme in ("http", "https", "file"):
            with urllib.request.urlopen(path, timeout=60) as response:
                source: Any = io.BytesIO(response.read())
        else:
            source = path
        samples, rate = soundfile.read(source, dtype="float32", always_2d=True)  # [samples, channels]
    except Exception as error:  # soundfile, urllib and OS errors all mean the same to the caller
        raise ValueError(f"{name}: cannot read audio {path!r}: {error}") from error
    return samples.mean(axis=1), int(rate)

