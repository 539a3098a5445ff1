"""The S2 audio codec: a causal DAC with window-limited transformers and a semantic + residual
vector quantiser.

Module and parameter names follow fish-speech's `modded_dac.py` / `rvq.py`, so the published
`codec.pth` loads without a renaming table (apart from the two spellings of weight norm, see
`convert.py`).

Streaming. Every causal module takes an optional `cache` (a plain dict, one per stream) and keeps
in it, under its own key, what it needs from the past: a convolution its last
`kernel - stride` inputs, a transposed convolution its last input frames, a transformer the keys
and values of its last `window - 1` positions. Offline calls pass no cache, which is the same as
a fresh one (zero left context, position 0), so a stream cut into any whole-frame chunks computes
what one offline call computes.
"""

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm
from transformers.modeling_utils import PreTrainedAudioTokenizerBase
from transformers import initialization as init
from transformers.models.dac.modeling_dac import Snake1d
from transformers.utils import ModelOutput

from ..layers.rope import apply_interleaved_rope, rope_cos_sin
from .audio import check_codes, prepare_audio_batch
from .configuration_codec import Drama3CodecConfig
from .fish_speech import load_fish_speech_codec
from .streaming import StreamingDecoder, StreamingEncoder

StreamCache = dict
"""Per-stream state: causal module -> what it keeps from the past."""


class CausalModule(nn.Module):
    """A module whose `forward(x, cache=None)` can continue a stream held in `cache`."""


class CausalSequential(nn.Sequential):
    """`nn.Sequential` that hands the stream cache to the causal modules it holds."""

    def forward(self, hidden: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        for layer in self:
            if isinstance(layer, (CausalModule, CausalSequential)):
                hidden = layer(hidden, cache)
            else:
                hidden = layer(hidden)
        return hidden


def _read_cache(cache: StreamCache | None, module: nn.Module):
    return None if cache is None else cache.get(module)


def _write_cache(cache: StreamCache | None, module: nn.Module, value) -> None:
    if cache is not None:
        cache[module] = value


class CausalConv1d(CausalModule):
    """Conv1d that sees only the past: left context `dilation * (kernel - 1) + 1 - stride`.

    Input `[batch, in_channels, time]`, output `[batch, out_channels, time // stride]` when
    `time` is a multiple of `stride` (the codec only feeds whole frames). The convolution is
    `self.conv`, as in fish-speech, so weight norm parametrizes `conv.weight`.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, dilation=1, groups=1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.receptive_field = dilation * (kernel_size - 1) + 1
        self.context = self.receptive_field - stride

    def forward(self, hidden: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        past = _read_cache(cache, self)
        if past is None:
            past = hidden.new_zeros(hidden.shape[0], hidden.shape[1], self.context)
        hidden = torch.cat([past, hidden], dim=-1)
        frames = max(0, (hidden.shape[-1] - self.receptive_field) // self.stride + 1)
        # What the next call needs: everything from the start of the next output's window.
        _write_cache(cache, self, hidden[..., frames * self.stride :].clone())
        if frames == 0:
            return hidden.new_zeros(hidden.shape[0], self.conv.out_channels, 0)
        return self.conv(hidden)


class CausalConvTranspose1d(CausalModule):
    """ConvTranspose1d whose output for input frame t depends on frames <= t only.

    Input `[batch, in_channels, frames]`, output `[batch, out_channels, frames * stride]`: the
    first `frames * stride` samples of the full transposed convolution (the tail that needs
    later frames is dropped, as fish-speech does). A stream keeps the last
    `ceil(kernel / stride) - 1` input frames, the ones whose kernel reaches into the next chunk.
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.context = math.ceil(kernel_size / stride) - 1

    def forward(self, hidden: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        frames = hidden.shape[-1]
        past = _read_cache(cache, self)
        if past is None:
            past = hidden.new_zeros(hidden.shape[0], hidden.shape[1], self.context)
        hidden = torch.cat([past, hidden], dim=-1)
        _write_cache(cache, self, hidden[..., hidden.shape[-1] - self.context :].clone())
        if frames == 0:
            return hidden.new_zeros(hidden.shape[0], self.conv.out_channels, 0)
        start = self.context * self.stride
        return self.conv(hidden)[..., start : start + frames * self.stride]


def weight_normed(module: CausalConv1d | CausalConvTranspose1d):
    """Put weight norm (g, v) on `module.conv`, as fish-speech does for its encoder and decoder."""
    weight_norm(module.conv)
    return module


class WeightNormedPointwiseConv(nn.Conv1d):
    """1x1 Conv1d with weight norm: the in/out projections of a vector quantiser."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__(in_channels, out_channels, kernel_size=1)
        weight_norm(self)


class ResidualUnit(CausalModule):
    """x + conv1x1(snake(conv_k,dilated(snake(x)))), all causal. `[batch, channels, time]`."""

    def __init__(self, channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.block = CausalSequential(
            Snake1d(channels),
            weighted_conv(channels, channels, kernel_size, dilation=dilation),
            Snake1d(channels),
            weighted_conv(channels, channels, 1),
        )

    def forward(self, hidden: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        return hidden + self.block(hidden, cache)


def weighted_conv(in_channels, out_channels, kernel_size, stride=1, dilation=1) -> CausalConv1d:
    return weight_normed(CausalConv1d(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation))


def residual_units(channels: int, config: Drama3CodecConfig) -> list[ResidualUnit]:
    return [ResidualUnit(channels, config.residual_unit_kernel_size, d) for d in config.residual_unit_dilations]


# ---------------------------------------------------------------------------------------------
# Window-limited causal transformer


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, table_dtype: torch.dtype):
    """cos, sin of RoPE angles for absolute `positions` [time] -> two `[time, head_dim / 2]`.

    Rounded to `table_dtype` the way fish-speech rounds its precomputed table, then returned in
    float32.
    """
    cos, sin = rope_cos_sin(positions, head_dim, theta)
    return cos.to(table_dtype).float(), sin.to(table_dtype).float()


def window_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean `[queries, keys]`: a query sees a key 0 to `window - 1` positions back."""
    distance = query_positions[:, None] - key_positions[None, :]
    return (distance >= 0) & (distance < window)


class Attention(nn.Module):
    """Multi-head attention with interleaved RoPE over a sliding window of past keys/values."""

    def __init__(self, dim: int, heads: int, head_dim: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.dropout = dropout
        self.wqkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, hidden, cos, sin, past_keys, past_values, mask):
        """hidden `[batch, time, dim]`, past keys/values `[batch, heads, past, head_dim]`,
        mask `[time, past + time]` -> output `[batch, time, dim]`, keys, values
        `[batch, heads, past + time, head_dim]`."""
        batch, time, _ = hidden.shape
        query, key, value = self.wqkv(hidden).view(batch, time, 3, self.heads, self.head_dim).unbind(2)
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # against [batch, time, heads, head_dim]
        query = apply_interleaved_rope(query, cos, sin).transpose(1, 2)
        key = apply_interleaved_rope(key, cos, sin).transpose(1, 2)
        keys = torch.cat([past_keys, key], dim=2)
        values = torch.cat([past_values, value.transpose(1, 2)], dim=2)
        attended = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
        return self.wo(attended.transpose(1, 2).reshape(batch, time, -1)), keys, values


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, intermediate_size: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(dim, intermediate_size, bias=False)
        self.w3 = nn.Linear(dim, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.w2(self.dropout(F.silu(self.w1(hidden)) * self.w3(hidden)))


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in float32 at least (float64 stays float64)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        wide = hidden.to(torch.promote_types(hidden.dtype, torch.float32))
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(hidden.dtype) * self.weight


class LayerScale(nn.Module):
    """Learned per-channel scale `gamma` of a residual branch."""

    def __init__(self, dim: int, init_value: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init_value))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * self.gamma


class TransformerBlock(nn.Module):
    """Pre-norm block: x + ls(attention(norm x)), then + ls(ffn(norm x))."""

    def __init__(self, dim, heads, head_dim, intermediate_size, config: Drama3CodecConfig):
        super().__init__()
        self.attention = Attention(dim, heads, head_dim, config.transformer_dropout)
        self.feed_forward = FeedForward(dim, intermediate_size, config.transformer_dropout)
        self.ffn_norm = RMSNorm(dim, eps=config.norm_eps)
        self.attention_norm = RMSNorm(dim, eps=config.norm_eps)
        self.attention_layer_scale = LayerScale(dim, config.layer_scale_init)
        self.ffn_layer_scale = LayerScale(dim, config.layer_scale_init)

    def forward(self, hidden, cos, sin, past_keys, past_values, mask):
        attended, keys, values = self.attention(self.attention_norm(hidden), cos, sin, past_keys, past_values, mask)
        hidden = hidden + self.attention_layer_scale(attended)
        hidden = hidden + self.ffn_layer_scale(self.feed_forward(self.ffn_norm(hidden)))
        return hidden, keys, values


class TransformerStreamState(NamedTuple):
    """What a window-limited transformer keeps: the next absolute position, and per layer the
    keys and values of the last `window - 1` positions `[batch, heads, <= window - 1, head_dim]`."""

    position: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class WindowLimitedTransformer(CausalModule):
    """Causal transformer in which each position attends to itself and the `window - 1` before it.

    Channels-first like the convolutions around it: `[batch, input_dim, time]` in and out.
    Offline input is processed in blocks of `window` positions, so memory grows linearly with
    the length instead of quadratically; the result is the same as one full masked attention.
    """

    def __init__(self, input_dim, dim, layers, heads, intermediate_size, window, config: Drama3CodecConfig):
        super().__init__()
        self.window = window
        self.heads = heads
        self.head_dim = config.transformer_head_dim
        self.rope_theta = config.rope_theta
        self.rope_table_dtype = getattr(torch, config.rope_table_dtype)
        self.layers = nn.ModuleList(
            TransformerBlock(dim, heads, self.head_dim, intermediate_size, config) for _ in range(layers)
        )
        self.norm = RMSNorm(dim, eps=config.norm_eps)
        self.input_proj = nn.Linear(input_dim, dim) if input_dim != dim else nn.Identity()
        self.output_proj = nn.Linear(dim, input_dim) if input_dim != dim else nn.Identity()

    def empty_state(self, reference: torch.Tensor) -> TransformerStreamState:
        empty = reference.new_zeros(reference.shape[0], self.heads, 0, self.head_dim)
        return TransformerStreamState(0, [empty] * len(self.layers), [empty] * len(self.layers))

    def forward(self, hidden: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        hidden = self.input_proj(hidden.transpose(1, 2))  # [batch, time, dim]
        state = _read_cache(cache, self) or self.empty_state(hidden)
        outputs = []
        for block in hidden.split(self.window, dim=1):
            output, state = self._forward_block(block, state)
            outputs.append(output)
        _write_cache(cache, self, state)
        hidden = torch.cat(outputs, dim=1) if outputs else hidden
        return self.output_proj(self.norm(hidden)).transpose(1, 2)

    def _forward_block(self, hidden: torch.Tensor, state: TransformerStreamState):
        """One block `[batch, time <= window, dim]` after the positions held in `state`."""
        time = hidden.shape[1]
        past = state.keys[0].shape[2] if self.layers else 0
        positions = torch.arange(state.position - past, state.position + time, device=hidden.device)
        mask = window_mask(positions[past:], positions, self.window)
        cos, sin = rotary_cos_sin(positions[past:], self.head_dim, self.rope_theta, self.rope_table_dtype)
        keep = self.window - 1
        new_keys, new_values = [], []
        for layer, past_keys, past_values in zip(self.layers, state.keys, state.values):
            hidden, keys, values = layer(hidden, cos, sin, past_keys, past_values, mask)
            # Copies, so the state does not pin the whole block's keys/values in memory.
            new_keys.append(keys[:, :, keys.shape[2] - min(keep, keys.shape[2]) :].clone())
            new_values.append(values[:, :, values.shape[2] - min(keep, values.shape[2]) :].clone())
        return hidden, TransformerStreamState(state.position + time, new_keys, new_values)


# ---------------------------------------------------------------------------------------------
# Encoder and decoder


class EncoderBlock(CausalModule):
    """Three residual units, Snake, a strided causal conv doubling the channels, then an optional
    window-limited transformer. `[batch, channels / 2, time] -> [batch, channels, time / stride]`."""

    def __init__(self, channels: int, stride: int, transformer_layers: int, config: Drama3CodecConfig):
        super().__init__()
        transformer = nn.Identity()
        if transformer_layers:
            transformer = WindowLimitedTransformer(
                input_dim=channels,
                dim=channels,
                layers=transformer_layers,
                heads=channels // config.transformer_head_dim,
                intermediate_size=config.encoder_transformer_ffn_ratio * channels,
                window=config.encoder_transformer_window,
                config=config,
            )
        self.block = CausalSequential(
            *residual_units(channels // 2, config),
            Snake1d(channels // 2),
            weighted_conv(channels // 2, channels, 2 * stride, stride=stride),
            transformer,
        )

    def forward(self, hidden: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        return self.block(hidden, cache)


class Encoder(CausalModule):
    """Waveform `[batch, 1, time]` -> latent `[batch, latent_dim, time / prod(encoder_rates)]`."""

    def __init__(self, config: Drama3CodecConfig):
        super().__init__()
        layers = [weighted_conv(1, config.encoder_dim, config.encoder_input_kernel_size)]
        for index, (stride, transformer_layers) in enumerate(
            zip(config.encoder_rates, config.encoder_transformer_layers)
        ):
            layers.append(EncoderBlock(config.encoder_block_channels(index), stride, transformer_layers, config))
        channels = config.encoder_block_channels(len(config.encoder_rates) - 1)
        layers += [Snake1d(channels), weighted_conv(channels, config.latent_dim, config.encoder_output_kernel_size)]
        self.block = CausalSequential(*layers)

    def forward(self, audio: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        return self.block(audio, cache)


class DecoderBlock(CausalModule):
    """Snake, a causal transposed conv halving the channels, three residual units.
    `[batch, in_channels, time] -> [batch, in_channels / 2, time * stride]`."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, config: Drama3CodecConfig):
        super().__init__()
        self.block = CausalSequential(
            Snake1d(in_channels),
            weight_normed(CausalConvTranspose1d(in_channels, out_channels, 2 * stride, stride=stride)),
            *residual_units(out_channels, config),
        )

    def forward(self, hidden: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        return self.block(hidden, cache)


class Decoder(CausalModule):
    """Latent `[batch, latent_dim, frames]` -> waveform `[batch, 1, frames * prod(decoder_rates)]` in [-1, 1].

    fish-speech's config lists decoder transformer layers, but its decoder blocks never use
    them (they hold no weights in codec.pth), so there are none here.
    """

    def __init__(self, config: Drama3CodecConfig):
        super().__init__()
        layers = [weighted_conv(config.latent_dim, config.decoder_dim, config.decoder_input_kernel_size)]
        for index, stride in enumerate(config.decoder_rates):
            in_channels = config.decoder_dim // 2**index
            layers.append(DecoderBlock(in_channels, in_channels // 2, stride, config))
        channels = config.decoder_dim // 2 ** len(config.decoder_rates)
        layers += [Snake1d(channels), weighted_conv(channels, 1, config.decoder_output_kernel_size), nn.Tanh()]
        self.model = CausalSequential(*layers)

    def forward(self, latent: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        return self.model(latent, cache)


# ---------------------------------------------------------------------------------------------
# Quantiser


class ConvNeXtBlock(CausalModule):
    """x + gamma * pw2(gelu(pw1(layernorm(causal_depthwise_conv(x))))). `[batch, dim, time]`."""

    def __init__(self, dim: int, config: Drama3CodecConfig):
        super().__init__()
        hidden_dim = int(config.convnext_mlp_ratio * dim)
        self.dwconv = CausalConv1d(dim, dim, config.convnext_kernel_size, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(hidden_dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), config.convnext_layer_scale_init))

    def forward(self, hidden: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        branch = self.norm(self.dwconv(hidden, cache).transpose(1, 2))
        branch = self.gamma * self.pwconv2(self.act(self.pwconv1(branch)))
        return hidden + branch.transpose(1, 2)


class VectorQuantizer(nn.Module):
    """One codebook: project to `codebook_dim`, pick the code of highest cosine similarity,
    project the code vector back."""

    def __init__(self, input_dim: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.codebook_size = codebook_size
        self.in_proj = WeightNormedPointwiseConv(input_dim, codebook_dim)
        self.out_proj = WeightNormedPointwiseConv(codebook_dim, input_dim)
        self.codebook = nn.Embedding(codebook_size, codebook_dim)

    def nearest_codes(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[batch, input_dim, frames]` -> codes `[batch, frames]` (long)."""
        projected = F.normalize(self.in_proj(hidden).transpose(1, 2), dim=-1)  # [batch, frames, codebook_dim]
        codebook = F.normalize(self.codebook.weight, dim=-1)  # [codebook_size, codebook_dim]
        # Squared distance between unit vectors, the published search (ties break the same way).
        distance = (
            projected.pow(2).sum(-1, keepdim=True) - 2 * projected @ codebook.t() + codebook.pow(2).sum(-1)
        )
        return distance.argmin(dim=-1)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes `[batch, frames]` -> `[batch, input_dim, frames]`."""
        return self.out_proj(self.codebook(codes).transpose(1, 2))


class ResidualVectorQuantizer(nn.Module):
    """Codebooks applied in turn, each to what the previous ones left unexplained."""

    def __init__(self, input_dim: int, num_codebooks: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.codebook_size = codebook_size
        self.quantizers = nn.ModuleList(
            VectorQuantizer(input_dim, codebook_size, codebook_dim) for _ in range(num_codebooks)
        )

    def encode(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[batch, input_dim, frames]` -> codes `[batch, num_codebooks, frames]`, quantised sum
        `[batch, input_dim, frames]`."""
        residual, quantized, codes = hidden, torch.zeros_like(hidden), []
        for quantizer in self.quantizers:
            code = quantizer.nearest_codes(residual)
            vector = quantizer.decode(code)
            quantized, residual = quantized + vector, residual - vector
            codes.append(code)
        return torch.stack(codes, dim=1), quantized

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes `[batch, num_codebooks, frames]` -> `[batch, input_dim, frames]`."""
        return sum(quantizer.decode(codes[:, index]) for index, quantizer in enumerate(self.quantizers))


class DownsampleResidualVectorQuantizer(CausalModule):
    """Encoder latent -> codes and codes -> decoder latent.

    encode: latent `[batch, latent_dim, time]` -> downsample by prod(factors) -> pre transformer
    -> semantic codebook, then residual codebooks on what it leaves -> codes `[batch, 1 + n, frames]`.
    decode: codes -> clamp to each codebook -> sum of code vectors -> post transformer ->
    upsample -> latent `[batch, latent_dim, frames * prod(factors)]`.
    """

    def __init__(self, config: Drama3CodecConfig):
        super().__init__()
        dim = config.latent_dim
        self.semantic_quantizer = ResidualVectorQuantizer(dim, 1, config.semantic_codebook_size, config.codebook_dim)
        self.quantizer = ResidualVectorQuantizer(
            dim, config.num_residual_codebooks, config.residual_codebook_size, config.codebook_dim
        )
        factors = config.quantizer_downsample_factors
        self.downsample = CausalSequential(
            *(CausalSequential(CausalConv1d(dim, dim, f, stride=f), ConvNeXtBlock(dim, config)) for f in factors)
        )
        self.upsample = CausalSequential(
            *(
                CausalSequential(CausalConvTranspose1d(dim, dim, f, stride=f), ConvNeXtBlock(dim, config))
                for f in reversed(factors)
            )
        )
        self.pre_module = self._transformer(config)
        self.post_module = self._transformer(config)

    @staticmethod
    def _transformer(config: Drama3CodecConfig) -> WindowLimitedTransformer:
        return WindowLimitedTransformer(
            input_dim=config.latent_dim,
            dim=config.quantizer_transformer_dim,
            layers=config.quantizer_transformer_layers,
            heads=config.quantizer_transformer_heads,
            intermediate_size=config.quantizer_transformer_intermediate_size,
            window=config.quantizer_transformer_window,
            config=config,
        )

    def encode(self, latent: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        hidden = self.pre_module(self.downsample(latent, cache), cache)
        semantic_codes, semantic = self.semantic_quantizer.encode(hidden)
        residual_codes, _ = self.quantizer.encode(hidden - semantic)
        return torch.cat([semantic_codes, residual_codes], dim=1)

    def decode(self, codes: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        semantic_codes = codes[:, :1].clamp(max=self.semantic_quantizer.codebook_size - 1)
        residual_codes = codes[:, 1:].clamp(max=self.quantizer.codebook_size - 1)
        hidden = self.semantic_quantizer.decode(semantic_codes) + self.quantizer.decode(residual_codes)
        return self.upsample(self.post_module(hidden, cache), cache)


# ---------------------------------------------------------------------------------------------
# The model


@dataclass
class Drama3CodecEncoderOutput(ModelOutput):
    r"""What `encode` returns (named like transformers' `DacEncoderOutput`).

    audio_codes (`torch.LongTensor` of shape `(batch, num_codebooks, frames)`):
        The codes of each item, right-padded with 0.
    lengths (`torch.LongTensor` of shape `(batch,)`):
        Frames of each item.
    """

    audio_codes: torch.LongTensor | None = None
    lengths: torch.LongTensor | None = None


@dataclass
class Drama3CodecDecoderOutput(ModelOutput):
    r"""What `decode` and `forward` return (named like transformers' `DacDecoderOutput`).

    audio_values (`torch.FloatTensor` of shape `(batch, samples)`):
        Waveforms in [-1, 1] at the codec's rate, right-padded with 0.
    lengths (`torch.LongTensor` of shape `(batch,)`):
        Samples of each item (its frames x hop_length).
    """

    audio_values: torch.FloatTensor | None = None
    lengths: torch.LongTensor | None = None


class FrameCodec:
    """What every codec of this package shares: its sizes, read from the config, and `encode`
    (the waveform checks and padding, then the model's own `encode_frames(batch [batch,
    frames * hop_length]) -> codes [batch, num_codebooks, frames]`). Mixed into a
    `PreTrainedAudioTokenizerBase`."""

    @property
    def sampling_rate(self) -> int:
        """Audio samples per second the codec works at (44100 published; 22050 for the log-mel codec)."""
        return self.config.sampling_rate

    @property
    def hop_length(self) -> int:
        """Audio samples per frame (2048 published; 1024 for the log-mel codec)."""
        return self.config.hop_length

    @property
    def frame_rate(self) -> float:
        """Frames per second (44100 / 2048 published)."""
        return self.config.frame_rate

    @property
    def num_codebooks(self) -> int:
        """Codes per frame (10 published: codebook 0 semantic, 1.. acoustic)."""
        return self.config.num_codebooks

    # -- audio -> codes ------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, audio, sampling_rate: int, lengths=None, max_seconds: float | None = None) -> Drama3CodecEncoderOutput:
        """Audio -> codes (both codecs: check, resample and pad the waveforms, then `encode_frames`).

        Args:
            audio: numpy array or torch tensor, `[samples]`, `[batch, samples]` or
                `[batch, channels, samples]`, or a list of `[samples]` / `[channels, samples]`
                arrays of different lengths. Floats in [-1, 1]; int8/int16/int32/uint8 PCM is
                scaled to that range. Channels are averaged.
            sampling_rate: rate of `audio` in Hz; anything but `self.sampling_rate` is resampled (soxr).
            lengths: valid samples of each item of a right-padded `[batch, ...]` input (default: all).
            max_seconds: longest accepted item (default `config.max_audio_seconds`).

        Returns:
            `Drama3CodecEncoderOutput(audio_codes [batch, num_codebooks, frames] long, lengths [batch]
            frames)`;
            an item of `n` samples has `ceil(n / hop_length)` frames, its last frame right-padded
            with silence. Items are padded on the right, which (the codec being causal) does not
            change their codes.

        All-silent audio is encoded like any other (its codes are valid); use
        `audio.check_audio(..., reject_silence=True)` where silence is an error (references).
        """
        max_seconds = self.config.max_audio_seconds if max_seconds is None else max_seconds
        batch, sample_lengths = prepare_audio_batch(
            audio, sampling_rate, self.sampling_rate, lengths=lengths, max_seconds=max_seconds, name="audio"
        )
        frame_lengths = (sample_lengths + self.hop_length - 1) // self.hop_length
        frames = int(frame_lengths.max())
        batch = F.pad(batch, (0, frames * self.hop_length - batch.shape[-1]))
        codes = self.encode_frames(batch.to(device=self.device, dtype=self.dtype))
        return Drama3CodecEncoderOutput(audio_codes=codes, lengths=frame_lengths.to(codes.device))


class Drama3CodecModel(FrameCodec, PreTrainedAudioTokenizerBase):
    """The S2 codec: `encode` audio to codes `[batch, 10, frames]`, `decode` codes to audio,
    `streaming_encoder()` / `streaming_decoder()` for piece-by-piece use.

    `from_pretrained` takes a Hugging Face folder (config.json + safetensors), or fish-speech's
    `codec.pth` (a file, or a folder holding one), loaded with `weights_only=True`.
    """

    config_class = Drama3CodecConfig
    config: Drama3CodecConfig
    base_model_prefix = "codec"
    main_input_name = "input_values"
    _no_split_modules = ["EncoderBlock", "DecoderBlock", "TransformerBlock"]

    def __init__(self, config: Drama3CodecConfig):
        super().__init__(config)
        self.encoder = Encoder(config)
        self.quantizer = DownsampleResidualVectorQuantizer(config)
        self.decoder = Decoder(config)
        self.post_init()

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Conv1d, nn.ConvTranspose1d, nn.Linear)):
            if parametrize.is_parametrized(module, "weight"):
                direction = module.parametrizations.weight.original1
                init.trunc_normal_(direction, std=std)
                init.copy_(module.parametrizations.weight.original0, _norm_except_dim0(direction))
            else:
                init.trunc_normal_(module.weight, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight)
        elif isinstance(module, Snake1d):
            init.ones_(module.alpha)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)
        elif isinstance(module, LayerScale):
            init.constant_(module.gamma, self.config.layer_scale_init)
        elif isinstance(module, ConvNeXtBlock):
            init.constant_(module.gamma, self.config.convnext_layer_scale_init)

    # -- whole frames, the core both offline and streaming calls share ---------------------

    def encode_frames(self, audio: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        """audio `[batch, frames * hop_length]` at the codec's rate -> codes `[batch, num_codebooks, frames]`.

        With a `cache`, continues the stream it holds (see the module docstring).
        """
        if audio.shape[-1] < self.hop_length:
            return torch.zeros(audio.shape[0], self.num_codebooks, 0, dtype=torch.long, device=audio.device)
        latent = self.encoder(audio[:, None, :], cache)
        return self.quantizer.encode(latent, cache)

    def decode_frames(self, codes: torch.Tensor, cache: StreamCache | None = None) -> torch.Tensor:
        """codes `[batch, num_codebooks, frames]` (non-negative long) -> audio `[batch, frames * hop_length]`.

        Codes above a codebook's size are clamped to its last code, as the published decoder does.
        """
        if codes.shape[-1] == 0:
            return torch.zeros(codes.shape[0], 0, device=codes.device, dtype=self.dtype)
        return self.decoder(self.quantizer.decode(codes, cache), cache)[:, 0, :]

    # -- public API ------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, codes, lengths=None) -> Drama3CodecDecoderOutput:
        """Codes -> audio.

        Args:
            codes: integer `[batch, num_codebooks, frames]` or `[num_codebooks, frames]` (numpy or
                torch). Codes above a codebook's size are clamped to its last code (the published
                decoder does this; the LM's acoustic heads emit up to 4096 values); negative codes
                are a ValueError.
            lengths: frames of each item of a right-padded batch (default: all frames).

        Returns:
            `Drama3CodecDecoderOutput(audio_values [batch, frames * hop_length], lengths [batch]
            samples)`; samples
            past an item's length are zero.
        """
        codes, lengths = check_codes(codes, self.num_codebooks, lengths, name="codes")
        codes = codes.to(self.device)
        audio = self.decode_frames(codes)
        sample_lengths = lengths.to(audio.device) * self.hop_length
        positions = torch.arange(audio.shape[-1], device=audio.device)
        audio = audio.masked_fill(positions[None, :] >= sample_lengths[:, None], 0.0)
        return Drama3CodecDecoderOutput(audio_values=audio, lengths=sample_lengths)

    def forward(self, input_values: torch.Tensor, lengths: torch.Tensor | None = None) -> Drama3CodecDecoderOutput:
        """Reconstruct `input_values` `[batch, samples]` (at the codec's rate): encode, then decode."""
        encoded = self.encode(input_values, sampling_rate=self.sampling_rate, lengths=lengths)
        return self.decode(encoded.audio_codes, encoded.lengths)

    def streaming_encoder(self, batch_size: int = 1):
        """A `StreamingEncoder`: `.push(audio_chunk)` -> codes of the frames completed so far, `.flush()`."""
        return StreamingEncoder(self, batch_size=batch_size)

    def streaming_decoder(self, batch_size: int = 1):
        """A `StreamingDecoder`: `.push(codes_chunk)` -> audio of those frames, `.flush()`."""
        return StreamingDecoder(self, batch_size=batch_size)

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a Hugging Face folder/repo, or fish-speech's `codec.pth` (file or folder holding one).

        For `codec.pth`, `config` (a `Drama3CodecConfig`) gives the sizes (default: the published
        codec), `dtype` the parameter dtype, and `output_loading_info=True` also returns
        `{"missing_keys": [], "unexpected_keys": []}` (any mismatch is a ValueError).
        """
        checkpoint = _fish_speech_checkpoint(pretrained_model_name_or_path)
        if checkpoint is None and _looks_like_local_path(pretrained_model_name_or_path):
            raise FileNotFoundError(
                f"{os.fspath(pretrained_model_name_or_path)}: no such codec file or folder; expected fish-speech's "
                f"codec.pth, a folder holding it, or a saved codec folder (config.json + model.safetensors)"
            )
        if checkpoint is None:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        return load_fish_speech_codec(
            cls,
            checkpoint,
            config=kwargs.get("config"),
            dtype=kwargs.get("dtype", kwargs.get("torch_dtype")),
            output_loading_info=kwargs.get("output_loading_info", False),
        )


def _norm_except_dim0(weight: torch.Tensor) -> torch.Tensor:
    """||weight|| over every dim but 0, shaped `[dim0, 1, ..., 1]` (weight norm's g)."""
    return weight.flatten(1).norm(dim=1).view(-1, *([1] * (weight.dim() - 1)))


def _looks_like_local_path(path) -> bool:
    """A path that does not exist and cannot be a Hub repo id ("name" or "namespace/name"): it
    names a missing file, which the Hub lookup would report as a repo-id rule instead."""
    path = os.fspath(path)
    if os.path.exists(path):
        return False
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or path.endswith((".pth", ".pt"))


def _fish_speech_checkpoint(path) -> str | None:
    """The codec.pth `path` names (a .pth/.pt file, or a folder with codec.pth and no
    config.json), or None for anything else (a Hugging Face folder or repo id)."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith((".pth", ".pt")):
        return path
    candidate = os.path.join(path, "codec.pth")
    if os.path.isdir(path) and os.path.isfile(candidate) and not os.path.isfile(os.path.join(path, "config.json")):
        return candidate
    return None


__all__ = ["Drama3CodecModel", "Drama3CodecEncoderOutput", "Drama3CodecDecoderOutput", "StreamCache"]
