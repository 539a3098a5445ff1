"""Shared helpers for codec tests, and the tiny codec other tests build on.

`tiny_codec_config()` is the documented way for other test suites (processor, generation,
training) to get a small random codec: `Drama3CodecModel(tiny_codec_config())`.
"""

import pytest
import torch

from transformers_drama3.codec import Drama3CodecConfig, Drama3CodecModel


SEMANTIC_CODEBOOK_SIZE = 64
RESIDUAL_CODEBOOK_SIZE = 16
NUM_CODEBOOKS = 4  # 1 semantic + 3 residual, as many as the tiny models' towers have


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
        semantic_codebook_size=SEMANTIC_CODEBOOK_SIZE,
        num_residual_codebooks=NUM_CODEBOOKS - 1,
        residual_codebook_size=RESIDUAL_CODEBOOK_SIZE,
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


def fish_speech_codec_keys(config: Drama3CodecConfig) -> list[str]:
    """The parameter names fish-speech's `DAC` (modded_dac.py + rvq.py) has for `config`,
    enumerated from its module structure independently of our modules."""
    wn = ["parametrizations.weight.original0", "parametrizations.weight.original1", "bias"]

    def conv(prefix):  # CausalWNConv1d / CausalWNConvTranspose1d: weight norm on `.conv`
        return [f"{prefix}.conv.{name}" for name in wn]

    def residual_unit(prefix):  # Snake, conv k7, Snake, conv k1
        return [f"{prefix}.block.0.alpha", *conv(f"{prefix}.block.1"), f"{prefix}.block.2.alpha", *conv(f"{prefix}.block.3")]

    def transformer(prefix, layers, projected):
        keys = []
        for layer in range(layers):
            p = f"{prefix}.layers.{layer}"
            keys += [f"{p}.attention.wqkv.weight", f"{p}.attention.wo.weight"]
            keys += [f"{p}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]
            keys += [f"{p}.ffn_norm.weight", f"{p}.attention_norm.weight"]
            keys += [f"{p}.attention_layer_scale.gamma", f"{p}.ffn_layer_scale.gamma"]
        keys.append(f"{prefix}.norm.weight")
        if projected:
            keys += [f"{prefix}.{proj}.{w}" for proj in ("input_proj", "output_proj") for w in ("weight", "bias")]
        return keys

    def convnext(prefix):
        return [
            f"{prefix}.dwconv.conv.weight", f"{prefix}.dwconv.conv.bias", f"{prefix}.norm.weight",
            f"{prefix}.norm.bias", f"{prefix}.pwconv1.weight", f"{prefix}.pwconv1.bias",
            f"{prefix}.pwconv2.weight", f"{prefix}.pwconv2.bias", f"{prefix}.gamma",
        ]  # fmt: skip

    def vector_quantizer(prefix):  # dac's VectorQuantize: old-style weight norm on 1x1 convs
        return [f"{prefix}.{proj}.{w}" for proj in ("in_proj", "out_proj") for w in ("weight_g", "weight_v", "bias")] + [
            f"{prefix}.codebook.weight"
        ]

    keys = conv("encoder.block.0")
    n_blocks = len(config.encoder_rates)
    for i, layers in enumerate(config.encoder_transformer_layers):
        p = f"encoder.block.{i + 1}.block"
        keys += [k for u in range(3) for k in residual_unit(f"{p}.{u}")] + [f"{p}.3.alpha", *conv(f"{p}.4")]
        if layers:
            keys += transformer(f"{p}.5", layers, projected=False)
    keys += [f"encoder.block.{n_blocks + 1}.alpha", *conv(f"encoder.block.{n_blocks + 2}")]

    keys += conv("decoder.model.0")
    for i in range(len(config.decoder_rates)):
        p = f"decoder.model.{i + 1}.block"
        keys += [f"{p}.0.alpha", *conv(f"{p}.1")] + [k for u in range(3) for k in residual_unit(f"{p}.{u + 2}")]
    n_blocks = len(config.decoder_rates)
    keys += [f"decoder.model.{n_blocks + 1}.alpha", *conv(f"decoder.model.{n_blocks + 2}")]

    keys += vector_quantizer("quantizer.semantic_quantizer.quantizers.0")
    keys += [k for i in range(config.num_residual_codebooks) for k in vector_quantizer(f"quantizer.quantizer.quantizers.{i}")]
    for stage in ("downsample", "upsample"):
        for i in range(len(config.quantizer_downsample_factors)):
            keys += [f"quantizer.{stage}.{i}.0.conv.weight", f"quantizer.{stage}.{i}.0.conv.bias"]
            keys += convnext(f"quantizer.{stage}.{i}.1")
    projected = config.quantizer_transformer_dim != config.latent_dim
    for module in ("pre_module", "post_module"):
        keys += transformer(f"quantizer.{module}", config.quantizer_transformer_layers, projected)
    return keys


def random_fish_speech_state_dict(config: Drama3CodecConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random codec.pth-style state dict (fish-speech names, float32) for `config`: shapes
    taken from our model, values random (positive where they are norms or Snake alphas)."""
    from transformers_drama3.codec.convert import to_fish_speech_state_dict

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in to_fish_speech_state_dict(Drama3CodecModel(config)).items()}
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in shapes.items():
        values = torch.randn(shape, generator=generator) * 0.1
        if key.endswith(("original0", "weight_g", ".alpha")):
            values = values.abs() + 0.5
        state[key] = values
    return state


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Run a test module on one CPU thread: the tiny codec is faster so on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
