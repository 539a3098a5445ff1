"""A take's audio out of the codec: decoded whole (`decode_audio`) or streamed window by window
(`WaveformStreamer`), with the click rule applied frame by frame (`ClickFilter`).

The decode step reports frames (`decoding.loop.FrameStep`); these turn them into waveforms with
the codec's causal streaming decoder, which keeps its state between windows, so a streamed take's
chunks concatenate to the offline decode of the same frames. Every caller that speaks (generate,
stream, long-form, the text stream, the server, the demo) decodes through here, each frame once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from itertools import chain
from dataclasses import dataclass, field

import torch

from .streaming import stream_decode_windows


class ClickFilter:
    """Streaming counterpart of the click rule, for one item: a `<|semantic:0|>` frame is held back
    one step and dropped if eos follows it; a line boundary releases it."""

    def __init__(self):
        self.held: torch.Tensor | None = None

    def release(self, step: FrameStep, item: int = 0) -> list[torch.Tensor]:
        """Frames [num_codebooks] that are now final."""
        if step.boundary is not None and bool(step.boundary[item]):
            released = [] if self.held is None else [self.held]
            self.held = None
            return released
        if not bool(step.produced[item]):
            self.held = None  # eos (or already ended): a held frame was a click
            return []
        released = [] if self.held is None else [self.held]
        self.held = None
        frame = step.frames[item]
        if int(frame[0]) == 0 and not bool(step.ended[item]):
            self.held = frame
        else:
            released.append(frame)
        return released


# ----------------------------------------------------------------------------- waveform streaming


def default_stream_windows() -> Iterator[int]:
    """Frames per streamed waveform chunk: 10, 10, 12, 32, then 64 for ever (the codec's serving
    schedule, `codec.streaming.stream_decode_windows`)."""
    return stream_decode_windows()


@dataclass
class AudioChunk:
    """A piece of a streamed take.

    audio: [samples] waveform at `sampling_rate`; codes: [frames, num_codebooks] the frames it
    decodes; first_frame: index of its first frame in the take; elapsed: seconds since the
    request started when the chunk was ready (the first chunk's is the time to first audio);
    line_boundaries: line boundaries (frame indices in the take, as `Drama3GenerationOutput.
    line_boundaries`) reported with this chunk: each with the first chunk that ends at or after it
    once the separator is drawn, so all of them up to the end of this chunk are known.
    """

    audio: torch.Tensor | None
    codes: torch.Tensor
    first_frame: int
    elapsed: float
    sampling_rate: int
    is_last: bool = False
    line_boundaries: list[int] = field(default_factory=list)


class WaveformStreamer:
    """Turns final frames into waveform chunks with the codec's streaming decoder, one window at
    a time. The decoder is causal and keeps its state between windows, so the chunks concatenate
    to the offline decode of the same frames. `first_window`: frames of the first chunk (and of
    the first chunk after each `end_window`) in place of the schedule's first 10: fewer frames
    make the first audio sooner (a request's latency mode)."""

    def __init__(self, codec, started: float, windows: Iterator[int] | None = None, first_window: int | None = None):
        if first_window is not None and first_window < 1:
            raise ValueError(f"first_window: {first_window!r}; expected a positive number of frames")
        self.codec = codec
        self.first_window = first_window
        self.decoder = codec.streaming_decoder(batch_size=1) if codec is not None else None
        self.windows = windows if windows is not None else self._schedule()
        self.window = next(self.windows) if self.windows is not None else 1
        self.pending: list[torch.Tensor] = []
        self.emitted_frames = 0
        self.started = started
        self.time_to_first_audio: float | None = None
        self.sampling_rate = codec.sampling_rate if codec is not None else None
        self.unreported_boundaries: list[int] = []

    def mark_boundary(self) -> None:
        """A line ends after the frames pushed so far."""
        self.unreported_boundaries.append(self.emitted_frames + len(self.pending))

    def step(self, clicks: ClickFilter, step: FrameStep) -> list[AudioChunk]:
        """Push what one decode step made final (item 0) and note its line boundary."""
        chunks = self.push(clicks.release(step))
        if step.boundary is not None and bool(step.boundary[0]):
            self.mark_boundary()
        return chunks

    def push(self, frames: list[torch.Tensor]) -> list[AudioChunk]:
        self.pending.extend(frames)
        chunks = []
        while len(self.pending) >= self.window:
            chunks.append(self._emit(self.window, is_last=False))
            self.window = next(self.windows) if self.windows is not None else 1
        return chunks

    def end_window(self) -> list[AudioChunk]:
        """Emit the frames pushed so far as a short window and start the window schedule again
        (10, 10, 12, ...): a turn of streaming text input ended, and its audio must not wait for
        frames of a turn whose text may not have arrived yet."""
        chunks = [self._emit(len(self.pending), is_last=False)] if self.pending else []
        self.windows = self._schedule()
        self.window = next(self.windows) if self.windows is not None else 1
        return chunks

    def _schedule(self) -> Iterator[int] | None:
        """The codec's window schedule, its first window `first_window` when one is set (None
        without a codec: every frame is a chunk)."""
        if self.codec is None:
            return None
        windows = default_stream_windows()
        if self.first_window is not None:
            next(windows)
            windows = chain((self.first_window,), windows)
        return windows

    def finish(self) -> list[AudioChunk]:
        chunk = self._emit(len(self.pending), is_last=True)
        if self.decoder is not None and hasattr(self.decoder, "flush"):
            tail = self.decoder.flush()
            if tail is not None and chunk.audio is not None and tail.numel():
                chunk.audio = torch.cat((chunk.audio, tail.reshape(-1).to(chunk.audio)))
        return [chunk]

    def _emit(self, frames: int, is_last: bool) -> AudioChunk:
        taken, self.pending = self.pending[:frames], self.pending[frames:]
        codes = torch.stack(taken) if taken else torch.zeros(0, 0, dtype=torch.long)
        audio = None
        if self.decoder is not None:
            if taken:
                audio = self.decoder.push(codes.T[None].to(self.codec.device))[0].reshape(-1)
            else:
                audio = torch.zeros(0, device=self.codec.device)
        elapsed = time.perf_counter() - self.started
        if self.time_to_first_audio is None and taken:
            self.time_to_first_audio = elapsed
        chunk = AudioChunk(audio, codes, self.emitted_frames, elapsed, self.sampling_rate, is_last)
        self.emitted_frames += len(taken)
        chunk.line_boundaries = [b for b in self.unreported_boundaries if b <= self.emitted_frames or is_last]
        self.unreported_boundaries = self.unreported_boundaries[len(chunk.line_boundaries) :]
        return chunk


def put_chunk(streamer, chunk: AudioChunk) -> None:
    """A streamer receives waveform chunks [samples], or frames [1, frames, num_codebooks] without a codec."""
    streamer.put(chunk.audio if chunk.audio is not None else chunk.codes[None])


def decode_audio(codec, codes: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Waveforms of takes: codes [batch, frames, num_codebooks] -> per item [samples]."""
    if codes.shape[1] == 0:
        return [torch.zeros(0, device=codec.device) for _ in range(codes.shape[0])]
    decoded = codec.decode(codes.transpose(1, 2), lengths)
    return [decoded.audio_values[item, : int(decoded.lengths[item])] for item in range(codes.shape[0])]
