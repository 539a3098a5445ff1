"""A take's samples as a response carries them: time-stretched to the request's `speed`,
resampled to the response's rate and made louder or softer by its `volume_db`, whole or chunk by
chunk with the same result.

- `speed` (OpenAI's 0.25-4.0): FFmpeg's `atempo` filter through PyAV (the FFmpeg in the `av` wheel
  of the [serve] extra), which keeps the pitch. One atempo stage blends samples only within
  0.5-2.0 (above 2.0 it drops samples), so a factor outside that range is a chain of stages whose
  product is the factor (0.25 = 0.5 x 0.5, 3.0 = 2.0 x 1.5).
- The rate: `pcm` is OpenAI's 24 kHz (clients play it at 24 kHz without asking); `wav` stays at the
  model's rate (its header says the rate); a request's `sample_rate` sets either. Resampled with
  soxr's streaming resampler, whose chunks join to its one-shot resample sample for sample.
- The volume (Fish Audio's `prosody.volume`, in dB): a gain, last.

The stages keep their state between chunks, so a streamed take is the whole take, cut where its
chunks were cut (tested).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import soxr

from ..decoding.options import MAX_SPEED, MIN_SPEED

try:
    import av
except ImportError:  # the [serve] extra brings PyAV; without it `speed` other than 1.0 is refused
    av = None

OPENAI_PCM_RATE = 24000
"""The rate OpenAI's `pcm` is defined at (16-bit mono, 24 kHz): what clients play it at."""
ATEMPO_RANGE = (0.5, 2.0)
"""The factors one atempo stage stretches by blending (it drops samples above 2.0)."""


def output_rate(response_format: str, model_rate: int, sample_rate: int | None) -> int:
    """The rate a response's samples are at before encoding: `sample_rate` if the request gave one
    (pcm and wav only), else OpenAI's 24 kHz for pcm, else the model's rate."""
    if sample_rate is not None:
        return sample_rate
    return OPENAI_PCM_RATE if response_format == "pcm" else model_rate


def atempo_factors(speed: float) -> list[float]:
    """`speed` as a chain of atempo factors, each within `ATEMPO_RANGE`, whose product is `speed`
    ([] for 1.0): 4.0 -> [2.0, 2.0], 3.0 -> [2.0, 1.5], 0.25 -> [0.5, 0.5]."""
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"speed: {speed!r} is outside [{MIN_SPEED}, {MAX_SPEED}]")
    low, high = ATEMPO_RANGE
    factors, left = [], float(speed)
    while left > high:
        factors.append(high)
        left /= high
    while left < low:
        factors.append(low)
        left /= low
    if left != 1.0:
        factors.append(left)
    return factors


class TimeStretch:
    """Float samples [n] at `rate` in, the same audio `speed` times as fast out, pitch kept (a
    chain of FFmpeg atempo filters). `push` returns what is ready; `finish` flushes the rest."""

    def __init__(self, rate: int, speed: float):
        if av is None:
            raise ValueError(f"speed: {speed} needs PyAV (pip install av, or the [serve] extra)")
        self.rate, self.samples = rate, 0
        time_base = Fraction(1, rate)
        self.graph = av.filter.Graph()
        self.source = self.graph.add_abuffer(format="flt", sample_rate=rate, layout="mono", time_base=time_base)
        node = self.source
        for factor in atempo_factors(speed):
            stage = self.graph.add("atempo", f"{factor!r}")
            node.link_to(stage)
            node = stage
        self.sink = self.graph.add("abuffersink")
        node.link_to(self.sink)
        self.graph.configure()

    def push(self, samples: np.ndarray) -> np.ndarray:
        samples = np.ascontiguousarray(samples, dtype=np.float32).reshape(-1)
        if samples.size:
            frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = self.rate, self.samples, Fraction(1, self.rate)
            self.samples += samples.size
            self.source.push(frame)
        return self._ready()

    def finish(self) -> np.ndarray:
        self.source.push(None)  # end of stream: atempo gives back what it holds
        return self._ready()

    def _ready(self) -> np.ndarray:
        parts = []
        while True:
            try:
                frame = self.sink.pull()
            except (av.error.BlockingIOError, av.error.EOFError):  # nothing more yet / the stream has ended
                break
            parts.append(frame.to_ndarray().reshape(-1))
        return np.concatenate(parts).astype(np.float32, copy=False) if parts else np.zeros(0, np.float32)


class Resample:
    """Float samples [n] from `source_rate` to `target_rate` (soxr, streamed: its chunks join to the
    one-shot resample)."""

    def __init__(self, source_rate: int, target_rate: int):
        self.stream = soxr.ResampleStream(source_rate, target_rate, 1, dtype="float32")

    def push(self, samples: np.ndarray) -> np.ndarray:
        return self.stream.resample_chunk(np.ascontiguousarray(samples, dtype=np.float32).reshape(-1))

    def finish(self) -> np.ndarray:
        return self.stream.resample_chunk(np.zeros(0, np.float32), last=True)


class Gain:
    """Float samples times 10^(volume_db / 20): a loudness change in decibels (Fish Audio's
    `prosody.volume`). Samples pushed past full scale are clipped where they become 16-bit."""

    def __init__(self, volume_db: float):
        self.factor = np.float32(10.0 ** (volume_db / 20.0))

    def push(self, samples: np.ndarray) -> np.ndarray:
        return np.asarray(samples, dtype=np.float32) * self.factor

    def finish(self) -> np.ndarray:
        return np.zeros(0, np.float32)


class OutputAudio:
    """A take's float samples at the model's rate -> the response's samples: `speed` applied, then
    resampled to `rate`, then `volume_db` applied. `push(samples)` returns what is ready, `finish()`
    the rest; with speed 1.0, the model's rate and 0 dB it passes samples through untouched."""

    def __init__(self, model_rate: int, rate: int, speed: float = 1.0, volume_db: float = 0.0):
        self.model_rate, self.rate, self.speed, self.volume_db = model_rate, rate, speed, volume_db
        self.stages = []
        if speed != 1.0:
            self.stages.append(TimeStretch(model_rate, speed))
        if rate != model_rate:
            self.stages.append(Resample(model_rate, rate))
        if volume_db != 0.0:
            self.stages.append(Gain(volume_db))

    def push(self, samples: np.ndarray) -> np.ndarray:
        for stage in self.stages:
            samples = stage.push(samples)
        return samples

    def finish(self) -> np.ndarray:
        """The samples the stages still hold, each stage's tail passed through the stages after it."""
        tail = np.zeros(0, np.float32)
        for stage in self.stages:
            tail = np.concatenate([stage.push(tail), stage.finish()]) if tail.size else stage.finish()
        return tail

    def whole(self, samples: np.ndarray) -> np.ndarray:
        """A whole take at once: `push` then `finish`."""
        return np.concatenate([self.push(samples), self.finish()])


def can_stretch() -> bool:
    """Whether `speed` other than 1.0 can be served here (PyAV is installed)."""
    return av is not None
