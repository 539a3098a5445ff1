"""Configuration of the S2 audio codec that Drama 3 hears and speaks through."""

import math

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig


@strict
class Drama3CodecConfig(PreTrainedConfig):
    r"""
    Sizes of the causal S2 codec (a modified DAC: causal convolutions, window-limited
    transformers, a semantic + residual vector quantiser). The defaults are the published
    fish-speech codec (`fish_speech/configs/modded_dac_vq.yaml`): 44.1 kHz, 2048 samples per
    frame (21.53 frames/s), 1 semantic codebook of 4096 codes and 9 residual codebooks of 1024.

    Audio path, with the default sizes (`T` samples, `F = T / hop_length` frames):

        audio [B, 1, T]
          -> encoder: conv 1->encoder_dim, blocks at encoder_rates (channels doubling, the blocks
             with encoder_transformer_layers > 0 end in a window-limited transformer),
             conv -> latent_dim                                   latent [B, 1024, T / 512]
          -> quantizer: quantizer_downsample_factors (conv + ConvNeXt each), pre transformer,
             semantic + residual quantisers                       codes [B, 10, F]
        codes -> sum of codebook vectors -> post transformer -> upsample (transposed conv +
             ConvNeXt each)                                       latent [B, 1024, T / 512]
          -> decoder: conv latent_dim->decoder_dim, blocks at decoder_rates (channels halving),
             conv -> 1, tanh                                      audio [B, 1, T]

    Every convolution and attention is causal, so the codec streams exactly.

    Args:
        sampling_rate: audio sampling rate in Hz.
        encoder_dim: channels after the first encoder convolution; each encoder block doubles them.
        encoder_rates: stride of each encoder block.
        encoder_transformer_layers: transformer layers at the end of each encoder block (0: none).
            A block's transformer has `channels / transformer_head_dim` heads and a feed-forward
            width of `encoder_transformer_ffn_ratio * channels`.
        encoder_transformer_window: positions (including itself) an encoder position attends to.
        encoder_transformer_ffn_ratio: feed-forward width of the encoder transformers per channel.
        latent_dim: channels of the encoder output; defaults to `encoder_dim * 2**len(encoder_rates)`.
        encoder_input_kernel_size / encoder_output_kernel_size: kernels of the first and last
            encoder convolutions.
        residual_unit_kernel_size / residual_unit_dilations: the dilated convolutions of the three
            residual units in each encoder and decoder block.
        transformer_head_dim: head size of every codec transformer.
        rope_theta: RoPE base of every codec transformer.
        rope_table_dtype: dtype the RoPE cos/sin table is rounded to. fish-speech builds it in
            bfloat16 even in a float32 model; "bfloat16" reproduces the published codec, "float32"
            is the exact rotation (the latent moves by ~1e-4 relative, codes do not change).
        norm_eps: epsilon of the transformers' RMSNorms.
        layer_scale_init: initial LayerScale of the transformer blocks (training only).
        transformer_dropout: dropout in attention and feed-forward (training only).
        quantizer_downsample_factors: strides of the quantizer's downsampling stages (and, in
            reverse, of its upsampling stages).
        quantizer_transformer_layers / _dim / _heads / _intermediate_size / _window: the pre
            (encode) and post (decode) window-limited transformers around the quantiser.
        convnext_mlp_ratio / convnext_kernel_size / convnext_layer_scale_init: the ConvNeXt blocks
            of the quantizer's down/upsampling stages.
        semantic_codebook_size: codes in codebook 0 (the semantic codebook).
        num_residual_codebooks: acoustic codebooks after the semantic one.
        residual_codebook_size: codes in each acoustic codebook.
        codebook_dim: dimension of the space the nearest code is searched in.
        decoder_dim: channels after the first decoder convolution; each decoder block halves them.
        decoder_rates: upsampling stride of each decoder block.
        decoder_input_kernel_size / decoder_output_kernel_size: first and last decoder kernels.
        max_audio_seconds: longest audio `encode` accepts (a guard against absurd inputs).
        initializer_range: std of the random initialisation.
    """

    model_type = "drama3_codec"

    sampling_rate: int = 44100
    encoder_dim: int = 64
    encoder_rates: list[int] | tuple[int, ...] = (2, 4, 8, 8)
    encoder_transformer_layers: list[int] | tuple[int, ...] = (0, 0, 0, 4)
    encoder_transformer_window: int = 512
    encoder_transformer_ffn_ratio: int = 3
    latent_dim: int | None = None
    encoder_input_kernel_size: int = 7
    encoder_output_kernel_size: int = 3
    residual_unit_kernel_size: int = 7
    residual_unit_dilations: list[int] | tuple[int, ...] = (1, 3, 9)
    transformer_head_dim: int = 64
    rope_theta: float = 10000.0
    rope_table_dtype: str = "bfloat16"
    norm_eps: float = 1e-5
    layer_scale_init: float = 1e-2
    transformer_dropout: float = 0.0
    quantizer_downsample_factors: list[int] | tuple[int, ...] = (2, 2)
    quantizer_transformer_layers: int = 8
    quantizer_transformer_dim: int = 1024
    quantizer_transformer_heads: int = 16
    quantizer_transformer_intermediate_size: int = 3072
    quantizer_transformer_window: int = 128
    convnext_mlp_ratio: float = 4.0
    convnext_kernel_size: int = 7
    convnext_layer_scale_init: float = 1e-6
    semantic_codebook_size: int = 4096
    num_residual_codebooks: int = 9
    residual_codebook_size: int = 1024
    codebook_dim: int = 8
    decoder_dim: int = 1536
    decoder_rates: list[int] | tuple[int, ...] = (8, 8, 4, 2)
    decoder_input_kernel_size: int = 7
    decoder_output_kernel_size: int = 7
    max_audio_seconds: float = 600.0
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        self.encoder_rates = list(self.encoder_rates)
        self.encoder_transformer_layers = list(self.encoder_transformer_layers)
        self.residual_unit_dilations = list(self.residual_unit_dilations)
        self.quantizer_downsample_factors = list(self.quantizer_downsample_factors)
        self.decoder_rates = list(self.decoder_rates)
        if self.latent_dim is None:
            self.latent_dim = self.encoder_dim * 2 ** len(self.encoder_rates)
        super().__post_init__(**kwargs)

    def validate_codec_sizes(self):
        """Raise ValueError when the sizes cannot form a codec whose encoder and decoder meet."""
        if len(self.encoder_transformer_layers) != len(self.encoder_rates):
            raise ValueError(
                f"encoder_transformer_layers has {len(self.encoder_transformer_layers)} entries; "
                f"expected one per encoder block ({len(self.encoder_rates)})"
            )
        decoder_hop = math.prod(self.decoder_rates) * math.prod(self.quantizer_downsample_factors)
        if decoder_hop != self.hop_length:
            raise ValueError(
                f"decoder_rates {self.decoder_rates} x quantizer_downsample_factors "
                f"{self.quantizer_downsample_factors} upsample by {decoder_hop}; expected the "
                f"encoder's hop_length {self.hop_length}"
            )
        if self.decoder_dim % 2 ** len(self.decoder_rates):
            raise ValueError(
                f"decoder_dim {self.decoder_dim} must be divisible by 2**{len(self.decoder_rates)} "
                "(each decoder block halves the channels)"
            )
        for block, layers in enumerate(self.encoder_transformer_layers):
            channels = self.encoder_block_channels(block)
            if layers and channels % self.transformer_head_dim:
                raise ValueError(
                    f"encoder block {block} has {channels} channels, not a multiple of "
                    f"transformer_head_dim {self.transformer_head_dim}"
                )
        if self.rope_table_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"rope_table_dtype is {self.rope_table_dtype!r}; expected 'bfloat16' or 'float32'")

    def encoder_block_channels(self, block: int) -> int:
        """Output channels of encoder block `block` (0-based)."""
        return self.encoder_dim * 2 ** (block + 1)

    @property
    def hop_length(self) -> int:
        """Audio samples per frame (2048 for the published codec)."""
        return math.prod(self.encoder_rates) * math.prod(self.quantizer_downsample_factors)

    @property
    def frame_rate(self) -> float:
        """Frames per second (44100 / 2048 = 21.53 for the published codec)."""
        return self.sampling_rate / self.hop_length

    @property
    def num_codebooks(self) -> int:
        """Codes per frame: the semantic codebook plus the residual ones (10 published)."""
        return 1 + self.num_residual_codebooks


__all__ = ["Drama3CodecConfig"]
