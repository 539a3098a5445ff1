"""Waveforms -> the bytes of OpenAI's `response_format`s, written with libsndfile (soundfile).

wav, flac: 16-bit PCM at the model's rate; pcm: raw 16-bit little-endian mono samples (no header:
the rate is sent in the `X-Sample-Rate` header); mp3 and opus only where this machine's libsndfile
writes them (opus at 48 kHz, the rates Opus allows being 8/12/16/24/48 kHz). aac is never written.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile

from ..feature_extraction_drama3 import resample

MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}
OPUS_RATE = 48000
STREAMABLE = ("pcm", "wav")
"""Formats that can be sent while the audio is being made."""


def _libsndfile_writes(format_name: str, subtype: str) -> bool:
    return format_name in soundfile.available_formats() and subtype in soundfile.available_subtypes(format_name)


def supported_formats() -> list[str]:
    """The response formats this server can write."""
    formats = ["wav", "pcm", "flac"]
    if _libsndfile_writes("MP3", "MPEG_LAYER_III"):
        formats.append("mp3")
    if _libsndfile_writes("OGG", "OPUS"):
        formats.append("opus")
    return formats


def int16_samples(samples: np.ndarray) -> np.ndarray:
    """float samples in [-1, 1] -> int16 (clipped, rounded): the one conversion every 16-bit format
    uses, so wav, flac and pcm carry the same samples."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    return np.round(clipped * 32767.0).astype("<i2")


def pcm16(samples: np.ndarray) -> bytes:
    """float samples in [-1, 1] -> 16-bit little-endian PCM bytes."""
    return int16_samples(samples).tobytes()


def streaming_wav_header(sampling_rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say "unknown" (0xFFFFFFFF), for a stream of PCM after it."""
    unknown = 0xFFFFFFFF
    return (
        b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sampling_rate, sampling_rate * 2, 2, 16)
        + b"data" + struct.pack("<I", unknown)
    )


def encode(samples: np.ndarray, sampling_rate: int, response_format: str) -> bytes:
    """A whole waveform [samples] as the bytes of `response_format` (one of `supported_formats()`)."""
    samples = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    if response_format == "pcm":
        return pcm16(samples)
    buffer = io.BytesIO()
    if response_format == "wav":
        soundfile.write(buffer, int16_samples(samples), sampling_rate, format="WAV", subtype="PCM_16")
    elif response_format == "flac":
        soundfile.write(buffer, int16_samples(samples), sampling_rate, format="FLAC", subtype="PCM_16")
    elif response_format == "mp3":
        soundfile.write(buffer, samples, sampling_rate, format="MP3", subtype="MPEG_LAYER_III")
    elif response_format == "opus":
        soundfile.write(buffer, resample(samples, sampling_rate, OPUS_RATE), OPUS_RATE, format="OGG", subtype="OPUS")
    else:
        raise ValueError(f"response_format: {response_format!r} cannot be written; supported: {supported_formats()}")
    return buffer.getvalue()
