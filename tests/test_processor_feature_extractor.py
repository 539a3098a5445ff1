"""Drama3FeatureExtractor: every audio form becomes the same checked mono waveform; the processor
holds it as a real ProcessorMixin attribute that saves and loads; codecs load by their model_type."""

import json

import numpy as np
import pytest
import soundfile
import soxr
import torch
from transformers import AutoConfig, AutoModel, PreTrainedConfig

from codec_helpers import tiny_codec
from processor_helpers import random_codes, tiny_processor, tiny_tokenizer
from transformers_drama3.feature_extraction_drama3 import Drama3FeatureExtractor, resample
from transformers_drama3.processing_drama3 import Drama3Processor
from transformers_drama3.prompting import Reference, Script


def voice(samples: int = 4410, seed: int = 0) -> np.ndarray:
    generator = np.random.default_rng(seed)
    t = np.arange(samples) / 44100
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * generator.standard_normal(t.shape)).astype(np.float32)


@pytest.fixture(scope="module")
def extractor():
    return Drama3FeatureExtractor()


# ---- the component ---------------------------------------------------------------------------------


def test_defaults_are_the_published_codec_rate_mono_and_zero_padding(extractor):
    assert (extractor.sampling_rate, extractor.feature_size, extractor.padding_value) == (44100, 1, 0.0)
    assert extractor.model_input_names == ["input_values", "padding_mask"]


def test_one_waveform_gives_input_values_and_a_padding_mask(extractor):
    wave = voice()
    out = extractor(wave)
    assert out["input_values"].shape == (1, 1, wave.shape[0]) and out["input_values"].dtype == torch.float32
    assert torch.equal(out["input_values"][0, 0], torch.from_numpy(wave))
    assert out["padding_mask"].tolist() == [[1] * wave.shape[0]]


def test_a_batch_is_right_padded_with_zeros_and_masked(extractor):
    short, long = voice(100, 1), voice(300, 2)
    out = extractor([short, long])
    assert out["input_values"].shape == (2, 1, 300)
    assert torch.equal(out["input_values"][0, 0, 100:], torch.zeros(200))
    assert out["padding_mask"].sum(dim=1).tolist() == [100, 300]


def test_arrays_tensors_dicts_paths_and_urls_give_the_same_samples(extractor, tmp_path):
    wave = voice(seed=3)
    path = tmp_path / "v.wav"
    soundfile.write(path, wave, 44100, subtype="FLOAT")
    forms = [
        wave,
        torch.from_numpy(wave),
        wave.tolist(),
        {"array": wave, "sampling_rate": 44100},
        {"path": str(path)},
        str(path),
        path,
        path.as_uri(),
    ]
    for form in forms:
        assert np.array_equal(extractor.load(form), wave), type(form)


def test_channels_are_averaged(extractor, tmp_path):
    left, right = voice(seed=4), voice(seed=5)
    expected = (left + right) / 2
    assert np.allclose(extractor.load(np.stack([left, right])), expected, atol=1e-7)
    path = tmp_path / "stereo.wav"
    soundfile.write(path, np.stack([left, right], axis=1), 44100, subtype="FLOAT")
    assert np.allclose(extractor.load(str(path)), expected, atol=1e-7)


def test_other_rates_are_resampled_with_soxr(extractor, tmp_path):
    wave = voice(2205, seed=6)
    expected = soxr.resample(wave, 22050, 44100).astype(np.float32)
    assert np.array_equal(extractor.load(wave, sampling_rate=22050), expected)
    assert np.array_equal(extractor.load({"array": wave, "sampling_rate": 22050}), expected)
    path = tmp_path / "low.wav"
    soundfile.write(path, wave, 22050, subtype="FLOAT")
    assert np.array_equal(extractor.load(str(path)), expected)


def test_base64_data_uris_and_bytes_give_the_same_samples(extractor, tmp_path):
    import base64

    wave = voice(seed=7)
    path = tmp_path / "v.wav"
    soundfile.write(path, wave, 44100, subtype="FLOAT")
    encoded = path.read_bytes()
    as_base64 = base64.b64encode(encoded).decode("ascii")
    for form in (encoded, as_base64, f"data:audio/wav;base64,{as_base64}", {"bytes": encoded, "path": "v.wav"}):
        assert np.array_equal(extractor.load(form), wave), type(form)


def test_http_urls_are_fetched(extractor, tmp_path):
    """A loopback server stands in for a remote file."""
    import functools
    import http.server
    import threading

    wave = voice(seed=11)
    soundfile.write(tmp_path / "v.wav", wave, 44100, subtype="FLOAT")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"  # a failing URL is retried by load_audio for ~15 s: not here
        assert np.array_equal(extractor.load(f"{url}/v.wav"), wave)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_file_and_an_array_at_another_rate_give_the_same_samples(extractor, tmp_path):
    """16 kHz -> 44.1 kHz is not a whole ratio: both paths keep transformers' load_audio length rule."""
    from transformers.audio_utils import load_audio

    wave = voice(1001, seed=8)
    path = tmp_path / "low.wav"
    soundfile.write(path, wave, 16000, subtype="FLOAT")
    from_array = extractor.load(wave, sampling_rate=16000)
    by_soxr = soxr.resample(wave, 16000, 44100)  # 2759 samples: soxr rounds 2759.006 down
    assert np.array_equal(from_array, np.append(by_soxr, 0.0).astype(np.float32))  # ceil: 2760
    assert np.array_equal(extractor.load(str(path)), from_array)
    assert np.array_equal(load_audio(str(path), sampling_rate=44100, backend="soundfile"), from_array)


def test_the_codec_resamples_like_the_feature_extractor(extractor):
    codec = tiny_codec()
    wave = voice(3001, seed=9)[:3001]
    direct = codec.encode(wave, sampling_rate=16000)
    through = codec.encode(extractor.load(wave, sampling_rate=16000), sampling_rate=44100)
    assert torch.equal(direct.audio_codes, through.audio_codes) and torch.equal(direct.lengths, through.lengths)


def test_resample_of_the_same_rate_changes_nothing():
    wave = voice(seed=10)
    assert np.array_equal(resample(wave, 44100, 44100), wave)


@pytest.mark.parametrize(
    "audio, kwargs, message",
    [
        (np.zeros(4410, dtype=np.float32), {}, "mine: the audio is silent"),
        (np.zeros(0, dtype=np.float32), {}, "mine: the audio is empty"),
        (np.array([0.5, np.inf], dtype=np.float32), {}, "mine: the audio holds NaN or infinite"),
        (np.full(44100 * 3, 0.1, dtype=np.float32), {"max_seconds": 2}, r"mine: the audio is 3\.0 s long; at most 2 s"),
        (np.full(10, 0.1, dtype=np.float32), {"sampling_rate": 0}, "mine: sampling_rate must be a positive"),
        (np.full(10, 0.1, dtype=np.float32), {"sampling_rate": 22050.5}, "mine: sampling_rate must be a positive whole"),
        (np.ones((10, 2), dtype=np.float32), {}, r"mine: a multi-channel waveform must be \[channels, samples\]"),
        (np.ones((2, 2, 2), dtype=np.float32), {}, r"mine: a waveform must be \[samples\] or \[channels, samples\]"),
        (np.ones(10, dtype=np.int64), {}, "mine: a waveform must hold floats"),
        (torch.ones(10, dtype=torch.long), {}, "mine: a waveform must hold floats"),
        ({"array": np.ones(10, dtype=np.float32)}, {}, "mine: an audio dict with an 'array' needs its 'sampling_rate'"),
        ({"array": np.ones(10, dtype=np.float32), "sampling_rate": 16000}, {"sampling_rate": 8000}, "mine: the audio dict says"),
        ({"bytes": b""}, {}, "mine: an audio dict needs 'array'"),
        (3.5, {}, "mine: audio must be a path"),
    ],
)
def test_bad_audio_is_refused_naming_the_input(extractor, audio, kwargs, message):
    with pytest.raises(ValueError, match=message):
        extractor.load(audio, name="mine", **kwargs)


def test_unreadable_files_are_refused_naming_the_input(extractor, tmp_path):
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"not audio")
    with pytest.raises(ValueError, match=r"audio\[1\]: cannot read audio .*garbage\.wav"):
        extractor([voice(), str(garbage)])
    with pytest.raises(ValueError, match=r"audio: cannot read audio .*missing\.wav.*: no such file"):
        extractor(str(tmp_path / "missing.wav"))


def test_save_and_load_keep_the_settings(tmp_path):
    extractor = Drama3FeatureExtractor(sampling_rate=22050, silence_peak=0.01)
    extractor.save_pretrained(tmp_path)
    loaded = Drama3FeatureExtractor.from_pretrained(tmp_path)
    assert (loaded.sampling_rate, loaded.silence_peak) == (22050, 0.01)


# ---- inside the processor ------------------------------------------------------------------------------


def test_the_processor_holds_the_feature_extractor_as_an_attribute():
    processor = tiny_processor()
    assert Drama3Processor.get_attributes() == ["tokenizer", "feature_extractor"]
    assert isinstance(processor.feature_extractor, Drama3FeatureExtractor)
    assert processor.sampling_rate == processor.feature_extractor.sampling_rate == 44100


def test_the_feature_extractor_takes_the_codec_rate():
    processor = Drama3Processor(tiny_tokenizer(), codec=tiny_codec(sampling_rate=22050))
    assert processor.feature_extractor.sampling_rate == processor.sampling_rate == 22050


def test_a_sampling_rate_that_contradicts_the_feature_extractor_is_refused():
    with pytest.raises(ValueError, match="disagrees with the feature extractor"):
        Drama3Processor(tiny_tokenizer(), Drama3FeatureExtractor(sampling_rate=22050), sampling_rate=44100)


def test_the_processor_reads_audio_through_its_feature_extractor(tmp_path):
    """A stricter silence threshold on the component changes what the processor accepts."""
    quiet = np.full(4410, 0.005, dtype=np.float32)
    strict = Drama3Processor(tiny_tokenizer(), Drama3FeatureExtractor(silence_peak=0.01), codec=tiny_codec())
    with pytest.raises(ValueError, match=r"references\[0\]\.audio: the audio is silent \(peak below 0\.01\)"):
        strict("x", reference_audio=quiet, reference_text="r")
    lenient = Drama3Processor(tiny_tokenizer(), codec=tiny_codec(), min_reference_fraction=0.0)  # 0.1 s placeholder
    assert lenient("x", reference_audio=quiet, reference_text="r")["input_ids"].shape[0] == 1


def test_save_writes_preprocessor_config_and_load_round_trips(tmp_path):
    from transformers import AutoFeatureExtractor, AutoProcessor

    processor = Drama3Processor(tiny_tokenizer(), Drama3FeatureExtractor(silence_peak=0.02), chunk_bytes=200)
    processor.save_pretrained(tmp_path)
    standalone = json.loads((tmp_path / "preprocessor_config.json").read_text())
    nested = json.loads((tmp_path / "processor_config.json").read_text())["feature_extractor"]
    assert standalone["feature_extractor_type"] == nested["feature_extractor_type"] == "Drama3FeatureExtractor"
    assert standalone["silence_peak"] == nested["silence_peak"] == 0.02
    for loaded in (Drama3Processor.from_pretrained(tmp_path), AutoProcessor.from_pretrained(tmp_path)):
        assert isinstance(loaded, Drama3Processor)
        assert loaded.feature_extractor.silence_peak == 0.02 and loaded.chunk_bytes == 200
    alone = AutoFeatureExtractor.from_pretrained(tmp_path)
    assert isinstance(alone, Drama3FeatureExtractor) and alone.silence_peak == 0.02


def test_a_folder_saved_without_a_feature_extractor_loads_with_the_codec_rate(tmp_path):
    processor = Drama3Processor(tiny_tokenizer(), codec=tiny_codec(sampling_rate=22050), min_reference_fraction=0.0)
    processor.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    config = json.loads((tmp_path / "processor_config.json").read_text())
    del config["feature_extractor"]
    config["sampling_rate"] = 44100  # what processors saved before the feature extractor wrote
    (tmp_path / "processor_config.json").write_text(json.dumps(config))
    loaded = Drama3Processor.from_pretrained(tmp_path)
    assert isinstance(loaded.feature_extractor, Drama3FeatureExtractor)
    assert loaded.sampling_rate == 22050
    codes_only = Drama3Processor.from_pretrained(tmp_path, load_codec=False)
    assert codes_only.sampling_rate == 44100
    script = Script("Hi.", references=[Reference("r", random_codes(2, num_codebooks=4))])
    assert torch.equal(loaded(script)["input_ids"], processor(script)["input_ids"])


# ---- codecs by model_type ----------------------------------------------------------------------------------


class FakeCodecConfig(PreTrainedConfig):
    model_type = "fake_codec"


class FakeCodec:
    """Stands in for a second codec class: what the processor reads of a codec."""

    num_codebooks, sampling_rate, frame_rate = 4, 16000, 25.0

    def __init__(self, folder):
        self.folder = folder

    @classmethod
    def from_pretrained(cls, folder, **kwargs):
        return cls(folder)


def _saved_with_codec_type(tmp_path, model_type: str):
    Drama3Processor(tiny_tokenizer(), codec=tiny_codec()).save_pretrained(tmp_path)
    config_file = tmp_path / "codec" / "config.json"
    config = json.loads(config_file.read_text())
    config["model_type"] = model_type
    config_file.write_text(json.dumps(config))


def test_the_saved_codec_loads_with_the_class_of_its_model_type(tmp_path):
    _saved_with_codec_type(tmp_path, "fake_codec")
    AutoConfig.register(FakeCodecConfig.model_type, FakeCodecConfig, exist_ok=True)
    AutoModel.register(FakeCodecConfig, FakeCodec, exist_ok=True)
    loaded = Drama3Processor.from_pretrained(tmp_path)
    assert isinstance(loaded.codec, FakeCodec) and loaded.codec.folder.endswith("codec")
    assert (loaded.sampling_rate, loaded.frame_rate) == (16000, 25.0)


def test_an_unknown_codec_model_type_is_refused_clearly(tmp_path):
    _saved_with_codec_type(tmp_path, "mystery_codec")
    with pytest.raises(ValueError, match=r"codec model_type 'mystery_codec' is not a known codec; known: \['drama3_codec'"):
        Drama3Processor.from_pretrained(tmp_path)
