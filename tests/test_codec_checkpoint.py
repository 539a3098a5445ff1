"""The codec's sizes and its checkpoints: fish-speech codec.pth in, safetensors out."""

import math
import pickle

import pytest
import torch
from codec_helpers import (  # noqa: F401 (one_thread is a fixture)
    fish_speech_codec_keys,
    one_thread,
    random_fish_speech_state_dict,
    tiny_codec,
    tiny_codec_config,
)

from transformers_drama3.codec import Drama3CodecConfig, Drama3CodecModel
from transformers_drama3.codec.convert import convert_codec_checkpoint, main, to_fish_speech_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")


def published_parameter_count(config: Drama3CodecConfig) -> int:
    """Parameters of fish-speech's DAC for `config`, counted by hand from modded_dac.py / rvq.py
    (weight norm stores g and v; g has one value per output channel of a conv, per input
    channel of a transposed conv)."""
    k = config.residual_unit_kernel_size

    def conv(cin, cout, kernel):
        return cout * cin * kernel + 2 * cout

    def residual_unit(c):
        return 2 * c + conv(c, c, k) + conv(c, c, 1)

    def transformer(dim, inter, layers):
        return layers * (4 * dim * dim + 3 * dim * inter + 4 * dim) + dim

    def convnext(dim):
        hidden = int(config.convnext_mlp_ratio * dim)
        return dim * config.convnext_kernel_size + dim + 2 * dim + 2 * dim * hidden + hidden + dim + dim

    def vq(dim, size):
        # in_proj (v, g, bias) + out_proj (v, g, bias) + codebook
        return 2 * dim * config.codebook_dim + 2 * config.codebook_dim + 2 * dim + size * config.codebook_dim

    total = conv(1, config.encoder_dim, config.encoder_input_kernel_size)
    for block, (stride, layers) in enumerate(zip(config.encoder_rates, config.encoder_transformer_layers)):
        d = config.encoder_dim * 2 ** (block + 1)
        total += 3 * residual_unit(d // 2) + d // 2 + conv(d // 2, d, 2 * stride)
        total += transformer(d, config.encoder_transformer_ffn_ratio * d, layers) if layers else 0
    total += d + conv(d, config.latent_dim, config.encoder_output_kernel_size)
    total += conv(config.latent_dim, config.decoder_dim, config.decoder_input_kernel_size)
    for block, stride in enumerate(config.decoder_rates):
        cin = config.decoder_dim // 2**block
        total += cin + (cin * (cin // 2) * 2 * stride + cin + cin // 2) + 3 * residual_unit(cin // 2)
    total += cin // 2 + conv(cin // 2, 1, config.decoder_output_kernel_size)
    latent = config.latent_dim
    total += vq(latent, config.semantic_codebook_size) + config.num_residual_codebooks * vq(latent, config.residual_codebook_size)
    for factor in config.quantizer_downsample_factors:
        total += 2 * (latent * latent * factor + latent + convnext(latent))
    total += 2 * transformer(
        config.quantizer_transformer_dim, config.quantizer_transformer_intermediate_size, config.quantizer_transformer_layers
    )
    return total


PUBLISHED_PARAMETERS = 391_430_530


def test_full_size_codec_has_the_published_sizes():
    config = Drama3CodecConfig()
    with torch.device("meta"):
        codec = Drama3CodecModel(config)
    state = to_fish_speech_state_dict(codec)
    assert len(state) == 535  # the published codec.pth holds 535 tensors
    assert published_parameter_count(config) == PUBLISHED_PARAMETERS
    assert sum(p.numel() for p in codec.parameters()) == PUBLISHED_PARAMETERS
    assert sum(t.numel() for t in state.values()) == PUBLISHED_PARAMETERS
    assert codec.hop_length == 2048
    assert codec.frame_rate == 44100 / 2048
    assert codec.sampling_rate == 44100
    assert codec.num_codebooks == 10


@pytest.mark.parametrize("config", [Drama3CodecConfig(), tiny_codec_config()], ids=["published", "tiny"])
def test_parameter_names_are_fish_speech_names(config):
    with torch.device("meta"):
        codec = Drama3CodecModel(config)
    assert sorted(to_fish_speech_state_dict(codec)) == sorted(fish_speech_codec_keys(config))


def test_hop_length_and_codebooks_come_from_the_config():
    config = tiny_codec_config(
        sampling_rate=22050, encoder_rates=[2, 8], decoder_rates=[8, 2], num_residual_codebooks=2
    )
    codec = Drama3CodecModel(config).eval()
    assert codec.hop_length == 64
    assert codec.frame_rate == 22050 / 64
    encoded = codec.encode(torch.zeros(1, 200), sampling_rate=22050)
    assert encoded.audio_codes.shape == (1, 3, math.ceil(200 / 64))
    assert codec.decode(encoded.audio_codes).audio_values.shape == (1, 4 * 64)


def test_config_rejects_a_decoder_that_does_not_undo_the_encoder():
    with pytest.raises(Exception, match="hop_length"):
        tiny_codec_config(decoder_rates=[4, 4])


def _write(state, path, wrapped: bool):
    if wrapped:
        state = {"state_dict": {**{f"generator.{k}": v for k, v in state.items()}, "discriminator.w": torch.ones(2)}}
    torch.save(state, path)


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "generator-prefixed"])
def test_fish_speech_codec_pth_loads_with_no_missing_or_unexpected_keys(tmp_path, wrapped):
    config = tiny_codec_config()
    state = random_fish_speech_state_dict(config)
    _write(state, tmp_path / "codec.pth", wrapped)

    codec, info = Drama3CodecModel.from_pretrained(tmp_path / "codec.pth", config=config, output_loading_info=True)

    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    loaded = to_fish_speech_state_dict(codec)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_folder_holding_codec_pth_loads_like_the_file(tmp_path):
    config = tiny_codec_config()
    torch.save(random_fish_speech_state_dict(config), tmp_path / "codec.pth")
    from_folder = Drama3CodecModel.from_pretrained(tmp_path, config=config)
    from_file = Drama3CodecModel.from_pretrained(tmp_path / "codec.pth", config=config)
    assert all(torch.equal(a, b) for a, b in zip(from_folder.state_dict().values(), from_file.state_dict().values()))


def test_codec_pth_for_other_sizes_is_a_clear_error(tmp_path):
    state = random_fish_speech_state_dict(tiny_codec_config())
    del state["decoder.model.0.conv.bias"]
    torch.save(state, tmp_path / "codec.pth")
    with pytest.raises(ValueError, match="1 missing keys.*decoder.model.0.conv.bias"):
        Drama3CodecModel.from_pretrained(tmp_path / "codec.pth", config=tiny_codec_config())


class _NotATensor:
    pass


def test_codec_pth_is_read_without_executing_pickled_code(tmp_path):
    torch.save({"encoder.block.0.conv.bias": _NotATensor()}, tmp_path / "codec.pth")
    with pytest.raises(pickle.UnpicklingError):
        Drama3CodecModel.from_pretrained(tmp_path / "codec.pth", config=tiny_codec_config())


def test_safetensors_round_trip_keeps_weights_and_outputs(tmp_path):
    codec = tiny_codec()
    codec.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    reloaded = Drama3CodecModel.from_pretrained(tmp_path).eval()

    assert reloaded.config.to_diff_dict() | {"_name_or_path": ""} == codec.config.to_diff_dict() | {"_name_or_path": ""}
    assert all(torch.equal(a, b) for a, b in zip(codec.state_dict().values(), reloaded.state_dict().values()))
    audio = torch.randn(2, 300, generator=torch.Generator().manual_seed(0)) * 0.3
    codes = codec.encode(audio, sampling_rate=44100).audio_codes
    assert torch.equal(reloaded.encode(audio, sampling_rate=44100).audio_codes, codes)
    assert torch.equal(reloaded.decode(codes).audio_values, codec.decode(codes).audio_values)


def test_convert_turns_codec_pth_into_a_folder_that_loads_the_same_weights(tmp_path):
    config = tiny_codec_config()
    torch.save(random_fish_speech_state_dict(config), tmp_path / "codec.pth")
    from_pth = Drama3CodecModel.from_pretrained(tmp_path / "codec.pth", config=config)

    convert_codec_checkpoint(tmp_path / "codec.pth", tmp_path / "a", config=config)
    assert (tmp_path / "a" / "model.safetensors").is_file()
    converted = Drama3CodecModel.from_pretrained(tmp_path / "a")
    assert all(torch.equal(a, b) for a, b in zip(from_pth.state_dict().values(), converted.state_dict().values()))


def test_convert_command_line_writes_a_loadable_folder(tmp_path):
    config = tiny_codec_config()
    config.save_pretrained(tmp_path / "sizes")
    torch.save(random_fish_speech_state_dict(config), tmp_path / "codec.pth")

    main([str(tmp_path / "codec.pth"), str(tmp_path / "out"), "--config", str(tmp_path / "sizes" / "config.json")])

    converted = Drama3CodecModel.from_pretrained(tmp_path / "out")
    assert converted.config.hop_length == config.hop_length
    assert sorted(to_fish_speech_state_dict(converted)) == sorted(fish_speech_codec_keys(config))


def test_convert_command_line_defaults_to_the_published_sizes(tmp_path):
    torch.save(random_fish_speech_state_dict(tiny_codec_config()), tmp_path / "codec.pth")
    with pytest.raises(ValueError, match="does not match the codec config"):
        main([str(tmp_path / "codec.pth"), str(tmp_path / "out")])


def test_auto_classes_load_a_saved_codec(tmp_path):
    from transformers import AutoConfig, AutoModel

    tiny_codec().save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), Drama3CodecConfig)
    assert isinstance(AutoModel.from_pretrained(tmp_path), Drama3CodecModel)
