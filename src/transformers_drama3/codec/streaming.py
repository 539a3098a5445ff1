"""Encoding and decoding piece by piece with exact causal state.

Each streaming object owns one `StreamCache` (see `modeling_codec`): every causal convolution
keeps its last `kernel - stride` inputs, every transposed convolution its last input frames,
every window-limited transformer the keys/values of its last `window - 1` positions and its
position counter. That state has a fixed size, so a long stream costs the same memory per step
as a short one, and the output of any chunking (down to one frame at a time) equals one offline
call up to float rounding.

The serving code Fish ships decodes in windows of 10, 10, 12, 32, then 64 frames and re-decodes
a 32-frame overlap before each window to hide the seams of a stateless decoder. With the exact
state kept here there is no seam: push each window once, no overlap needed.
`stream_decode_windows()` gives that schedule, for the generation code to pace its pushes.

Speed: weight norm recomputes every convolution's weight on each push. Around a whole stream,
`with torch.nn.utils.parametrize.cached():` computes them once (inference only).
"""

from collections.abc import Iterator
from itertools import chain, repeat

import torch

from .audio import as_float_waveform, check_codes

SERVING_FIRST_WINDOWS = (10, 10, 12, 32)
"""Frames per decode window at the start of a stream in the published serving code."""
SERVING_STEADY_WINDOW = 64
"""Frames per decode window after the first ones."""
SERVING_OVERLAP = 32
"""Frames the published (stateless) serving decoder re-decodes before each window; not needed here."""


def stream_decode_windows() -> Iterator[int]:
    """Frames per decode window, forever: 10, 10, 12, 32, 64, 64, ... (the serving schedule:
    short first windows for a fast first sound, then long ones for throughput)."""
    return chain(SERVING_FIRST_WINDOWS, repeat(SERVING_STEADY_WINDOW))


def _as_batch(chunk: torch.Tensor, batch_size: int, name: str, layout: str) -> torch.Tensor:
    if chunk.dim() == len(layout.split(",")) - 1:
        chunk = chunk[None]
    if chunk.shape[0] != batch_size:
        raise ValueError(f"{name} has shape {tuple(chunk.shape)}; expected [{layout}] with batch {batch_size}")
    return chunk


class StreamingEncoder:
    """Audio at the codec's rate in, codes out, as it arrives.

    `push(audio)` takes `[samples]` (batch 1) or `[batch, samples]` of any length (numpy or
    torch, float or PCM integers) and returns the codes `[batch, num_codebooks, frames]` of the
    frames completed so far (often 0 frames); samples of an unfinished frame wait for the next
    push. `flush()` pads the waiting samples with silence to one last frame, returns its codes
    and ends the stream. No resampling: feed audio at `codec.sampling_rate`.
    """

    def __init__(self, codec, batch_size: int = 1):
        self.codec = codec
        self.batch_size = batch_size
        self.cache = {}
        self.pending = torch.zeros(batch_size, 0, device=codec.device, dtype=codec.dtype)
        self.samples_in = 0
        self.closed = False

    @torch.no_grad()
    def push(self, audio) -> torch.Tensor:
        if self.closed:
            raise ValueError("this StreamingEncoder was flushed; start a new one with codec.streaming_encoder()")
        chunk = _as_batch(as_float_waveform(audio, "audio chunk"), self.batch_size, "audio chunk", "batch, samples")
        if not torch.isfinite(chunk).all():
            raise ValueError("audio chunk has NaN or infinite samples; expected finite values in [-1, 1]")
        self.samples_in += chunk.shape[-1]
        self.pending = torch.cat([self.pending, chunk.to(self.pending)], dim=-1)
        frames = self.pending.shape[-1] // self.codec.hop_length
        ready, self.pending = self.pending.split([frames * self.codec.hop_length, self.pending.shape[-1] - frames * self.codec.hop_length], dim=-1)
        return self.codec.encode_frames(ready, self.cache)

    @torch.no_grad()
    def flush(self) -> torch.Tensor:
        """Codes `[batch, num_codebooks, 0 or 1]` of the last, silence-padded frame; ends the stream."""
        self.closed = True
        if self.pending.shape[-1] == 0:
            return torch.zeros(self.batch_size, self.codec.num_codebooks, 0, dtype=torch.long, device=self.codec.device)
        padding = self.codec.hop_length - self.pending.shape[-1]
        last = torch.nn.functional.pad(self.pending, (0, padding))
        self.pending = self.pending[:, :0]
        return self.codec.encode_frames(last, self.cache)


class StreamingDecoder:
    """Codes in, audio out, frame by frame.

    `push(codes)` takes `[num_codebooks, frames]` (batch 1) or `[batch, num_codebooks, frames]`
    and returns their audio `[batch, frames * hop_length]` at once: the decoder is causal with
    no look-ahead, so nothing waits. `flush()` returns the (empty) rest and ends the stream.
    """

    def __init__(self, codec, batch_size: int = 1):
        self.codec = codec
        self.batch_size = batch_size
        self.cache = {}
        self.frames_in = 0
        self.closed = False

    @torch.no_grad()
    def push(self, codes) -> torch.Tensor:
        if self.closed:
            raise ValueError("this StreamingDecoder was flushed; start a new one with codec.streaming_decoder()")
        codes, _ = check_codes(codes, self.codec.num_codebooks, name="codes chunk")
        codes = _as_batch(codes, self.batch_size, "codes chunk", "batch, codebooks, frames")
        self.frames_in += codes.shape[-1]
        return self.codec.decode_frames(codes.to(self.codec.device), self.cache)

    @torch.no_grad()
    def flush(self) -> torch.Tensor:
        """Audio `[batch, 0]`: nothing is held back. Ends the stream."""
        self.closed = True
        return torch.zeros(self.batch_size, 0, device=self.codec.device, dtype=self.codec.dtype)


def cached_elements(stream: StreamingEncoder | StreamingDecoder) -> int:
    """Number of tensor elements a stream holds as state (bounded: it does not grow with time)."""
    total = 0
    for state in stream.cache.values():
        tensors = [state] if isinstance(state, torch.Tensor) else [*state.keys, *state.values]
        total += sum(t.numel() for t in tensors)
    pending = getattr(stream, "pending", None)
    return total + (pending.numel() if pending is not None else 0)


__all__ = [
    "StreamingEncoder",
    "StreamingDecoder",
    "stream_decode_windows",
    "cached_elements",
    "SERVING_FIRST_WINDOWS",
    "SERVING_STEADY_WINDOW",
    "SERVING_OVERLAP",
]
