"""Waveforms -> the bytes of OpenAI's `response_format`s, whole or while the audio is being made.

wav: 16-bit PCM at the model's rate (written by libsndfile whole; streamed as a header whose sizes
say "unknown", then PCM); pcm: raw 16-bit little-endian mono samples (no header: the rate is sent
in the `X-Sample-Rate` header). mp3, opus, aac and flac are encoded with PyAV (the `av` package,
FFmpeg inside its wheel, so they do not depend on the machine's libraries): mp3 (LAME) and aac
(ADTS, FFmpeg's encoder) at the model's rate, opus in Ogg at 48 kHz (the rates Opus allows are
8/12/16/24/48 kHz), flac lossless from the same 16-bit samples as wav and pcm. Every format
streams: an encoder takes samples as they come and gives back the bytes that are ready.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile

try:
    import av
except ImportError:  # the [serve] extra brings PyAV; without it only wav and pcm are written
    av = None

MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}
ENCODED = {"mp3": ("mp3", "libmp3lame"), "aac": ("adts", "aac"), "opus": ("ogg", "libopus"), "flac": ("flac", "flac")}
"""The formats PyAV writes: response format -> (FFmpeg muxer, encoder)."""
OPUS_RATE = 48000
OGG_PAGE_MICROSECONDS = 100_000
"""How much Opus audio an Ogg page holds at most (FFmpeg's default, a second, delays a stream)."""
STREAMABLE = ("pcm", "wav", "mp3", "opus", "aac", "flac")
"""Formats that can be sent while the audio is being made (those this server writes)."""


def supported_formats() -> list[str]:
    """The response formats this server can write: wav and pcm, and PyAV's where it is installed."""
    return ["wav", "pcm", *(["flac", "mp3", "opus", "aac"] if av is not None else [])]


def int16_samples(samples: np.ndarray) -> np.ndarray:
    """float samples in [-1, 1] -> int16 (clipped, rounded): the one conversion every format starts
    from, so wav, flac and pcm carry the same samples and the lossy coders are fed them."""
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


class _Drained:
    """A write-only, unseekable file for a muxer: what was written since the last `drain()`."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        data, self.parts = b"".join(self.parts), []
        return data


def encoded_rate(response_format: str, sampling_rate: int) -> int:
    """The rate `response_format` is written at: the model's, or Opus's 48 kHz."""
    return OPUS_RATE if response_format == "opus" else sampling_rate


class PyAVEncoder:
    """Samples in, the bytes of an FFmpeg-encoded format out as they are ready (`push`, `finish`).

    `output`: a seekable file (io.BytesIO) for a whole file, whose muxer may go back and fill in its
    header (flac's length); None for a stream, whose bytes are handed out as they come. `bit_rate`:
    bits per second for the lossy coders (None: the encoder's default)."""

    def __init__(self, response_format: str, sampling_rate: int, output=None, bit_rate: int | None = None):
        if av is None:
            raise ValueError(f"response_format: {response_format!r} needs PyAV (pip install av)")
        muxer, encoder = ENCODED[response_format]
        self.sampling_rate = sampling_rate
        self.output = output if output is not None else _Drained()
        # an Ogg page holds up to a second of audio by default: a stream would arrive a second at a time
        options = {"page_duration": str(OGG_PAGE_MICROSECONDS)} if muxer == "ogg" else {}
        self.container = av.open(self.output, mode="w", format=muxer, container_options=options)
        self.stream = self.container.add_stream(encoder, rate=encoded_rate(response_format, sampling_rate), layout="mono")
        if response_format == "flac":
            self.stream.format = "s16"  # lossless 16-bit: the samples wav and pcm carry
        if bit_rate is not None:  # bits per second; None: the encoder's default (LAME's 128k, libopus's own choice)
            self.stream.bit_rate = bit_rate
        self.samples, self.closed = 0, False

    def head(self) -> bytes:
        """Bytes to send before any audio (none: the muxer writes its header with the first packet)."""
        return b""

    def _mux(self, frame) -> None:
        for packet in self.stream.encode(frame):  # PyAV resamples and re-frames to the encoder's frame size
            self.container.mux(packet)

    def push(self, samples: np.ndarray) -> bytes:
        """Encode float samples [n] at the model's rate; the bytes that are ready."""
        pcm = int16_samples(samples)
        if pcm.size:
            frame = av.AudioFrame.from_ndarray(pcm[None], format="s16", layout="mono")
            frame.sample_rate, frame.pts = self.sampling_rate, self.samples
            self.samples += pcm.size
            self._mux(frame)
        return self._ready()

    def finish(self) -> bytes:
        """Flush the encoder and close the container; the last bytes."""
        self._mux(None)
        self.close()
        return self._ready()

    def close(self) -> None:
        """Close the container (a stream whose client left is not flushed); again is a no-op."""
        if not self.closed:
            self.closed = True
            self.container.close()

    def _ready(self) -> bytes:
        return self.output.drain() if isinstance(self.output, _Drained) else b""


class _RawEncoder:
    """pcm (and wav after its header, `head()`): 16-bit little-endian PCM as it comes."""

    def __init__(self, header: bytes = b""):
        self.header = header

    def head(self) -> bytes:
        return self.header

    def push(self, samples: np.ndarray) -> bytes:
        return pcm16(samples)

    def finish(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


def stream_encoder(response_format: str, sampling_rate: int, bit_rate: int | None = None):
    """An encoder for a streamed take: `head()` (bytes to send at once), `push(samples) -> bytes` as
    audio is made, `finish() -> bytes` at its end, `close()` when the stream ends early. `bit_rate`:
    bits per second of mp3, opus or aac (None: the encoder's default)."""
    if response_format == "pcm":
        return _RawEncoder()
    if response_format == "wav":
        return _RawEncoder(streaming_wav_header(sampling_rate))
    return PyAVEncoder(response_format, sampling_rate, bit_rate=bit_rate)


def encode(samples: np.ndarray, sampling_rate: int, response_format: str, bit_rate: int | None = None) -> bytes:
    """A whole waveform [samples] as the bytes of `response_format` (one of `supported_formats()`);
    `bit_rate` as `stream_encoder`'s."""
    if response_format == "pcm":
        return pcm16(samples)
    buffer = io.BytesIO()
    if response_format == "wav":
        soundfile.write(buffer, int16_samples(samples), sampling_rate, format="WAV", subtype="PCM_16")
        return buffer.getvalue()
    if response_format not in ENCODED or av is None:
        raise ValueError(f"response_format: {response_format!r} cannot be written; supported: {supported_formats()}")
    encoder = PyAVEncoder(response_format, sampling_rate, output=buffer, bit_rate=bit_rate)
    encoder.push(samples)
    encoder.finish()
    return buffer.getvalue()
