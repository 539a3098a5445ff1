"""A phonetic codec for drama3-tiny: each frame's codes say which phoneme sounds, and in which voice.

The log-mel residual-VQ codec spreads the words over all its levels, and a small model's tower
gets most of the fine levels wrong (recipes/drama3_tiny/README.md, "Where the words are lost").
This codec's codes are what a text-to-speech model can predict from its text: the phoneme that
sounds in each spectrogram frame (four per codec frame) and the voice. A recogniser (a stack of
dilated convolutions over the log-mel) writes them; a decoder (the same stack over the codes)
turns them back into a log-mel spectrogram, and Griffin-Lim into audio, as in the log-mel codec.

    audio [B, T] at 22.05 kHz
      -> log-mel (n_fft 1024, hop 256, 80 bands), as `Drama3MelCodecModel`
      -> recogniser: per spectrogram frame a phoneme (of `phonemes`) and voice (of `voices`) score
      -> codes [B, 1 + m, T / 1024], m = 4 spectrogram frames a codec frame:
           codebook 0: the phoneme of the frame's first spectrogram frame
           codebook 1: the voice (the best mean score over the frame's spectrogram frames)
           codebooks 2..m: the phonemes of its other spectrogram frames
    codes -> decoder (phoneme + voice embeddings, the convolution stack) -> log-mel
          -> Griffin-Lim block by block (`LogMelGriffinLimCodec`)

Both stacks use unpadded convolutions: a spectrogram frame's output depends on a fixed window
of inputs, `left` frames before it and `right` after (`receptive_field`, `decoder_receptive_field`); beyond the audio the
input is silence (encoding) or the silence phoneme in the edge frame's voice (decoding). So a
stream gives exactly what the whole input gives: the streaming encoder waits `right`
spectrogram frames of audio after a frame, the decoder `decode_lookahead_frames` codec frames
after a block. Both nets are trained by `recipes/drama3_tiny/phone_codec_fit.py` on speech
whose phonemes are known (espeak-ng's phoneme events).
"""

import math

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import initialization as init

from .mel_codec import Drama3MelCodecConfig, LogMelGriffinLimCodec, MelStreamState, take_whole_hops

SILENCE = "_"


@strict
class Drama3PhoneCodecConfig(Drama3MelCodecConfig):
    r"""
    Sizes of the phonetic codec; the spectrogram and Griffin-Lim sizes are the log-mel codec's.

    Args:
        phonemes: the phoneme labels, the silence label "_" first; codes index this list.
        voices: the voice labels; codebook 1 indexes this list.
        hidden_size: channels of the recogniser's and decoder's convolution stacks.
        kernel_size: taps of each dilated convolution.
        dilations: one residual convolution layer per entry, with this dilation.
        lookahead: spectrogram frames each layer looks ahead (at most its span); the rest of its
            span looks back.
        decoder_dilations: the decoder's layers, when they differ from the recogniser's
            (`dilations`); None gives the decoder the same stack.
        decoder_lookahead: the decoder layers' lookahead, one number for every layer or one per
            layer; None takes `lookahead`.
        num_codebooks: 1 + `mel_frames_per_frame` (the phonemes, and the voice).
        codebook_size: codes per codebook; at least the number of phonemes and of voices.
    """

    model_type = "drama3_phone_codec"

    phonemes: list[str] | tuple[str, ...] = (SILENCE,)
    voices: list[str] | tuple[str, ...] = ("voice",)
    hidden_size: int = 256
    kernel_size: int = 5
    dilations: list[int] | tuple[int, ...] = (1, 2, 4, 8, 1, 2, 4, 8)
    lookahead: int = 4
    decoder_dilations: list[int] | tuple[int, ...] | None = None
    decoder_lookahead: int | list[int] | tuple[int, ...] | None = None
    num_codebooks: int = 5

    def validate_phone_sizes(self):
        """Raise ValueError when the labels or sizes cannot form this codec."""
        if not self.phonemes or self.phonemes[0] != SILENCE or len(set(self.phonemes)) != len(self.phonemes):
            raise ValueError(f"phonemes must be distinct labels with the silence label {SILENCE!r} first")
        if not self.voices or len(set(self.voices)) != len(self.voices):
            raise ValueError("voices must be one or more distinct labels")
        if self.num_codebooks != 1 + self.hop_length // self.mel_hop_length:
            raise ValueError(
                f"num_codebooks {self.num_codebooks} must be 1 + mel frames per codec frame "
                f"({1 + self.hop_length // self.mel_hop_length}): the phonemes and the voice"
            )
        if self.codebook_size < max(len(self.phonemes), len(self.voices)):
            raise ValueError(
                f"codebook_size {self.codebook_size} is smaller than the {len(self.phonemes)} phonemes "
                f"or {len(self.voices)} voices"
            )
        if isinstance(self.decoder_lookahead, (list, tuple)) and len(self.decoder_lookahead) != len(
                self.dilations if self.decoder_dilations is None else self.decoder_dilations):
            raise ValueError("decoder_lookahead, given per layer, needs one number per decoder dilation")
        for part in ("recogniser", "decoder"):
            dilations, lookaheads = self.stack(part)
            if self.kernel_size < 1 or not dilations or min(dilations) < 1 or min(lookaheads) < 0:
                raise ValueError(f"the {part}'s kernel_size and dilations must be >= 1 and its lookahead >= 0")

    def stack(self, part: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(dilation, lookahead) of each layer of the "recogniser" or the "decoder" stack."""
        if part == "recogniser":
            dilations, lookahead = self.dilations, self.lookahead
        elif part == "decoder":
            dilations = self.dilations if self.decoder_dilations is None else self.decoder_dilations
            lookahead = self.lookahead if self.decoder_lookahead is None else self.decoder_lookahead
        else:
            raise ValueError(f"part must be 'recogniser' or 'decoder', got {part!r}")
        lookaheads = tuple(lookahead) if isinstance(lookahead, (list, tuple)) else (lookahead,) * len(dilations)
        return tuple(dilations), lookaheads

    def part_receptive_field(self, part: str) -> tuple[int, int]:
        """(frames before, frames after) a spectrogram frame that `part`'s output for it reads."""
        dilations, lookaheads = self.stack(part)
        spans = [(self.kernel_size - 1) * d for d in dilations]
        right = sum(min(ahead, span) for ahead, span in zip(lookaheads, spans))
        return sum(spans) - right, right

    @property
    def receptive_field(self) -> tuple[int, int]:
        """The recogniser's receptive field (`part_receptive_field("recogniser")`)."""
        return self.part_receptive_field("recogniser")

    @property
    def decoder_receptive_field(self) -> tuple[int, int]:
        return self.part_receptive_field("decoder")


class ConvLayer(nn.Module):
    """Pre-norm residual layer: per-frame LayerNorm, dilated convolution (unpadded), GELU, 1x1."""

    def __init__(self, channels: int, kernel_size: int, dilation: int, lookahead: int):
        super().__init__()
        span = (kernel_size - 1) * dilation
        self.right = min(lookahead, span)
        self.left = span - self.right
        self.norm = nn.LayerNorm(channels)
        self.conv = nn.Conv1d(channels, channels, kernel_size, dilation=dilation)
        self.mix = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[batch, channels, frames]` -> `[batch, channels, frames - span]` (the frames whose window is inside)."""
        h = self.conv(self.norm(x.transpose(1, 2)).transpose(1, 2))
        return x[..., self.left : x.shape[-1] - self.right] + self.mix(F.gelu(h))


class ConvStack(nn.Module):
    """The layers of `part`'s dilations; output frame t reads input frames t - left .. t + right."""

    def __init__(self, config: Drama3PhoneCodecConfig, part: str):
        super().__init__()
        self.layers = nn.ModuleList(
            ConvLayer(config.hidden_size, config.kernel_size, dilation, lookahead)
            for dilation, lookahead in zip(*config.stack(part))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Drama3PhoneCodecModel(LogMelGriffinLimCodec):
    """Phonetic codec (see the module docstring): recogniser + decoder + Griffin-Lim.

    Weights: `input_mean` / `input_scale` `[n_mels, 1]` (the recogniser's input standardisation,
    fitted), the recogniser (`recogniser_input`, `recogniser`, `recogniser_norm`, `phoneme_head`,
    `voice_head`) and the decoder (`phoneme_embedding`, `voice_embedding`, `decoder`,
    `decoder_norm`, `decoder_output`), trained; the filterbank and window come from the config."""

    config_class = Drama3PhoneCodecConfig
    config: Drama3PhoneCodecConfig

    def __init__(self, config: Drama3PhoneCodecConfig):
        super().__init__(config)
        config.validate_codec_sizes()
        config.validate_phone_sizes()
        width = config.hidden_size
        self.input_mean = nn.Parameter(torch.zeros(config.n_mels, 1), requires_grad=False)
        self.input_scale = nn.Parameter(torch.ones(config.n_mels, 1), requires_grad=False)
        self.recogniser_input = nn.Conv1d(config.n_mels, width, 1)
        self.recogniser = ConvStack(config, "recogniser")
        self.recogniser_norm = nn.LayerNorm(width)
        self.phoneme_head = nn.Linear(width, len(config.phonemes))
        self.voice_head = nn.Linear(width, len(config.voices))
        self.phoneme_embedding = nn.Embedding(len(config.phonemes), width)
        self.voice_embedding = nn.Embedding(len(config.voices), width)
        self.decoder = ConvStack(config, "decoder")
        self.decoder_norm = nn.LayerNorm(width)
        self.decoder_output = nn.Linear(width, config.n_mels)
        self._register_mel_buffers()
        self.post_init()

    def _init_weights(self, module):
        """Default initialisation for the layers; the standardisation starts as the identity and
        the filterbank and window are computed from the config."""
        if module is self:
            init.zeros_(self.input_mean)
            init.ones_(self.input_scale)
            self._init_mel_buffers()
        elif isinstance(module, (nn.Conv1d, nn.Linear)):
            init.normal_(module.weight, std=1.0 / math.sqrt(module.weight[0].numel()))
            init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, std=1.0)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)

    @property
    def frames_per_code(self) -> int:
        return self.config.mel_frames_per_frame

    # -- recogniser: log-mel -> per spectrogram frame phoneme and voice scores ---------------------

    def recognise(self, log_mel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log-mel `[batch, n_mels, left + frames + right]` (the receptive field's context around
        the frames) -> (phoneme logits `[batch, frames, phonemes]`, voice logits `[batch, frames, voices]`)."""
        hidden = self.recogniser(self.recogniser_input((log_mel - self.input_mean) / self.input_scale))
        hidden = F.gelu(self.recogniser_norm(hidden.transpose(1, 2)))
        return self.phoneme_head(hidden), self.voice_head(hidden)

    def codes_from_scores(self, phoneme_logits: torch.Tensor, voice_logits: torch.Tensor) -> torch.Tensor:
        """Per spectrogram frame scores `[batch, frames * m, ...]` -> codes `[batch, 1 + m, frames]`."""
        batch, steps, _ = phoneme_logits.shape
        m = self.frames_per_code
        phonemes = phoneme_logits.argmax(-1).reshape(batch, steps // m, m)
        voice = voice_logits.log_softmax(-1).reshape(batch, steps // m, m, -1).mean(2).argmax(-1)
        return torch.cat([phonemes[..., :1], voice[..., None], phonemes[..., 1:]], dim=-1).transpose(1, 2)

    def encode_log_mel(self, log_mel: torch.Tensor) -> torch.Tensor:
        """log-mel `[batch, n_mels, left + frames * m + right]` -> codes `[batch, 1 + m, frames]`."""
        return self.codes_from_scores(*self.recognise(log_mel))

    def silent_log_mel(self, batch: int, frames: int, device=None) -> torch.Tensor:
        """The log-mel of silence: `[batch, n_mels, frames]` at the log floor."""
        return torch.full((batch, self.config.n_mels, frames), math.log(self.config.log_floor), device=device)

    def encode_frames(self, audio: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """audio `[batch, frames * hop_length]` -> codes `[batch, 1 + m, frames]`, the audio taken
        as preceded and followed by silence (`history` is not used: the receptive field's
        silence is the start of the audio)."""
        if audio.shape[-1] < self.hop_length:
            return torch.zeros(audio.shape[0], self.num_codebooks, 0, dtype=torch.long, device=audio.device)
        left, right = self.config.receptive_field
        hop = self.config.mel_hop_length
        tail = audio.new_zeros(audio.shape[0], right * hop)
        log_mel = self.log_mel(torch.cat([audio.float(), tail], dim=-1))
        log_mel = torch.cat([self.silent_log_mel(audio.shape[0], left, audio.device), log_mel], dim=-1)
        return self.encode_log_mel(log_mel)

    # -- decoder: codes -> log-mel ---------------------------------------------------------------

    def code_frames(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """codes `[batch, 1 + m, frames]` -> (phoneme per spectrogram frame, voice per spectrogram
        frame), each `[batch, frames * m]`; codes above a label list are clamped to its last."""
        m = self.frames_per_code
        phonemes = torch.cat([codes[:, :1], codes[:, 2:]], dim=1).transpose(1, 2).reshape(codes.shape[0], -1)
        voices = codes[:, 1:2].expand(-1, m, -1).transpose(1, 2).reshape(codes.shape[0], -1)
        return phonemes.clamp(max=len(self.config.phonemes) - 1), voices.clamp(max=len(self.config.voices) - 1)

    def decode_labels(self, phonemes: torch.Tensor, voices: torch.Tensor) -> torch.Tensor:
        """Per spectrogram frame labels `[batch, left + steps + right]` -> log-mel `[batch, n_mels, steps]`."""
        hidden = (self.phoneme_embedding(phonemes) + self.voice_embedding(voices)).transpose(1, 2)
        hidden = self.decoder_norm(self.decoder(hidden).transpose(1, 2))
        return self.decoder_output(hidden).transpose(1, 2)

    @property
    def decode_lookahead_frames(self) -> int:
        """Codec frames after a block that its spectrogram reads (the decoder's lookahead)."""
        return -(-self.config.decoder_receptive_field[1] // self.frames_per_code)

    def _block_log_mel(self, pending: torch.Tensor, take: int, state: MelStreamState):
        """The log-mel of the first `take` frames of `pending`, read with the codes before them
        (`state.history`; silence in the first frame's voice at the start) and after them
        (`pending`; silence in the last frame's voice past the end)."""
        left, right = self.config.decoder_receptive_field
        m = self.frames_per_code
        before = state.history if state.history is not None else pending[..., :0]
        window = torch.cat([before, pending[..., : take + self.decode_lookahead_frames]], dim=-1)
        phonemes, voices = self.code_frames(window)
        low, high = before.shape[-1] * m - left, (before.shape[-1] + take) * m + right
        pad_left, pad_right = max(0, -low), max(0, high - phonemes.shape[-1])
        phonemes, voices = phonemes[:, max(0, low) : high], voices[:, max(0, low) : high]
        phonemes = F.pad(phonemes, (pad_left, pad_right), value=0)
        voices = torch.cat([voices[:, :1].expand(-1, pad_left), voices, voices[:, -1:].expand(-1, pad_right)], dim=-1)
        kept = -(-left // m)  # codec frames the next block reads back
        history = torch.cat([before, pending[..., :take]], dim=-1)[..., -kept:] if kept else None
        return self.decode_labels(phonemes, voices), state._replace(history=history)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """codes `[batch, 1 + m, frames]` -> log-mel `[batch, n_mels, frames * m]`, the codes taken as
        preceded and followed by silence (what `decode` synthesises, in one piece)."""
        log_mel, _ = self._block_log_mel(codes, codes.shape[-1], self._start_state(codes.shape[0], codes.device))
        return log_mel

    def streaming_encoder(self, batch_size: int = 1) -> "PhoneStreamingEncoder":
        return PhoneStreamingEncoder(self, batch_size)


class PhoneStreamingEncoder:
    """Audio at the codec's rate in, codes out: `push(audio)` returns the codes of every frame
    whose receptive field has arrived, `flush()` ends the audio with silence and returns the
    rest. The concatenation equals `encode`."""

    def __init__(self, codec: Drama3PhoneCodecModel, batch_size: int = 1):
        self.codec = codec
        self.batch_size = batch_size
        config = codec.config
        self.left, self.right = config.receptive_field
        self.samples = torch.zeros(batch_size, config.n_fft - config.mel_hop_length, device=codec.device)
        self.pending = torch.zeros(batch_size, 0, device=codec.device)
        self.log_mel = codec.silent_log_mel(batch_size, self.left, codec.device)  # frames not yet encoded, with context
        self.analysed = 0  # spectrogram frames analysed so far
        self.closed = False

    def _analyse(self, audio: torch.Tensor) -> None:
        """Append the spectrogram frames of `audio` (whole spectrogram hops) to `self.log_mel`."""
        if audio.shape[-1]:
            frames = self.codec.log_mel(audio, self.samples)
            self.samples = torch.cat([self.samples, audio], dim=-1)[:, -self.samples.shape[-1] :]
            self.log_mel = torch.cat([self.log_mel, frames], dim=-1)
            self.analysed += frames.shape[-1]

    def _encode_ready(self) -> torch.Tensor:
        m = self.codec.frames_per_code
        ready = (self.log_mel.shape[-1] - self.left - self.right) // m
        if ready <= 0:
            return torch.zeros(self.batch_size, self.codec.num_codebooks, 0, dtype=torch.long, device=self.codec.device)
        codes = self.codec.encode_log_mel(self.log_mel[..., : self.left + ready * m + self.right])
        self.log_mel = self.log_mel[..., ready * m :]
        return codes

    @torch.no_grad()
    def push(self, audio) -> torch.Tensor:
        self._analyse(take_whole_hops(self, audio, self.codec.config.mel_hop_length))
        return self._encode_ready()

    @torch.no_grad()
    def flush(self) -> torch.Tensor:
        """The rest: the audio padded with silence to a whole codec frame, then the silence the
        last frames' lookahead reads."""
        self.closed = True
        config = self.codec.config
        m, hop = self.codec.frames_per_code, config.mel_hop_length
        analysed, pending = self.analysed, self.pending.shape[-1]
        if analysed == 0 and pending == 0:
            return torch.zeros(self.batch_size, self.codec.num_codebooks, 0, dtype=torch.long, device=self.codec.device)
        # the spectrogram frames of the last codec frame (audio padded with silence), then the lookahead's
        frames_total = -(-(analysed * hop + pending) // (m * hop)) * m
        tail = (frames_total - analysed + self.right) * hop - pending
        self._analyse(torch.cat([self.pending, self.pending.new_zeros(self.batch_size, tail)], dim=-1))
        self.pending = self.pending[:, :0]
        return self._encode_ready()


__all__ = ["Drama3PhoneCodecConfig", "Drama3PhoneCodecModel", "PhoneStreamingEncoder"]
