"""Shared helpers for codec tests, and the tiny codec other tests build on.

`tiny_codec_config()` is the documented way for other test suites (processor, generation,
training) to get a small random codec: `Drama3CodecModel(tiny_codec_config())`.
"""

import torch

from transformers_drama3.codec import Drama3CodecConfig, Drama3CodecModel


def tiny_codec_config(**overrides) -> Drama3CodecConfig:
    """A codec with the published structure at toy sizes: 44.1 kHz, 32 samples per frame
    (encoder 2 x 4, quantizer 2 x 2), 1 semantic codebook of 64 + 3 residual codebooks of 16,
    one encoder transformer layer (window 8) and one pre/post layer (window 4)."""
    sizes = dict(
        sampling_rate=44100,
        encoder_dim=8,
        encoder_rates=[2, 4],
        encoder_transformer_layers=[0, 1],
        encoder_transformer_window=8,
        transformer_head_dim=16,
        quantizer_downsample_factors=[2, 2],
        quantizer_transformer_layers=1,
        quantizer_transformer_dim=32,
        quantizer_transformer_heads=2,
        quantizer_transformer_intermediate_size=64,
        quantizer_transformer_window=4,
        semantic_codebook_size=64,
        num_residual_codebooks=3,
        residual_codebook_size=16,
        codebook_dim=4,
        decoder_dim=32,
        decoder_rates=[4, 2],
        initializer_range=0.2,
    )
    sizes.update(overrides)
    return Drama3CodecConfig(**sizes)


def tiny_codec(seed: int = 0, **overrides) -> Drama3CodecModel:
    """A randomly initialised tiny codec in eval mode (deterministic for a given seed)."""
    torch.manual_seed(seed)
    return Drama3CodecModel(tiny_codec_config(**overrides)).eval()
