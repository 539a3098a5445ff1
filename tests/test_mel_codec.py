"""The log-mel residual-VQ codec (drama3-tiny's): sizes, streaming == offline, fitting, fidelity."""

import numpy as np
import pytest
import torch

from transformers_drama3.codec import Drama3MelCodecConfig, Drama3MelCodecModel, fit_residual_codebooks

RATE = 22050


def tone(f0: float, seconds: float, rate: int = RATE, harmonics: int = 6) -> np.ndarray:
    """A harmonic tone with a slow vibrato and a fade in/out: voiced-speech-like spectra."""
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.03 * np.sin(2 * np.pi * 3 * t))) / rate
    wave = sum(np.sin(k * phase) / k for k in range(1, harmonics + 1))
    envelope = np.minimum(1.0, np.minimum(t, t[-1] - t) * 10)
    return (0.3 * wave * envelope).astype(np.float32)


def codec_fitted_on_tones(num_codebooks: int = 4, codebook_size: int = 64) -> Drama3MelCodecModel:
    torch.manual_seed(0)
    codec = Drama3MelCodecModel(Drama3MelCodecConfig(num_codebooks=num_codebooks, codebook_size=codebook_size)).eval()
    audio = [tone(f0, 1.5) for f0 in (110, 140, 180, 220, 260, 300)]
    features = []
    for item in audio:
        frames = len(item) // codec.hop_length
        samples = torch.from_numpy(item[: frames * codec.hop_length])[None]
        features.append(codec.features(codec.log_mel(samples))[0])
    features = torch.cat(features)
    mean, scale = features.mean(0), features.std(0).clamp_min(1e-3)
    with torch.no_grad():
        codec.feature_mean.copy_(mean)
        codec.feature_scale.copy_(scale)
        codec.codebooks.copy_(fit_residual_codebooks((features - mean) / scale, num_codebooks, codebook_size,
                                                     iterations=10, progress=False))
    return codec


@pytest.fixture(scope="module")
def fitted_codec():
    """A codec whose codebooks are fitted on tones of several pitches."""
    return codec_fitted_on_tones()


def test_sizes_follow_the_config(fitted_codec):
    codec = fitted_codec
    assert codec.frame_rate == pytest.approx(22050 / 1024)
    encoded = codec.encode(tone(150, 1.0), sampling_rate=RATE)
    assert encoded.audio_codes.shape == (1, 4, 22)  # ceil(22050 / 1024)
    assert encoded.audio_codes.max() < 64 and encoded.audio_codes.min() >= 0
    decoded = codec.decode(encoded.audio_codes, encoded.lengths)
    assert decoded.audio_values.shape == (1, 22 * 1024) and int(decoded.lengths[0]) == 22 * 1024


def test_resampled_input_gives_the_same_frame_count(fitted_codec):
    from scipy.signal import resample_poly

    at_16k = resample_poly(tone(150, 1.0), 320, 441).astype(np.float32)
    assert fitted_codec.encode(at_16k, sampling_rate=16000).audio_codes.shape[-1] == 22


def test_streaming_encoder_equals_offline(fitted_codec):
    audio = tone(170, 1.3)
    offline = fitted_codec.encode(audio, sampling_rate=RATE).audio_codes
    stream = fitted_codec.streaming_encoder()
    rng = np.random.default_rng(0)
    pieces, start = [], 0
    while start < len(audio):
        size = int(rng.integers(1, 3000))
        pieces.append(stream.push(audio[start : start + size]))
        start += size
    pieces.append(stream.flush())
    assert torch.equal(torch.cat(pieces, dim=-1), offline)


@pytest.mark.parametrize("windows", [[1], [10, 10, 12, 32, 64], [3, 17]])
def test_streaming_decoder_equals_offline(fitted_codec, windows):
    codes = fitted_codec.encode(tone(200, 2.1), sampling_rate=RATE).audio_codes  # 46 frames: not a whole block
    offline = fitted_codec.decode(codes).audio_values
    stream = fitted_codec.streaming_decoder()
    pieces, start, turn = [], 0, 0
    while start < codes.shape[-1]:
        size = windows[min(turn, len(windows) - 1)]
        pieces.append(stream.push(codes[..., start : start + size]))
        start, turn = start + size, turn + 1
    pieces.append(stream.flush())
    streamed = torch.cat(pieces, dim=-1)
    assert streamed.shape == offline.shape
    torch.testing.assert_close(streamed, offline, rtol=0, atol=1e-5)
    # whole blocks come out before the stream ends (the decoder does not wait for flush)
    assert sum(p.shape[-1] for p in pieces[:-1]) >= (codes.shape[-1] // 8 - 1) * 8 * 1024


def test_streaming_equals_offline_with_the_ten_codebooks_of_the_drama3_layout():
    codec = codec_fitted_on_tones(num_codebooks=10, codebook_size=16)
    audio = tone(190, 1.7)
    codes = codec.encode(audio, sampling_rate=RATE).audio_codes
    encoder, decoder = codec.streaming_encoder(), codec.streaming_decoder()
    streamed_codes = torch.cat([encoder.push(audio[:5000]), encoder.push(audio[5000:]), encoder.flush()], dim=-1)
    streamed = torch.cat([decoder.push(codes[..., :13]), decoder.push(codes[..., 13:]), decoder.flush()], dim=-1)
    assert codes.shape[1] == 10 and torch.equal(streamed_codes, codes)
    torch.testing.assert_close(streamed, codec.decode(codes).audio_values, rtol=0, atol=1e-5)


def test_batch_equals_items(fitted_codec):
    a, b = tone(120, 1.0), tone(250, 0.6)
    batch = fitted_codec.encode([a, b], sampling_rate=RATE)
    decoded = fitted_codec.decode(batch.audio_codes, batch.lengths)
    for item, audio in enumerate((a, b)):
        alone = fitted_codec.encode(audio, sampling_rate=RATE)
        frames = int(alone.lengths[0])
        assert torch.equal(batch.audio_codes[item, :, :frames], alone.audio_codes[0])
        torch.testing.assert_close(
            decoded.audio_values[item, : frames * 1024], fitted_codec.decode(alone.audio_codes).audio_values[0], rtol=0, atol=1e-4
        )


def log_mel_of(codec, audio: np.ndarray) -> torch.Tensor:
    frames = len(audio) // codec.hop_length
    return codec.log_mel(torch.from_numpy(audio[: frames * codec.hop_length])[None])[0]


def dominant_frequency(audio: np.ndarray, rate: int = RATE) -> float:
    middle = audio[len(audio) // 4 : 3 * len(audio) // 4]
    spectrum = np.abs(np.fft.rfft(middle * np.hanning(len(middle))))
    return float(np.argmax(spectrum) * rate / len(middle))


def test_resynthesis_keeps_spectrum_and_pitch(fitted_codec):
    original = tone(160, 1.5)  # a pitch between the fitted ones
    encoded = fitted_codec.encode(original, sampling_rate=RATE)
    resynthesis = fitted_codec.decode(encoded.audio_codes).audio_values[0].numpy()[: len(original)]
    mel_original, mel_resynthesis = log_mel_of(fitted_codec, original), log_mel_of(fitted_codec, resynthesis)
    voiced = mel_original.max(dim=0).values > -4  # frames with sound
    error = (mel_original - mel_resynthesis).abs()[:, voiced].mean()
    assert error < 1.0, f"log-mel L1 {error:.2f}"
    # the same codes decoded with silence as input would be far off: the check can fail
    silence_error = (mel_original - log_mel_of(fitted_codec, np.zeros_like(original))).abs()[:, voiced].mean()
    assert silence_error > 3 * error
    # a pitch the codebooks were fitted on survives (between fitted pitches the quantiser snaps)
    seen = tone(220, 1.2)
    again = fitted_codec.decode(fitted_codec.encode(seen, sampling_rate=RATE).audio_codes).audio_values[0].numpy()[: len(seen)]
    assert dominant_frequency(again) == pytest.approx(220, rel=0.05)


def test_synthesizing_the_dequantised_log_mel_is_decoding_the_codes(fitted_codec):
    codes = fitted_codec.encode(tone(190, 1.7), sampling_rate=RATE).audio_codes  # 37 frames: 4 blocks and a rest
    decoded = fitted_codec.decode(codes).audio_values
    synthesized = fitted_codec.synthesize(fitted_codec.dequantize(codes))
    torch.testing.assert_close(synthesized.clamp(-1, 1), decoded, rtol=0, atol=1e-6)


def test_synthesizing_an_unquantised_log_mel_is_closer_than_the_codes(fitted_codec):
    """The measure of the representation alone: without the quantiser the log-mel error is smaller."""
    original = tone(160, 1.5)
    mel = log_mel_of(fitted_codec, original)
    unquantised = fitted_codec.synthesize(mel[None])[0].numpy()[: len(original)]
    quantised = fitted_codec.decode(fitted_codec.encode(original, sampling_rate=RATE).audio_codes).audio_values[0].numpy()
    voiced = mel.max(dim=0).values > -4
    error = (mel - log_mel_of(fitted_codec, unquantised)).abs()[:, voiced].mean()
    assert error < (mel - log_mel_of(fitted_codec, quantised[: len(original)])).abs()[:, voiced].mean()


def test_more_codebooks_quantise_better():
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(8, 16, generator=generator) * 5
    data = centres[torch.randint(0, 8, (2000,), generator=generator)] + torch.randn(2000, 16, generator=generator)
    codebooks = fit_residual_codebooks(data, 3, 8, iterations=15, progress=False)
    residual, errors = data.clone(), []
    for codebook in codebooks:
        index = torch.cdist(residual, codebook).argmin(-1)
        residual = residual - codebook[index]
        errors.append(residual.square().sum(-1).mean().item())
    assert errors[0] < 16 * 1.5  # the first codebook finds the 8 clusters: only the unit noise is left
    assert errors[0] > errors[1] > errors[2]


def test_save_and_load_round_trip(fitted_codec, tmp_path):
    fitted_codec.save_pretrained(tmp_path)
    loaded = Drama3MelCodecModel.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded.window, fitted_codec.window)  # not stored: recomputed from the config
    torch.testing.assert_close(loaded.mel_basis, fitted_codec.mel_basis)
    codes = fitted_codec.encode(tone(150, 0.8), sampling_rate=RATE).audio_codes
    assert torch.equal(loaded.encode(tone(150, 0.8), sampling_rate=RATE).audio_codes, codes)
    torch.testing.assert_close(loaded.decode(codes).audio_values, fitted_codec.decode(codes).audio_values)


def test_processor_loads_the_codec_by_model_type(fitted_codec, tmp_path):
    from processor_helpers import tiny_tokenizer

    from transformers_drama3.processing_drama3 import Drama3Processor

    processor = Drama3Processor(tiny_tokenizer(), codec=fitted_codec, codebook_size=64, num_codebooks=4)
    processor.save_pretrained(tmp_path)
    loaded = Drama3Processor.from_pretrained(tmp_path)
    assert isinstance(loaded.codec, Drama3MelCodecModel)
    assert loaded.sampling_rate == RATE and loaded.num_codebooks == 4


def test_bad_codes_and_sizes_are_refused(fitted_codec):
    with pytest.raises(ValueError, match="negative"):
        fitted_codec.decode(torch.full((1, 4, 3), -1))
    with pytest.raises(ValueError, match=r"\[batch, 4, frames\]"):
        fitted_codec.decode(torch.zeros(1, 3, 5, dtype=torch.long))
    # the config validates itself (huggingface_hub's strict dataclass wraps the ValueError)
    with pytest.raises(Exception, match="context_mel_frames 2 must be at least"):
        Drama3MelCodecConfig(context_mel_frames=2)
    with pytest.raises(Exception, match="multiple of mel_hop_length"):
        Drama3MelCodecConfig(hop_length=1000)
    silent_codes = fitted_codec.encode(np.zeros(RATE, dtype=np.float32), sampling_rate=RATE).audio_codes
    assert silent_codes.shape[-1] == 22  # silence encodes (references check silence themselves)
