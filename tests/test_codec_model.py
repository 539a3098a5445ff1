"""encode / decode on a tiny random codec: shapes, causality, batching, resampling, clamping."""

import numpy as np
import pytest
import soxr
import torch
from codec_helpers import one_thread  # noqa: F401 (fixture)

from transformers_drama3.codec.modeling_codec import WindowLimitedTransformer, rotary_cos_sin, window_mask

RATE = 44100
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def codec(codec32):
    return codec32


def noise(samples: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randn(batch, samples, generator=torch.Generator().manual_seed(seed)) * 0.3


def random_codes(codec, frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    semantic = torch.randint(codec.config.semantic_codebook_size, (batch, 1, frames), generator=generator)
    residual = torch.randint(codec.config.residual_codebook_size, (batch, codec.num_codebooks - 1, frames), generator=generator)
    return torch.cat([semantic, residual], dim=1)


def test_encode_gives_one_frame_per_started_hop(codec):
    hop = codec.hop_length
    encoded = codec.encode([noise(5 * hop)[0], noise(5 * hop + 1)[0], noise(1)[0]], sampling_rate=RATE)
    assert encoded.audio_codes.dtype == torch.long
    assert encoded.audio_codes.shape == (3, codec.num_codebooks, 6)
    assert encoded.lengths.tolist() == [5, 6, 1]


def test_codes_lie_in_their_codebooks(codec):
    codes = codec.encode(noise(40 * codec.hop_length), sampling_rate=RATE).audio_codes
    assert 0 <= codes.min()
    assert codes[:, 0].max() < codec.config.semantic_codebook_size
    assert codes[:, 1:].max() < codec.config.residual_codebook_size
    assert len(codes[0, 0].unique()) > 1  # the tiny codec is not degenerate


def test_decode_gives_hop_length_samples_per_frame(codec):
    decoded = codec.decode(random_codes(codec, 7, batch=2))
    assert decoded.audio_values.shape == (2, 7 * codec.hop_length)
    assert decoded.lengths.tolist() == [7 * codec.hop_length] * 2
    assert decoded.audio_values.abs().max() <= 1.0
    assert decoded.audio_values.std() > 1e-3


def test_unbatched_codes_decode_as_a_batch_of_one(codec):
    codes = random_codes(codec, 5)
    assert torch.equal(codec.decode(codes[0]).audio_values, codec.decode(codes).audio_values)


def test_encoding_is_causal(codec):
    hop, frames = codec.hop_length, 24
    audio = noise(frames * hop)
    cut = 13 * hop + 5  # inside frame 13
    changed = audio.clone()
    changed[:, cut:] = noise(frames * hop - cut, seed=1)

    before, after = codec.encode(audio, sampling_rate=RATE).audio_codes, codec.encode(changed, sampling_rate=RATE).audio_codes

    assert torch.equal(before[..., :13], after[..., :13])  # frames that end before the change
    assert not torch.equal(before[..., 13:], after[..., 13:])


def test_decoding_is_causal(codec):
    codes = random_codes(codec, 20)
    changed = codes.clone()
    changed[..., 12:] = random_codes(codec, 8, seed=1)

    before, after = codec.decode(codes).audio_values, codec.decode(changed).audio_values

    assert torch.equal(before[:, : 12 * codec.hop_length], after[:, : 12 * codec.hop_length])
    assert not torch.allclose(before[:, 12 * codec.hop_length :], after[:, 12 * codec.hop_length :])


def test_batched_encode_equals_encoding_each_item(codec64):
    codec = codec64
    items = [noise(n, seed=n)[0] for n in (30 * codec.hop_length, 7 * codec.hop_length + 3, 100)]
    batched = codec.encode(items, sampling_rate=RATE)
    for row, item in enumerate(items):
        single = codec.encode(item, sampling_rate=RATE)
        frames = int(single.lengths[0])
        assert batched.lengths[row] == frames
        assert torch.equal(batched.audio_codes[row, :, :frames], single.audio_codes[0])


def test_padded_batch_with_lengths_equals_a_list(codec):
    items = [noise(n, seed=n)[0] for n in (300, 170)]
    padded = torch.zeros(2, 300)
    padded[0], padded[1, :170] = items[0], items[1]
    from_padded = codec.encode(padded, sampling_rate=RATE, lengths=[300, 170])
    from_list = codec.encode(items, sampling_rate=RATE)
    assert torch.equal(from_padded.audio_codes, from_list.audio_codes)
    assert torch.equal(from_padded.lengths, from_list.lengths)


def test_batched_decode_equals_decoding_each_item(codec64):
    codec = codec64
    codes = random_codes(codec, 25, batch=3)
    lengths = torch.tensor([25, 9, 1])
    batched = codec.decode(codes, lengths)
    for row, frames in enumerate(lengths.tolist()):
        single = codec.decode(codes[row : row + 1, :, :frames]).audio_values[0]
        samples = frames * codec.hop_length
        assert batched.lengths[row] == samples
        torch.testing.assert_close(batched.audio_values[row, :samples], single, rtol=1e-9, atol=1e-9)
        assert not batched.audio_values[row, samples:].any()  # silence past each item's end


def test_decode_clamps_codes_above_each_codebook_like_the_published_decoder(codec):
    codes = random_codes(codec, 6)
    too_big = codes.clone()
    too_big[:, 0, 2] = 5000
    too_big[:, 1:, 3] = 4095  # the LM's acoustic heads emit up to 4095
    clamped = codes.clone()
    clamped[:, 0, 2] = codec.config.semantic_codebook_size - 1
    clamped[:, 1:, 3] = codec.config.residual_codebook_size - 1
    assert torch.equal(codec.decode(too_big).audio_values, codec.decode(clamped).audio_values)
    assert too_big[0, 0, 2] == 5000  # the caller's codes are not modified


def test_other_sampling_rates_are_resampled(codec):
    seconds = 40 * codec.hop_length / RATE
    low = noise(round(seconds * 22050))[0].numpy()
    native = codec.encode(noise(round(seconds * RATE)), sampling_rate=RATE)
    resampled = codec.encode(low, sampling_rate=22050)
    assert abs(int(resampled.lengths[0]) - int(native.lengths[0])) <= 1
    expected = codec.encode(soxr.resample(low, 22050, RATE), sampling_rate=RATE)
    assert torch.equal(resampled.audio_codes, expected.audio_codes)


def test_channels_are_averaged(codec):
    stereo = noise(400, batch=2)
    as_batch = codec.encode(stereo[None], sampling_rate=RATE)  # [batch 1, channels 2, samples]
    as_list = codec.encode([stereo.numpy()], sampling_rate=RATE)  # [channels, samples] item
    mono = codec.encode(stereo.mean(dim=0), sampling_rate=RATE)
    assert torch.equal(as_batch.audio_codes, mono.audio_codes)
    assert torch.equal(as_list.audio_codes, mono.audio_codes)


def test_pcm_integers_are_scaled_to_unit_range(codec):
    pcm = (noise(300)[0].clamp(-1, 1) * 32767).to(torch.int16)
    from_int = codec.encode(pcm.numpy(), sampling_rate=RATE)
    from_float = codec.encode(pcm.float() / 32768, sampling_rate=RATE)
    assert torch.equal(from_int.audio_codes, from_float.audio_codes)


def test_silent_audio_encodes(codec):
    encoded = codec.encode(np.zeros(3 * codec.hop_length, dtype=np.float32), sampling_rate=RATE)
    assert encoded.audio_codes.shape == (1, codec.num_codebooks, 3)


def test_forward_reconstructs_whole_frames(codec):
    decoded = codec(noise(3 * codec.hop_length + 1, batch=2))
    assert decoded.audio_values.shape == (2, 4 * codec.hop_length)


def test_windowed_attention_in_blocks_equals_one_full_masked_pass(codec64):
    """The offline transformer runs in window-sized blocks; the published one masks the whole
    sequence at once. Same result."""
    transformer: WindowLimitedTransformer = codec64.encoder.block[2].block[5]
    hidden = torch.randn(2, transformer.window * 3 + 5, codec64.config.latent_dim, dtype=torch.float64)
    blocked = transformer(hidden.transpose(1, 2)).transpose(1, 2)

    positions = torch.arange(hidden.shape[1])
    empty = transformer.empty_state(hidden)
    cos, sin = rotary_cos_sin(positions, transformer.head_dim, transformer.rope_theta, transformer.rope_table_dtype)
    full = hidden
    for layer, keys, values in zip(transformer.layers, empty.keys, empty.values):
        full, _, _ = layer(full, cos, sin, keys, values, window_mask(positions, positions, transformer.window))
    full = transformer.norm(full)
    torch.testing.assert_close(blocked, full, rtol=1e-9, atol=1e-9)
