"""Streaming encode/decode equals offline, for any chunking, with state that does not grow."""

import itertools

import pytest
import torch
from codec_helpers import one_thread, tiny_codec  # noqa: F401 (fixture)

from transformers_drama3.codec.streaming import cached_elements, stream_decode_windows

RATE = 44100
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def codec(codec64):
    """float64, so streamed and offline results can be compared to 1e-9."""
    return codec64


def noise(samples: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, samples, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.3


def random_codes(codec, frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    semantic = torch.randint(codec.config.semantic_codebook_size, (batch, 1, frames), generator=generator)
    residual = torch.randint(codec.config.residual_codebook_size, (batch, codec.num_codebooks - 1, frames), generator=generator)
    return torch.cat([semantic, residual], dim=1)


def split_by(tensor: torch.Tensor, sizes) -> list[torch.Tensor]:
    """Cut the last dim into consecutive pieces of the given sizes (cycled), the last one shorter."""
    pieces, start = [], 0
    for size in itertools.cycle(sizes):
        if start >= tensor.shape[-1]:
            return pieces
        pieces.append(tensor[..., start : start + size])
        start += size


def stream_encode(codec, audio, sizes, batch_size=1):
    stream = codec.streaming_encoder(batch_size=batch_size)
    codes = [stream.push(piece) for piece in split_by(audio, sizes)]
    return torch.cat([*codes, stream.flush()], dim=-1)


def stream_decode(codec, codes, sizes, batch_size=1):
    stream = codec.streaming_decoder(batch_size=batch_size)
    audio = [stream.push(piece) for piece in split_by(codes, sizes)]
    return torch.cat([*audio, stream.flush()], dim=-1)


# 30 frames is past every window of the tiny codec (encoder: 8 positions = 2 frames; quantizer: 4 frames).
FRAMES = 30


@pytest.mark.parametrize(
    "frames_per_push", [[1], [2], [3, 1, 7], [FRAMES]], ids=["one-frame", "two-frames", "uneven", "whole"]
)
def test_streamed_encoding_equals_offline(codec, frames_per_push):
    audio = noise(FRAMES * codec.hop_length)
    sizes = [n * codec.hop_length for n in frames_per_push]
    assert torch.equal(stream_encode(codec, audio, sizes), codec.encode(audio, sampling_rate=RATE).audio_codes)


def test_streamed_encoding_accepts_pieces_that_cut_frames(codec):
    audio = noise(FRAMES * codec.hop_length + 11)  # ends inside a frame: flush pads it
    streamed = stream_encode(codec, audio, [5, codec.hop_length + 3, 50])
    assert torch.equal(streamed, codec.encode(audio, sampling_rate=RATE).audio_codes)


def test_streamed_encoding_of_a_batch_equals_offline(codec):
    audio = noise(12 * codec.hop_length, batch=2)
    streamed = stream_encode(codec, audio, [codec.hop_length, 3 * codec.hop_length], batch_size=2)
    assert torch.equal(streamed, codec.encode(audio, sampling_rate=RATE).audio_codes)


@pytest.mark.parametrize("frames_per_push", [[1], [3], [2, 5, 1], [FRAMES]], ids=["one-frame", "three", "uneven", "whole"])
def test_streamed_decoding_equals_offline(codec, frames_per_push):
    codes = random_codes(codec, FRAMES)
    offline = codec.decode(codes).audio_values
    torch.testing.assert_close(stream_decode(codec, codes, frames_per_push), offline, rtol=1e-9, atol=1e-9)


def test_streamed_decoding_in_the_serving_windows_equals_offline_without_overlap(codec):
    windows = list(itertools.islice(stream_decode_windows(), 6))
    codes = random_codes(codec, sum(windows), batch=2)
    streamed = stream_decode(codec, codes, windows, batch_size=2)
    torch.testing.assert_close(streamed, codec.decode(codes).audio_values, rtol=1e-9, atol=1e-9)


def test_each_decoded_push_returns_its_frames_at_once(codec):
    stream = codec.streaming_decoder()
    assert stream.push(random_codes(codec, 3)).shape == (1, 3 * codec.hop_length)
    assert stream.push(random_codes(codec, 1)[0]).shape == (1, codec.hop_length)  # unbatched chunk
    assert stream.flush().shape == (1, 0)


def test_encoder_returns_codes_once_a_frame_is_complete(codec):
    stream = codec.streaming_encoder()
    assert stream.push(noise(codec.hop_length - 1)).shape[-1] == 0
    assert stream.push(noise(1)).shape[-1] == 1
    assert stream.push(noise(codec.hop_length // 2)).shape[-1] == 0
    assert stream.flush().shape[-1] == 1
    assert codec.streaming_encoder().flush().shape == (1, codec.num_codebooks, 0)


def test_stream_state_does_not_grow_with_time(codec):
    encoder, decoder = codec.streaming_encoder(), codec.streaming_decoder()
    sizes = []
    for step in range(3 * FRAMES):
        encoder.push(noise(codec.hop_length, seed=step))
        decoder.push(random_codes(codec, 1, seed=step))
        sizes.append((cached_elements(encoder), cached_elements(decoder)))
    # Full once the windows are full (a few frames in); constant from then on.
    assert len(set(sizes[FRAMES:])) == 1
    assert sizes[-1][0] > 0 and sizes[-1][1] > 0


def test_serving_decode_schedule(codec):
    assert list(itertools.islice(stream_decode_windows(), 8)) == [10, 10, 12, 32, 64, 64, 64, 64]


def test_a_flushed_stream_refuses_more_input(codec):
    encoder, decoder = codec.streaming_encoder(), codec.streaming_decoder()
    encoder.flush()
    decoder.flush()
    with pytest.raises(ValueError, match="flushed"):
        encoder.push(noise(10))
    with pytest.raises(ValueError, match="flushed"):
        decoder.push(random_codes(codec, 1))


def test_streams_check_their_chunks(codec):
    with pytest.raises(ValueError, match="audio chunk has NaN"):
        codec.streaming_encoder().push(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="audio chunk has shape"):
        codec.streaming_encoder(batch_size=2).push(noise(10))
    with pytest.raises(ValueError, match="codes chunk has negative"):
        codec.streaming_decoder().push(-random_codes(codec, 2) - 1)


def test_streamed_decoding_in_float32_matches_offline_to_float_tolerance():
    codec32 = tiny_codec()
    codes = random_codes(codec32, FRAMES)
    # The random tiny decoder amplifies float32 rounding ~100x; 1e-3 is still far below its output (~0.3).
    torch.testing.assert_close(stream_decode(codec32, codes, [1]), codec32.decode(codes).audio_values, rtol=0, atol=1e-3)
