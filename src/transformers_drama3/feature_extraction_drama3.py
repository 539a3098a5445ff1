"""Drama3FeatureExtractor: any audio a user hands over -> checked mono waveforms at the codec's rate.

The codec turns waveforms into codes; this module decides what reaches it, and is the one place
audio is read, down-mixed and resampled. Files, http(s) and file:// URLs, base64 strings and
encoded bytes are decoded by transformers' `load_audio` (soundfile backend); arrays, tensors and
`{"array", "sampling_rate"}` dicts (the `datasets` Audio format) are taken as they are. On top
come the project's checks: unreadable, empty, non-finite, inaudible, or longer than a caller's
limit audio is refused with an error that names the input.

The module-level helpers are shared: `resample` (the one soxr call), `read_audio`, `downmix` and
the reference rule `is_inaudible` serve the codec's input checks, training-data preparation and
the drama3-tiny recipe too.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import soxr
import torch
from transformers import BatchFeature
from transformers.audio_utils import load_audio
from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor

SAMPLING_RATE = 44100
"""The published S2 codec's rate; a processor built around another codec takes that codec's rate."""
INAUDIBLE_PEAK = 1e-3
"""The reference rule: audio whose peak stays below -60 dBFS holds no voice a codec could take, so a
reference (or a training record) made of it is refused. Not the generation guard's silence, which
looks for long quiet stretches inside a take by windowed RMS (its `SILENCE_RMS`)."""
MAX_CHANNELS = 16
"""Largest channel count accepted; more almost always means a `[samples, channels]` array."""
URL_TIMEOUT_SECONDS = 60.0


class Drama3FeatureExtractor(SequenceFeatureExtractor):
    r"""Audio in any common form -> `input_values` [batch, 1, samples] (float32, mono, at `sampling_rate`)
    and `padding_mask` [batch, samples] (1 on real samples, 0 on the right padding).

    Accepted audio: a path, an http(s) or file:// URL, a base64 string or `data:` URI, or encoded
    bytes (decoded with `load_audio`); a float array or tensor `[samples]` or `[channels, samples]`;
    or a dict `{"array", "sampling_rate"}`, `{"bytes"}` or `{"path"}` (the `datasets` Audio forms).
    Arrays without a rate of their own are taken to be at the call's `sampling_rate`, or at
    `self.sampling_rate` when that is None. Channels are averaged; other rates are resampled (soxr,
    see `resample`).

    Args:
        feature_size: channels of `input_values` (1: mono).
        sampling_rate: the rate the codec works at (44100 for the published codec).
        padding_value: the value of padded samples.
        silence_peak: audio whose peak stays below this is refused as silent (default
            `INAUDIBLE_PEAK`, the reference rule).
    """

    model_input_names = ["input_values", "padding_mask"]

    def __init__(
        self,
        feature_size: int = 1,
        sampling_rate: int = SAMPLING_RATE,
        padding_value: float = 0.0,
        silence_peak: float = INAUDIBLE_PEAK,
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
        samples = downmix(samples, name)
        if samples.size == 0:
            raise ValueError(f"{name}: the audio is empty")
        if not np.isfinite(samples).all():
            raise ValueError(f"{name}: the audio holds NaN or infinite samples")
        if is_inaudible(samples, self.silence_peak):
            raise ValueError(f"{name}: the audio is silent (peak below {self.silence_peak})")
        seconds = samples.shape[0] / rate
        if max_seconds is not None and seconds > max_seconds:
            raise ValueError(
                f"{name}: the audio is {seconds_over(seconds, max_seconds)} s long; at most {max_seconds:g} s is "
                f"taken here (cut a representative part)"
            )
        return resample(samples, rate, self.sampling_rate)

    def _read(self, audio: Any, sampling_rate: int | None, name: str) -> tuple[np.ndarray, int]:
        """(samples as float32 [samples] or [channels, samples], their rate). Encoded audio is
        decoded straight to `self.sampling_rate`."""
        if isinstance(audio, (str, os.PathLike, bytes, bytearray)):
            return read_audio(audio, self.sampling_rate, name), self.sampling_rate
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
            source = audio.get("bytes") or audio.get("path")  # datasets: the bytes are the content
            if source:
                return read_audio(source, self.sampling_rate, name), self.sampling_rate
            raise ValueError(
                f"{name}: an audio dict needs 'array' + 'sampling_rate', 'bytes' or 'path'; got keys {sorted(audio)}"
            )
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


def seconds_over(seconds: float, limit: float) -> str:
    """`seconds` (over `limit`) written with the fewest decimals, at least one, that show it over
    the limit: 60.04 s against 60 is "60.04", never "60.0"."""
    for decimals in range(1, 7):
        text = f"{seconds:.{decimals}f}"
        if float(text) > limit:
            return text
    return repr(seconds)


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
        f"{name}: audio must be a path, a URL, base64, bytes, a float array or tensor, or a dict with 'array' "
        f"and 'sampling_rate'; got {type(audio).__name__}"
    )


# ---- the shared helpers ----------------------------------------------------------------------------


def resample(samples: np.ndarray, from_rate: float, to_rate: float) -> np.ndarray:
    """Mono float32 `[samples]` at `from_rate` -> float32 `[ceil(samples * to_rate / from_rate)]` at `to_rate`.

    soxr at high quality, zero-padded or trimmed to that length: the convention of transformers'
    `load_audio` (and `librosa.load`), so an array and a file holding the same audio give the same
    samples. Every resampling of this package goes through here.
    """
    if from_rate == to_rate:
        return np.ascontiguousarray(samples, dtype=np.float32)
    length = math.ceil(samples.shape[-1] * to_rate / from_rate)
    resampled = soxr.resample(samples, from_rate, to_rate, quality="soxr_hq")
    resampled = np.pad(resampled, (0, max(0, length - resampled.shape[-1])))[:length]
    return np.ascontiguousarray(resampled, dtype=np.float32)


def read_audio(source: str | os.PathLike | bytes, sampling_rate: int, name: str = "audio") -> np.ndarray:
    """Encoded audio -> mono float32 samples `[samples]` at `sampling_rate`.

    `source`: a local path, an http(s) or file:// URL, a base64 string or `data:` URI, or the
    bytes of an audio file. Decoded by transformers' `load_audio` with its soundfile backend
    (channels averaged, resampled as `resample` does); torchcodec, which `load_audio` would prefer
    when installed, is not used, so every machine decodes alike. A URL that fails is retried by
    `load_audio` with backoff (about 15 s in all) before it is refused. Anything unreadable is a
    ValueError naming `name`.
    """
    text = _source_text(source, name)
    try:
        samples = load_audio(text, sampling_rate=sampling_rate, timeout=URL_TIMEOUT_SECONDS, backend="soundfile")
    except Exception as error:  # soundfile, httpx, base64 and OS errors all mean the same to the caller
        raise ValueError(f"{name}: cannot read audio {_shown(source)}: {error}") from error
    return np.ascontiguousarray(samples, dtype=np.float32)


def _source_text(source: str | os.PathLike | bytes, name: str) -> str:
    """`source` in the string forms `load_audio` takes (a path, an http(s) URL, base64)."""
    if isinstance(source, (bytes, bytearray)):
        if not source:
            raise ValueError(f"{name}: the audio bytes are empty")
        return base64.b64encode(source).decode("ascii")
    text = os.fspath(source)
    if text.startswith("file://"):
        path = urllib.request.url2pathname(urllib.parse.urlparse(text).path)
        if os.path.isfile(path):
            return path
    elif text.startswith(("http://", "https://", "data:")) or os.path.isfile(text) or _is_base64(text):
        return text
    # load_audio would take a missing path for base64 and fail on what that decodes to
    raise ValueError(f"{name}: cannot read audio {text!r}: no such file")


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _shown(source: Any) -> str:
    """How an error shows a source: a path or URL in full, base64 and bytes by their size."""
    if isinstance(source, (bytes, bytearray)):
        return f"({len(source)} bytes)"
    text = os.fspath(source)
    return repr(text) if len(text) <= 200 else f"(a {len(text)}-character string starting {text[:40]!r})"


def downmix(samples: np.ndarray | torch.Tensor, name: str) -> np.ndarray | torch.Tensor:
    """`[samples]` unchanged; `[channels, samples]` -> the mean of its channels `[samples]`."""
    if samples.ndim == 1:
        return samples
    if samples.ndim != 2:
        raise ValueError(f"{name}: a waveform must be [samples] or [channels, samples]; got {tuple(samples.shape)}")
    channels, length = samples.shape
    if channels > MAX_CHANNELS or channels > length:
        raise ValueError(
            f"{name}: a multi-channel waveform must be [channels, samples] with at most {MAX_CHANNELS} channels; "
            f"got {tuple(samples.shape)} (soundfile returns [samples, channels]: transpose it)"
        )
    return samples.mean(axis=0)


def is_inaudible(samples: np.ndarray | torch.Tensor, peak: float = INAUDIBLE_PEAK) -> bool:
    """The reference rule: True when no sample reaches `peak` in magnitude (see `INAUDIBLE_PEAK`)."""
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().to("cpu", torch.float32).numpy()
    return samples.size == 0 or float(np.abs(samples).max()) < peak

