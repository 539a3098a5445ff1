"""A log-mel residual-VQ codec with Griffin-Lim synthesis: the drama3-tiny model's codec.

This is the "simpler codec behind the same interface" that drama3-tiny uses instead of a trained
S2 codec (model_card.md says why: on this project's 2-core CPU budget the S2-style codec did not
reach the codec bars). It has the S2 codec's interface — `encode` / `decode` /
`streaming_encoder` / `streaming_decoder`, `num_codebooks` codes per frame, codebook 0 the
coarsest — and the same frame rate (22050 / 1024 = 21.53 frames/s), so the model, processor,
generation and streaming code use it unchanged.

    audio [B, T] at 22.05 kHz
      -> log-mel spectrogram: n_fft 1024, hop 256, 80 bands; frame j covers samples
         [256 j - 768, 256 j + 256) (left-padded, so it never looks ahead)
      -> every 4 mel frames (one codec frame, 1024 samples) -> one 320-dim vector, standardised
      -> residual VQ: codebook k quantises what codebooks 0..k-1 left    codes [B, K, T / 1024]
    codes -> sum of codebook vectors -> log-mel -> linear magnitude (pseudo-inverse of the mel
      filterbank) -> fast Griffin-Lim in blocks of `block_frames` frames, each block starting
      from the phases of the `context_mel_frames` before it, cross-faded over 256 samples

The codebooks are fitted by k-means (`fit_residual_codebooks`), not by gradient descent.

Streaming. Encoding is frame-local (a frame needs the 768 samples before it), so a streaming
encoder equals the offline one exactly. Decoding runs Griffin-Lim block by block at fixed frame
positions; offline `decode` runs the same blocks in the same order, so streaming output equals
offline output, delayed by one block (`block_frames` frames) plus 1024 samples.
"""

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import PreTrainedConfig
from transformers import initialization as init
from transformers.modeling_utils import PreTrainedAudioTokenizerBase

from .audio import as_float_waveform, check_codes
from .modeling_codec import Drama3CodecDecoderOutput, FrameCodec


@strict
class Drama3MelCodecConfig(PreTrainedConfig):
    r"""
    Sizes of the log-mel residual-VQ codec.

    Args:
        sampling_rate: audio sampling rate in Hz.
        hop_length: samples per codec frame; a multiple of `mel_hop_length`.
        n_fft: FFT size (and Hann window length) of the spectrogram.
        mel_hop_length: samples between spectrogram frames.
        n_mels: mel bands.
        f_min / f_max: band edges of the mel filterbank in Hz (`f_max` None: half the rate).
        log_floor: magnitudes are clamped to this before the log.
        num_codebooks: residual codebooks (codes per frame).
        codebook_size: codes per codebook.
        griffin_lim_iterations: Griffin-Lim iterations per block.
        griffin_lim_momentum: the "fast Griffin-Lim" momentum (0: plain Griffin-Lim).
        block_frames: codec frames synthesised per Griffin-Lim block (the streaming delay).
        context_mel_frames: spectrogram frames before a block that its Griffin-Lim also sees
            (their phases start from the previous block's); at least 4.
        crossfade: samples over which consecutive blocks are cross-faded; at most `mel_hop_length`.
        max_audio_seconds: longest audio `encode` accepts.
    """

    model_type = "drama3_mel_codec"

    sampling_rate: int = 22050
    hop_length: int = 1024
    n_fft: int = 1024
    mel_hop_length: int = 256
    n_mels: int = 80
    f_min: float = 0.0
    f_max: float | None = None
    log_floor: float = 1e-5
    num_codebooks: int = 8
    codebook_size: int = 256
    griffin_lim_iterations: int = 32
    griffin_lim_momentum: float = 0.99
    block_frames: int = 8
    context_mel_frames: int = 8
    crossfade: int = 256
    max_audio_seconds: float = 600.0

    def validate_codec_sizes(self):
        """Raise ValueError when the sizes cannot form this codec."""
        if self.hop_length % self.mel_hop_length:
            raise ValueError(f"hop_length {self.hop_length} must be a multiple of mel_hop_length {self.mel_hop_length}")
        if self.n_fft % self.mel_hop_length or self.n_fft < self.mel_hop_length:
            raise ValueError(f"n_fft {self.n_fft} must be a multiple of mel_hop_length {self.mel_hop_length}")
        if self.context_mel_frames < self.n_fft // self.mel_hop_length:
            raise ValueError(
                f"context_mel_frames {self.context_mel_frames} must be at least n_fft / mel_hop_length "
                f"= {self.n_fft // self.mel_hop_length}"
            )
        if not 0 < self.crossfade <= self.mel_hop_length:
            raise ValueError(f"crossfade {self.crossfade} must be in 1..mel_hop_length ({self.mel_hop_length})")
        if self.block_frames < 1 or self.num_codebooks < 1 or self.codebook_size < 2:
            raise ValueError("block_frames, num_codebooks must be >= 1 and codebook_size >= 2")

    @property
    def frame_rate(self) -> float:
        """Codec frames per second (22050 / 1024 = 21.53 by default)."""
        return self.sampling_rate / self.hop_length

    @property
    def mel_frames_per_frame(self) -> int:
        """Spectrogram frames in one codec frame (4 by default)."""
        return self.hop_length // self.mel_hop_length

    @property
    def feature_dim(self) -> int:
        """Size of the vector one codec frame is quantised as (4 x 80 = 320 by default)."""
        return self.mel_frames_per_frame * self.n_mels


def mel_filterbank(sampling_rate: int, n_fft: int, n_mels: int, f_min: float, f_max: float) -> torch.Tensor:
    """Triangular filters on the HTK mel scale, area-normalised: `[n_mels, n_fft // 2 + 1]`."""
    def to_mel(hz):
        return 2595.0 * np.log10(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)

    def to_hz(mel):
        return 700.0 * (10.0 ** (np.asarray(mel) / 2595.0) - 1.0)

    edges = to_hz(np.linspace(to_mel(f_min), to_mel(f_max), n_mels + 2))
    bins = np.linspace(0.0, sampling_rate / 2, n_fft // 2 + 1)
    rising = (bins[None, :] - edges[:-2, None]) / (edges[1:-1, None] - edges[:-2, None])
    falling = (edges[2:, None] - bins[None, :]) / (edges[2:, None] - edges[1:-1, None])
    filters = np.maximum(0.0, np.minimum(rising, falling))
    filters *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(filters.astype(np.float32))


class MelStreamState(NamedTuple):
    """A streaming decoder's state: codes not yet synthesised, the complex spectrogram of the last
    `context_mel_frames` frames, the last block's waveform after the emitted audio, and the
    number of frames synthesised; for a codec whose decoder looks back, the codes already
    synthesised that the next block still sees (`history`)."""

    codes: torch.Tensor
    context: torch.Tensor | None
    carry: torch.Tensor | None
    frames_done: int
    history: torch.Tensor | None = None


class LogMelGriffinLimCodec(FrameCodec, PreTrainedAudioTokenizerBase):
    """What the codecs that code a log-mel spectrogram share: the analysis (`log_mel`), the
    filterbank and window (computed from the config, not stored), and the synthesis (codes ->
    log-mel by the subclass's `dequantize` / `_block_log_mel`, then block-by-block Griffin-Lim,
    the same blocks offline and streaming)."""

    base_model_prefix = "codec"
    main_input_name = "input_values"

    def _register_mel_buffers(self):
        config = self.config
        bins = config.n_fft // 2 + 1
        self.register_buffer("mel_basis", torch.zeros(config.n_mels, bins), persistent=False)
        self.register_buffer("mel_inverse", torch.zeros(bins, config.n_mels), persistent=False)
        self.register_buffer("window", torch.zeros(config.n_fft), persistent=False)

    def _init_mel_buffers(self):
        config = self.config
        f_max = config.f_max if config.f_max is not None else config.sampling_rate / 2
        basis = mel_filterbank(config.sampling_rate, config.n_fft, config.n_mels, config.f_min, f_max)
        init.copy_(self.mel_basis, basis)
        init.copy_(self.mel_inverse, torch.linalg.pinv(basis))
        init.copy_(self.window, torch.hann_window(config.n_fft, periodic=True))

    # -- analysis ------------------------------------------------------------------------------

    def _frames(self, audio: torch.Tensor) -> torch.Tensor:
        """audio `[batch, (n_fft - mel_hop) + frames * mel_hop]` -> windowed frames `[batch, frames, n_fft]`."""
        return audio.unfold(-1, self.config.n_fft, self.config.mel_hop_length) * self.window

    def log_mel(self, audio: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """audio `[batch, samples]` (a multiple of `mel_hop_length`) -> log-mel `[batch, n_mels, samples / mel_hop]`.

        `history`: the `n_fft - mel_hop_length` samples before `audio` (default silence).
        """
        lookback = self.config.n_fft - self.config.mel_hop_length
        if history is None:
            history = audio.new_zeros(audio.shape[0], lookback)
        spectrum = torch.fft.rfft(self._frames(torch.cat([history, audio], dim=-1)), dim=-1).abs()
        mel = spectrum.float() @ self.mel_basis.T
        return torch.log(mel.clamp_min(self.config.log_floor)).transpose(1, 2)

    # -- synthesis -----------------------------------------------------------------------------

    def magnitude(self, log_mel: torch.Tensor) -> torch.Tensor:
        """log-mel `[batch, n_mels, steps]` -> linear magnitude `[batch, steps, n_fft // 2 + 1]`."""
        return (log_mel.exp().transpose(1, 2) @ self.mel_inverse.T).clamp_min(0.0)

    def _overlap_add(self, spectrum: torch.Tensor) -> torch.Tensor:
        """Complex frames `[batch, frames, bins]` -> the waveform under them `[batch, (frames + 3) * hop]`,
        each sample divided by the squared windows covering it (an inverse STFT)."""
        hop, n_fft = self.config.mel_hop_length, self.config.n_fft
        frames = torch.fft.irfft(spectrum, n=n_fft, dim=-1) * self.window
        steps = frames.shape[1]
        length = (steps - 1) * hop + n_fft
        signal = F.fold(frames.transpose(1, 2), (1, length), (1, n_fft), stride=(1, hop))[:, 0, 0]
        envelope = F.fold(
            self.window.square()[None, :, None].expand(1, n_fft, steps), (1, length), (1, n_fft), stride=(1, hop)
        )[:, 0, 0]
        return signal / envelope.clamp_min(1e-3)

    def _griffin_lim(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """Fast Griffin-Lim: complex spectrogram `[batch, frames, bins]` with `magnitude`, from `phase`."""
        spectrum = torch.polar(magnitude, phase)
        previous = spectrum
        for _ in range(self.config.griffin_lim_iterations):
            rebuilt = torch.fft.rfft(self._frames(self._overlap_add(spectrum)), dim=-1)
            accelerated = rebuilt + self.config.griffin_lim_momentum * (rebuilt - previous)
            previous = rebuilt
            spectrum = magnitude * torch.exp(1j * torch.angle(accelerated))
        return spectrum

    def _synthesize_block(self, log_mel: torch.Tensor, state: MelStreamState):
        """Griffin-Lim over one block of spectrogram frames `[batch, n_mels, steps]` (plus the
        context in `state`) -> (audio to emit `[batch, samples]`, the new state).

        In the window's waveform (`_overlap_add` of context + block frames), index `p` is sample
        `p - lookback` after the first window frame's position. A block emits the samples from
        `lookback + crossfade` before its first frame's position to as far before its end
        (those are covered by all their frames), the first `crossfade` of them cross-faded with
        what the previous block left in `carry`; it leaves the rest of its waveform in `carry`.
        """
        config = self.config
        hop, fade = config.mel_hop_length, config.crossfade
        lookback = config.n_fft - hop
        magnitude = self.magnitude(log_mel)
        steps = magnitude.shape[1]
        generator = torch.Generator().manual_seed(state.frames_done // config.block_frames)
        new_phase = (torch.rand(magnitude.shape[-1], generator=generator) * 2 * math.pi).to(magnitude.device)
        new_phase = new_phase.expand(magnitude.shape[0], steps, -1)
        if state.context is not None:
            known = state.context.shape[1]
            magnitude = torch.cat([state.context.abs(), magnitude], dim=1)
            phase = torch.cat([torch.angle(state.context), new_phase], dim=1)
        else:
            known, phase = 0, new_phase
        spectrum = self._griffin_lim(magnitude, phase)
        waveform = self._overlap_add(spectrum)
        end = (known + steps) * hop - fade
        if state.carry is None:  # the stream's first block: start at its sample 0
            region = waveform[:, lookback:end]
        else:
            region = waveform[:, known * hop - fade : end]
            ramp = torch.linspace(0.0, 1.0, fade + 2, device=region.device)[1:-1]
            mixed = state.carry[:, :fade] * (1 - ramp) + region[:, :fade] * ramp
            region = torch.cat([mixed, region[:, fade:]], dim=-1)
        context = spectrum[:, -config.context_mel_frames :]
        frames_done = state.frames_done + steps // config.mel_frames_per_frame
        return region, state._replace(context=context, carry=waveform[:, end:], frames_done=frames_done)

    def _stream_tail(self, carry: torch.Tensor) -> torch.Tensor:
        """The stream's last samples: the last block's `carry`, faded out over the samples that
        fewer than all their frames cover."""
        lookback = self.config.n_fft - self.config.mel_hop_length
        ramp = torch.ones(carry.shape[-1], device=carry.device)
        ramp[-lookback:] = torch.linspace(1.0, 0.0, lookback, device=carry.device)
        return carry * ramp

    def _start_state(self, batch: int, device) -> MelStreamState:
        return MelStreamState(torch.zeros(batch, self.num_codebooks, 0, dtype=torch.long, device=device), None, None, 0)

    decode_lookahead_frames = 0  # codec frames after a block that its spectrogram depends on

    def _block_log_mel(self, pending: torch.Tensor, take: int, state: MelStreamState):
        """The spectrogram of the first `take` frames of `pending` codes (and the state): here the
        codes alone decide it. A codec whose decoder looks around a frame overrides this."""
        return self.dequantize(pending[..., :take]), state

    def decode_frames(self, codes: torch.Tensor, state: MelStreamState | None = None, final: bool = True):
        """codes `[batch, num_codebooks, frames]` -> (audio, state). Synthesises every whole block
        of `block_frames` frames available (with `final`, also the rest and the end of the stream)."""
        state = state if state is not None else self._start_state(codes.shape[0], codes.device)
        pending = torch.cat([state.codes, codes.to(state.codes.device)], dim=-1)
        pieces = []
        block = self.config.block_frames
        ahead = self.decode_lookahead_frames
        while pending.shape[-1] >= block + ahead or (final and pending.shape[-1] > 0):
            take = min(block, pending.shape[-1])
            log_mel, state = self._block_log_mel(pending, take, state)
            audio, state = self._synthesize_block(log_mel, state)
            pieces.append(audio)
            pending = pending[..., take:]
        if final and state.carry is not None:
            pieces.append(self._stream_tail(state.carry))
            state = state._replace(carry=None)
        state = state._replace(codes=pending)
        empty = codes.new_zeros(codes.shape[0], 0, dtype=torch.float32)
        return torch.cat([empty, *pieces], dim=-1) if pieces else empty, state

    @torch.no_grad()
    def synthesize(self, log_mel: torch.Tensor) -> torch.Tensor:
        """log-mel `[batch, n_mels, frames * m]` -> audio `[batch, frames * hop_length]`, by the same
        block-by-block Griffin-Lim as `decode`: `synthesize(dequantize(codes))` is `decode(codes)`
        before its clamp to [-1, 1]. Given `log_mel(audio)` it measures the spectral representation
        and the vocoder without the quantiser."""
        per_block = self.config.block_frames * self.config.mel_frames_per_frame
        state = self._start_state(log_mel.shape[0], log_mel.device)
        pieces = []
        for start in range(0, log_mel.shape[-1], per_block):
            audio, state = self._synthesize_block(log_mel[..., start : start + per_block].float(), state)
            pieces.append(audio)
        if state.carry is not None:
            pieces.append(self._stream_tail(state.carry))
        return torch.cat([log_mel.new_zeros(log_mel.shape[0], 0, dtype=torch.float32), *pieces], dim=-1)

    # -- public API ------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, codes, lengths=None) -> Drama3CodecDecoderOutput:
        """Codes `[batch, num_codebooks, frames]` -> `Drama3CodecDecoderOutput(audio_values [batch,
        frames * hop_length], lengths [batch] samples)`."""
        codes, lengths = check_codes(codes, self.num_codebooks, lengths, name="codes")
        if codes.shape[-1] == 0:
            audio = torch.zeros(codes.shape[0], 0, device=self.device)
        elif bool((lengths == codes.shape[-1]).all()):
            audio, _ = self.decode_frames(codes.to(self.device), final=True)
        else:  # Griffin-Lim looks across a block: each item ends its own stream, as it would alone
            audio = torch.zeros(codes.shape[0], codes.shape[-1] * self.hop_length, device=self.device)
            for item, length in enumerate(lengths.tolist()):
                if length:
                    decoded, _ = self.decode_frames(codes[item : item + 1, :, :length].to(self.device), final=True)
                    audio[item, : decoded.shape[-1]] = decoded[0]
        sample_lengths = lengths.to(audio.device) * self.hop_length
        positions = torch.arange(audio.shape[-1], device=audio.device)
        audio = audio.masked_fill(positions[None, :] >= sample_lengths[:, None], 0.0).clamp(-1.0, 1.0)
        return Drama3CodecDecoderOutput(audio_values=audio, lengths=sample_lengths)

    def forward(self, input_values: torch.Tensor, lengths: torch.Tensor | None = None) -> Drama3CodecDecoderOutput:
        """Reconstruct `input_values` `[batch, samples]` (at the codec's rate): encode, then decode."""
        encoded = self.encode(input_values, sampling_rate=self.sampling_rate, lengths=lengths)
        return self.decode(encoded.audio_codes, encoded.lengths)

    def streaming_decoder(self, batch_size: int = 1) -> "MelStreamingDecoder":
        return MelStreamingDecoder(self, batch_size)


class Drama3MelCodecModel(LogMelGriffinLimCodec):
    """Log-mel residual-VQ codec with Griffin-Lim synthesis (see the module docstring).

    Weights: `feature_mean` / `feature_scale` `[feature_dim]` (the standardisation) and
    `codebooks` `[num_codebooks, codebook_size, feature_dim]`; all fitted, none trained by
    gradient.
    """

    config_class = Drama3MelCodecConfig
    config: Drama3MelCodecConfig

    def __init__(self, config: Drama3MelCodecConfig):
        super().__init__(config)
        config.validate_codec_sizes()
        dim = config.feature_dim
        self.feature_mean = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.feature_scale = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.codebooks = nn.Parameter(torch.zeros(config.num_codebooks, config.codebook_size, dim), requires_grad=False)
        self._register_mel_buffers()
        self.post_init()

    def _init_weights(self, module):
        """Random codebooks (fitting replaces them); the filterbank, its pseudo-inverse and the
        window are computed from the config (they are not stored in checkpoints)."""
        if module is not self:
            return
        config = self.config
        init.zeros_(self.feature_mean)
        init.ones_(self.feature_scale)
        init.normal_(self.codebooks, std=0.5)
        self._init_mel_buffers()

    def features(self, log_mel: torch.Tensor) -> torch.Tensor:
        """log-mel `[batch, n_mels, frames * m]` -> standardised frame vectors `[batch, frames, feature_dim]`."""
        batch, bands, steps = log_mel.shape
        per = self.config.mel_frames_per_frame
        stacked = log_mel.transpose(1, 2).reshape(batch, steps // per, per * bands)
        return (stacked - self.feature_mean) / self.feature_scale

    def quantize(self, features: torch.Tensor) -> torch.Tensor:
        """Frame vectors `[batch, frames, feature_dim]` -> codes `[batch, num_codebooks, frames]`."""
        residual = features.reshape(-1, features.shape[-1])
        codes = []
        for codebook in self.codebooks:
            distance = (residual.square().sum(-1, keepdim=True) - 2 * residual @ codebook.T + codebook.square().sum(-1))
            index = distance.argmin(dim=-1)
            codes.append(index)
            residual = residual - codebook[index]
        return torch.stack(codes, dim=-1).reshape(*features.shape[:2], -1).transpose(1, 2)

    def dequantize(self, codes: torch.Tensor, levels: int | None = None) -> torch.Tensor:
        """codes `[batch, num_codebooks, frames]` -> log-mel `[batch, n_mels, frames * m]`.

        `levels`: sum only the first this many codebooks (what the coarse levels carry); all when
        None. Codes above `codebook_size - 1` are clamped to it (the LM's heads may be wider)."""
        levels = self.num_codebooks if levels is None else levels
        if not 1 <= levels <= self.num_codebooks:
            raise ValueError(f"levels must be 1..{self.num_codebooks}; got {levels}")
        codes = codes.clamp(max=self.config.codebook_size - 1)
        vectors = sum(self.codebooks[k][codes[:, k]] for k in range(levels))
        stacked = vectors * self.feature_scale + self.feature_mean
        batch, frames, _ = stacked.shape
        return stacked.reshape(batch, frames * self.config.mel_frames_per_frame, self.config.n_mels).transpose(1, 2)

    def encode_frames(self, audio: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """audio `[batch, frames * hop_length]` -> codes `[batch, num_codebooks, frames]`."""
        if audio.shape[-1] < self.hop_length:
            return torch.zeros(audio.shape[0], self.num_codebooks, 0, dtype=torch.long, device=audio.device)
        return self.quantize(self.features(self.log_mel(audio.float(), history)))

    def streaming_encoder(self, batch_size: int = 1) -> "MelStreamingEncoder":
        return MelStreamingEncoder(self, batch_size)


def take_whole_hops(encoder, audio, hop: int) -> torch.Tensor:
    """A streaming encoder's `push`: check the audio chunk (finite, `[batch, samples]` of the
    encoder's batch, the encoder not flushed), append it to `encoder.pending` and take from there
    the whole hops of `hop` samples; the rest waits for the next chunk."""
    if encoder.closed:
        raise ValueError("this streaming encoder was flushed; start a new one with codec.streaming_encoder()")
    chunk = as_float_waveform(audio, "audio chunk")
    chunk = chunk[None] if chunk.dim() == 1 else chunk
    if chunk.shape[0] != encoder.batch_size:
        raise ValueError(f"audio chunk has shape {tuple(chunk.shape)}; expected [batch, samples] with batch {encoder.batch_size}")
    if not torch.isfinite(chunk).all():
        raise ValueError("audio chunk has NaN or infinite samples; expected finite values in [-1, 1]")
    encoder.pending = torch.cat([encoder.pending, chunk.to(encoder.pending)], dim=-1)
    whole = encoder.pending.shape[-1] // hop * hop
    ready, encoder.pending = encoder.pending[:, :whole], encoder.pending[:, whole:]
    return ready


class MelStreamingEncoder:
    """Audio at the codec's rate in, codes out: `push(audio)` returns the codes of the frames
    completed so far, `flush()` pads the rest with silence to a last frame. Equals `encode`."""

    def __init__(self, codec: Drama3MelCodecModel, batch_size: int = 1):
        self.codec = codec
        self.batch_size = batch_size
        lookback = codec.config.n_fft - codec.config.mel_hop_length
        self.history = torch.zeros(batch_size, lookback, device=codec.device)
        self.pending = torch.zeros(batch_size, 0, device=codec.device)
        self.closed = False

    def _encode(self, ready: torch.Tensor) -> torch.Tensor:
        codes = self.codec.encode_frames(ready, self.history)
        if ready.shape[-1]:
            self.history = torch.cat([self.history, ready], dim=-1)[:, -self.history.shape[-1] :]
        return codes

    @torch.no_grad()
    def push(self, audio) -> torch.Tensor:
        return self._encode(take_whole_hops(self, audio, self.codec.hop_length))

    @torch.no_grad()
    def flush(self) -> torch.Tensor:
        self.closed = True
        if self.pending.shape[-1] == 0:
            return torch.zeros(self.batch_size, self.codec.num_codebooks, 0, dtype=torch.long, device=self.codec.device)
        last = F.pad(self.pending, (0, self.codec.hop_length - self.pending.shape[-1]))
        self.pending = self.pending[:, :0]
        return self._encode(last)


class MelStreamingDecoder:
    """Codes in, audio out, block by block: `push(codes)` returns the audio of every whole
    Griffin-Lim block received so far (often none), `flush()` the rest. The concatenation equals
    `decode` of all the codes."""

    def __init__(self, codec: "LogMelGriffinLimCodec", batch_size: int = 1):
        self.codec = codec
        self.batch_size = batch_size
        self.state = codec._start_state(batch_size, codec.device)
        self.closed = False

    @torch.no_grad()
    def push(self, codes) -> torch.Tensor:
        if self.closed:
            raise ValueError("this streaming decoder was flushed; start a new one with codec.streaming_decoder()")
        codes, _ = check_codes(codes, self.codec.num_codebooks, name="codes chunk")
        if codes.shape[0] != self.batch_size:
            raise ValueError(f"codes chunk has batch {codes.shape[0]}; expected {self.batch_size}")
        audio, self.state = self.codec.decode_frames(codes.to(self.codec.device), self.state, final=False)
        return audio.clamp(-1.0, 1.0)

    @torch.no_grad()
    def flush(self) -> torch.Tensor:
        self.closed = True
        empty = torch.zeros(self.batch_size, self.codec.num_codebooks, 0, dtype=torch.long, device=self.codec.device)
        audio, self.state = self.codec.decode_frames(empty, self.state, final=True)
        return audio.clamp(-1.0, 1.0)


@torch.no_grad()
def fit_residual_codebooks(
    features: torch.Tensor, num_codebooks: int, codebook_size: int, iterations: int = 20, seed: int = 0,
    init: str = "kmeans++", progress=True,
) -> torch.Tensor:
    """K-means, codebook after codebook, on what the previous codebooks leave:
    features `[n, dim]` (standardised) -> codebooks `[num_codebooks, codebook_size, dim]`.

    `init`: "kmeans++" (spread seeding) or "sample" (a random sample of the vectors; how
    drama3-tiny's shipped codec was fitted). Dead codes are restarted on the worst-fitted vectors."""
    if init not in ("kmeans++", "sample"):
        raise ValueError(f"init must be 'kmeans++' or 'sample'; got {init!r}")
    from tqdm.auto import tqdm

    generator = torch.Generator().manual_seed(seed)
    residual = features.float().clone()
    codebooks = []
    bar = tqdm(total=num_codebooks * iterations, desc="k-means", unit="it", disable=not progress)
    for _ in range(num_codebooks):
        if init == "sample":
            centroids = residual[torch.randperm(residual.shape[0], generator=generator)[:codebook_size]].clone()
        else:
            centroids = _kmeans_plus_plus(residual, codebook_size, generator)
        for _ in range(iterations):
            index = _nearest(residual, centroids)
            sums = torch.zeros_like(centroids).index_add_(0, index, residual)
            counts = torch.bincount(index, minlength=codebook_size).float()
            empty = counts == 0
            centroids = torch.where(empty[:, None], centroids, sums / counts.clamp_min(1)[:, None])
            if empty.any():  # restart dead codes on the worst-fitted vectors
                error = (residual - centroids[index]).square().sum(-1)
                centroids[empty] = residual[error.topk(int(empty.sum())).indices]
            bar.update()
        codebooks.append(centroids)
        residual = residual - centroids[_nearest(residual, centroids)]
    bar.close()
    return torch.stack(codebooks)


def _kmeans_plus_plus(vectors: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding: each next centroid drawn with probability proportional to the squared
    distance to the nearest centroid so far (spreads the start over all clusters)."""
    first = int(torch.randint(vectors.shape[0], (1,), generator=generator))
    chosen = [vectors[first]]
    nearest = (vectors - vectors[first]).square().sum(-1)
    for _ in range(count - 1):
        weights = nearest / nearest.sum() if float(nearest.sum()) > 0 else torch.ones_like(nearest) / len(nearest)
        index = int(torch.multinomial(weights, 1, generator=generator))
        chosen.append(vectors[index])
        nearest = torch.minimum(nearest, (vectors - vectors[index]).square().sum(-1))
    return torch.stack(chosen).clone()


def _nearest(vectors: torch.Tensor, centroids: torch.Tensor, chunk: int = 65536) -> torch.Tensor:
    norms = centroids.square().sum(-1)
    return torch.cat(
        [(norms - 2 * part @ centroids.T).argmin(-1) for part in vectors.split(chunk)]
    )


__all__ = [
    "Drama3MelCodecConfig",
    "Drama3MelCodecModel",
    "LogMelGriffinLimCodec",
    "MelStreamingEncoder",
    "MelStreamingDecoder",
    "fit_residual_codebooks",
    "mel_filterbank",
]
