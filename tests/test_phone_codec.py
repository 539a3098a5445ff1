"""The phonetic codec (drama3-tiny's next codec): layout, streaming == offline, receptive field,
batches, saving and loading, refused inputs."""

import numpy as np
import pytest
import torch

from transformers_drama3.codec import Drama3PhoneCodecConfig, Drama3PhoneCodecModel

RATE = 22050
PHONEMES = ["_", "a", "b", "c", "d", "e"]
VOICES = ["low", "high", "whisper"]


def small_codec(**sizes) -> Drama3PhoneCodecModel:
    """Random weights, small stacks; the heads scaled up so the codes vary with the audio."""
    torch.manual_seed(0)
    config = Drama3PhoneCodecConfig(phonemes=PHONEMES, voices=VOICES, hidden_size=32, dilations=[1, 2, 4],
                                    codebook_size=16, **sizes)
    codec = Drama3PhoneCodecModel(config).eval()
    with torch.no_grad():
        codec.input_mean.fill_(-6.0)
        codec.input_scale.fill_(3.0)
        codec.phoneme_head.weight.mul_(8.0)
        codec.voice_head.weight.mul_(8.0)
        codec.decoder_output.weight.mul_(0.1)
        codec.decoder_output.bias.fill_(-4.0)
    return codec


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """Harmonic tones whose pitch and loudness jump every 0.1 s, with gaps: frames that differ."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    f0 = np.repeat(rng.uniform(90, 300, int(seconds * 10) + 1), RATE // 10)[: len(t)]
    gain = np.repeat(rng.choice([0.0, 0.1, 0.4], int(seconds * 10) + 1), RATE // 10)[: len(t)]
    phase = 2 * np.pi * np.cumsum(f0) / RATE
    return (gain * sum(np.sin(k * phase) / k for k in range(1, 5))).astype(np.float32)


@pytest.fixture(scope="module")
def codec():
    return small_codec()


# the decoder with its own stack: one more layer, which looks further ahead than the others
OWN_DECODER = dict(decoder_dilations=[1, 2, 4, 8], decoder_lookahead=[4, 4, 4, 16])


@pytest.fixture(scope="module", params=["shared stack", "own decoder stack"])
def decoding_codec(request):
    return small_codec() if request.param == "shared stack" else small_codec(**OWN_DECODER)


def test_the_decoder_may_have_its_own_stack():
    shared, own = small_codec(), small_codec(**OWN_DECODER)
    assert shared.config.decoder_receptive_field == shared.config.receptive_field == (16, 12)
    assert own.config.receptive_field == (16, 12)  # the recogniser keeps the shared sizes
    assert own.config.decoder_receptive_field == (4 * 15 - 28, 4 + 4 + 4 + 16)
    assert len(own.decoder.layers) == 4 and len(own.recogniser.layers) == 3
    assert own.decode_lookahead_frames == 7 and shared.decode_lookahead_frames == 3
    with pytest.raises(Exception, match="one number per decoder dilation"):
        small_codec(decoder_dilations=[1, 2], decoder_lookahead=[4, 4, 4])
    with pytest.raises(Exception, match="decoder's kernel_size and dilations"):
        small_codec(decoder_dilations=[1, 0])


def test_layout_phonemes_then_voice(codec):
    assert codec.num_codebooks == 5 and codec.frame_rate == pytest.approx(22050 / 1024)
    left, right = codec.config.receptive_field
    assert (left, right) == (4 * (1 + 2 + 4) - 12, 12)  # 4 frames ahead a layer, the rest back
    assert codec.decode_lookahead_frames == 3
    codes = codec.encode(speech_like(1.5), sampling_rate=RATE).audio_codes
    assert codes.shape == (1, 5, 33)
    phonemes = torch.cat([codes[:, :1], codes[:, 2:]], dim=1)
    assert phonemes.max() < len(PHONEMES) and codes[:, 1].max() < len(VOICES)
    assert len(phonemes.unique()) > 2  # the codes follow the audio (the tests below are not vacuous)
    labels, voices = codec.code_frames(codes)
    assert torch.equal(labels.reshape(1, 33, 4)[:, :, 0], codes[:, 0])  # spectrogram frame 4 f is codebook 0
    assert torch.equal(labels.reshape(1, 33, 4)[:, :, 1:], codes[:, 2:].transpose(1, 2))
    assert torch.equal(voices.reshape(1, 33, 4), codes[:, 1, :, None].expand(1, 33, 4))


def test_streaming_encoder_equals_offline(codec):
    audio = speech_like(2.3, seed=1)
    offline = codec.encode(audio, sampling_rate=RATE).audio_codes
    rng = np.random.default_rng(0)
    for trial in range(2):
        stream, pieces, start = codec.streaming_encoder(), [], 0
        while start < len(audio):
            size = int(rng.integers(1, 4000)) if trial == 0 else 1024
            pieces.append(stream.push(audio[start : start + size]))
            start += size
        pieces.append(stream.flush())
        assert torch.equal(torch.cat(pieces, dim=-1), offline)
        # the encoder does not wait for the end: all but the lookahead's frames come out before flush
        early = sum(p.shape[-1] for p in pieces[:-1])
        assert early >= offline.shape[-1] - codec.decode_lookahead_frames - 1


@pytest.mark.parametrize("windows", [[1], [10, 10, 12, 32, 64], [3, 17]])
def test_streaming_decoder_equals_offline(decoding_codec, windows):
    codec = decoding_codec
    codes = codec.encode(speech_like(2.1, seed=2), sampling_rate=RATE).audio_codes  # 46 frames
    offline = codec.decode(codes).audio_values
    stream, pieces, start, turn = codec.streaming_decoder(), [], 0, 0
    while start < codes.shape[-1]:
        size = windows[min(turn, len(windows) - 1)]
        pieces.append(stream.push(codes[..., start : start + size]))
        start, turn = start + size, turn + 1
    pieces.append(stream.flush())
    streamed = torch.cat(pieces, dim=-1)
    assert streamed.shape == offline.shape
    torch.testing.assert_close(streamed, offline, rtol=0, atol=1e-5)
    blocks_before_flush = (codes.shape[-1] - codec.decode_lookahead_frames) // 8
    assert sum(p.shape[-1] for p in pieces[:-1]) >= (blocks_before_flush - 1) * 8 * 1024


def test_decoding_is_the_log_mel_of_the_codes_through_griffin_lim(codec):
    codes = codec.encode(speech_like(1.2, seed=3), sampling_rate=RATE).audio_codes
    decoded = codec.decode(codes).audio_values
    synthesised = codec.synthesize(codec.dequantize(codes)).clamp(-1, 1)
    # one convolution over all the codes against one a block: the same sums in another order,
    # then 32 Griffin-Lim iterations
    assert decoded.abs().max() > 0.01
    torch.testing.assert_close(decoded, synthesised[:, : decoded.shape[-1]], rtol=0, atol=1e-3)


def test_a_frame_reads_exactly_its_receptive_field(decoding_codec):
    """Changing a spectrogram frame's label changes the decoded frames within the decoder's
    receptive field around it and no other."""
    codec = decoding_codec
    left, right = codec.config.decoder_receptive_field
    codes = torch.zeros(1, 5, 40, dtype=torch.long)
    with torch.no_grad():
        base = codec.dequantize(codes)
        changed_codes = codes.clone()
        changed_codes[0, 0, 20] = 3  # spectrogram frame 80
        changed = codec.dequantize(changed_codes)
    differs = (changed - base).abs().amax(dim=1)[0] > 0
    frames = torch.nonzero(differs).flatten()
    assert int(frames.min()) >= 80 - right and int(frames.max()) <= 80 + left
    assert bool(differs[80]) and int(frames.max()) - int(frames.min()) > left  # it does reach back


def test_batch_equals_items(codec):
    a, b = speech_like(1.0, seed=4), speech_like(0.55, seed=5)
    batch = codec.encode([a, b], sampling_rate=RATE)
    decoded = codec.decode(batch.audio_codes, batch.lengths)
    for item, audio in enumerate((a, b)):
        alone = codec.encode(audio, sampling_rate=RATE)
        frames = int(alone.lengths[0])
        assert torch.equal(batch.audio_codes[item, :, :frames], alone.audio_codes[0])
        torch.testing.assert_close(decoded.audio_values[item, : frames * 1024],
                                   codec.decode(alone.audio_codes).audio_values[0], rtol=0, atol=1e-5)


def test_save_and_load_round_trip_by_model_type(codec, tmp_path):
    from transformers import AutoModel

    import transformers_drama3  # noqa: F401  (registers the codec types)

    codec.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, Drama3PhoneCodecModel)
    assert loaded.config.phonemes == PHONEMES and loaded.config.voices == VOICES
    for name, tensor in codec.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    audio = speech_like(0.9, seed=6)
    codes = codec.encode(audio, sampling_rate=RATE).audio_codes
    assert torch.equal(loaded.encode(audio, sampling_rate=RATE).audio_codes, codes)
    torch.testing.assert_close(loaded.decode(codes).audio_values, codec.decode(codes).audio_values)


def test_processor_loads_the_codec(codec, tmp_path):
    from processor_helpers import tiny_tokenizer

    from transformers_drama3.processing_drama3 import Drama3Processor

    processor = Drama3Processor(tiny_tokenizer(), codec=codec, codebook_size=16, num_codebooks=5)
    processor.save_pretrained(tmp_path)
    loaded = Drama3Processor.from_pretrained(tmp_path)
    assert isinstance(loaded.codec, Drama3PhoneCodecModel) and loaded.num_codebooks == 5


def test_bad_configs_and_codes_are_refused(codec):
    with pytest.raises(Exception, match="silence label '_' first"):
        Drama3PhoneCodecConfig(phonemes=["a", "_"])
    with pytest.raises(Exception, match="num_codebooks 10 must be 1 \\+ mel frames per codec frame"):
        Drama3PhoneCodecConfig(num_codebooks=10)
    with pytest.raises(Exception, match="codebook_size 4 is smaller than the 6 phonemes"):
        Drama3PhoneCodecConfig(phonemes=PHONEMES, codebook_size=4)
    with pytest.raises(ValueError, match="negative"):
        codec.decode(torch.full((1, 5, 3), -1))
    with pytest.raises(ValueError, match=r"\[batch, 5, frames\]"):
        codec.decode(torch.zeros(1, 4, 5, dtype=torch.long))
    stream = codec.streaming_encoder()
    with pytest.raises(ValueError, match="NaN"):
        stream.push(np.full(100, np.nan, dtype=np.float32))
    # codes above the label lists (an LM's heads are wider) decode as the last label
    wide = torch.full((1, 5, 4), 15)
    clamped = torch.stack([torch.full((4,), v) for v in (5, 2, 5, 5, 5)])[None]
    torch.testing.assert_close(codec.dequantize(wide), codec.dequantize(clamped))
