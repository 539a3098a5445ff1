"""Bad input to the codec is a ValueError that names the input, raised before any convolution."""

import numpy as np
import pytest
import torch
from codec_helpers import one_thread  # noqa: F401 (fixture)

from transformers_drama3.codec import check_audio, is_inaudible

RATE = 44100
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def codec(codec32):
    return codec32


def test_empty_audio_is_rejected(codec):
    with pytest.raises(ValueError, match=r"audio\[0\] is empty"):
        codec.encode(np.zeros(0, dtype=np.float32), sampling_rate=RATE)
    with pytest.raises(ValueError, match="audio is an empty list"):
        codec.encode([], sampling_rate=RATE)
    with pytest.raises(ValueError, match=r"audio\[1\] is empty"):
        codec.encode([np.ones(10, dtype=np.float32), np.zeros(0, dtype=np.float32)], sampling_rate=RATE)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_samples_are_rejected(codec, bad):
    audio = torch.zeros(2, 100)
    audio[1, 50] = bad
    with pytest.raises(ValueError, match=r"audio\[1\] has 1 NaN or infinite samples"):
        codec.encode(audio, sampling_rate=RATE)


def test_audio_longer_than_the_limit_is_rejected(codec):
    with pytest.raises(ValueError, match=r"audio\[0\] is 2.0 s long; expected at most 1 s"):
        codec.encode(np.zeros(2 * RATE, dtype=np.float32), sampling_rate=RATE, max_seconds=1)
    assert codec.config.max_audio_seconds == 600  # the default guard: 10 minutes


def test_the_length_limit_counts_seconds_at_the_input_rate(codec):
    with pytest.raises(ValueError, match="is 3.0 s long"):
        codec.encode(np.zeros(3 * 8000, dtype=np.float32), sampling_rate=8000, max_seconds=2)


@pytest.mark.parametrize(
    "audio, message",
    [
        (np.zeros(10, dtype=np.complex64), "is complex"),
        (torch.zeros(10, dtype=torch.complex64), "is complex"),
        (np.zeros(10, dtype=bool), "boolean|expected a float"),
        (np.zeros(10, dtype=np.int64), "dtype int64; expected float audio or int8/int16/int32/uint8 PCM"),
        (torch.zeros(10, dtype=torch.int64), "dtype torch.int64; expected float audio"),
        (["a", "b"], "not numeric audio"),
    ],
    ids=["complex-numpy", "complex-torch", "bool", "int64-numpy", "int64-torch", "strings"],
)
def test_wrong_dtypes_are_rejected(codec, audio, message):
    with pytest.raises(ValueError, match=message):
        codec.encode(audio, sampling_rate=RATE)


@pytest.mark.parametrize("dtype, full_scale", [(np.int16, 2**15), (np.int32, 2**31), (np.int8, 2**7)])
def test_pcm_integers_are_converted_with_their_full_scale(dtype, full_scale):
    pcm = np.array([-full_scale, 0, full_scale // 2], dtype=dtype)
    assert check_audio(pcm).tolist() == [-1.0, 0.0, 0.5]
    assert check_audio(np.array([0, 128, 255], dtype=np.uint8)).tolist() == [-1.0, 0.0, 127 / 128]


def test_wrong_shapes_are_rejected(codec):
    with pytest.raises(ValueError, match=r"audio has shape \(1, 1, 1, 10\); expected \[samples\]"):
        codec.encode(np.zeros((1, 1, 1, 10), dtype=np.float32), sampling_rate=RATE)
    with pytest.raises(ValueError, match="soundfile returns"):  # [samples, channels] by mistake
        codec.encode([np.zeros((1000, 2), dtype=np.float32)], sampling_rate=RATE)
    with pytest.raises(ValueError, match=r"audio\[0\] has shape \(1, 2, 3\)"):
        codec.encode([np.zeros((1, 2, 3), dtype=np.float32)], sampling_rate=RATE)


@pytest.mark.parametrize("rate", [0, -44100, None, "44100"])
def test_bad_sampling_rates_are_rejected(codec, rate):
    with pytest.raises(ValueError, match="sampling_rate of audio"):
        codec.encode(np.zeros(10, dtype=np.float32), sampling_rate=rate)


def test_bad_lengths_are_rejected(codec):
    audio = np.zeros((2, 100), dtype=np.float32)
    with pytest.raises(ValueError, match=r"lengths has shape \(1,\); expected \(2,\)"):
        codec.encode(audio, sampling_rate=RATE, lengths=[100])
    with pytest.raises(ValueError, match=r"lengths is \[100, 101\]; expected 0..100 samples"):
        codec.encode(audio, sampling_rate=RATE, lengths=[100, 101])
    with pytest.raises(ValueError, match="lengths was given with a list"):
        codec.encode([audio[0]], sampling_rate=RATE, lengths=[100])


def test_silence_encodes_but_check_audio_can_reject_it(codec):
    silence = np.zeros(200, dtype=np.float32)
    assert is_inaudible(torch.from_numpy(silence))
    assert codec.encode(silence, sampling_rate=RATE).audio_codes.shape[-1] > 0
    assert not is_inaudible(torch.tensor([0.0, 0.5]))
    with pytest.raises(ValueError, match="reference is silent"):
        check_audio(silence, "reference", reject_silence=True)


def test_check_audio_names_the_input():
    with pytest.raises(ValueError, match="speaker_2.wav has 1 NaN"):
        check_audio(np.array([0.0, np.nan]), "speaker_2.wav")
    with pytest.raises(ValueError, match="ref is 1.0 s long; expected at most 0.5 s"):
        check_audio(np.zeros(100), "ref", sampling_rate=100, max_seconds=0.5)


def test_negative_codes_are_rejected(codec):
    codes = torch.zeros(1, codec.num_codebooks, 3, dtype=torch.long)
    codes[0, 2, 1] = -1
    with pytest.raises(ValueError, match=r"codes has negative values \(min -1\); expected codes >= 0"):
        codec.decode(codes)


@pytest.mark.parametrize(
    "codes, message",
    [
        (torch.zeros(1, 10, 3), "dtype torch.float32; expected integer codes"),
        (torch.zeros(1, 3, 3, dtype=torch.long), r"shape \(1, 3, 3\); expected \[batch, 4, frames\]"),
        (torch.zeros(3, dtype=torch.long), r"codes has shape \(3,\); expected"),
        ([[1, 2]], "codes is a list; expected an integer tensor"),
    ],
    ids=["float", "codebooks", "1-d", "list"],
)
def test_malformed_codes_are_rejected(codec, codes, message):
    with pytest.raises(ValueError, match=message):
        codec.decode(codes)


def test_decode_lengths_must_fit_the_codes(codec):
    codes = np.zeros((2, codec.num_codebooks, 4), dtype=np.int32)
    with pytest.raises(ValueError, match=r"lengths is \[4, 5\]; expected 0..4 frames"):
        codec.decode(codes, lengths=[4, 5])
    assert codec.decode(codes, lengths=[4, 2]).lengths.tolist() == [4 * codec.hop_length, 2 * codec.hop_length]


def test_no_frames_decode_to_no_audio(codec):
    decoded = codec.decode(torch.zeros(2, codec.num_codebooks, 0, dtype=torch.long))
    assert decoded.audio_values.shape == (2, 0)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64])
def test_unsigned_codes_decode_like_signed_ones(codec, dtype):
    codes = torch.randint(0, 50, (1, codec.num_codebooks, 3))
    from_unsigned = codec.decode(codes.numpy().astype(dtype)).audio_values
    assert torch.equal(from_unsigned, codec.decode(codes).audio_values)
    assert torch.equal(codec.decode(codes.to(torch.uint16)).audio_values, codec.decode(codes).audio_values)


def test_one_codes_check_serves_the_codec_and_the_prompt():
    """With a codebook size (the prompt's range) codes past it are refused too; without, only negatives."""
    from transformers_drama3.codec.audio import check_codes

    codes = torch.tensor([[0, 4096]])
    assert torch.equal(check_codes(codes, 1)[0], codes[None])
    with pytest.raises(ValueError, match=r"ref: codes must lie in \[0, 4096\); got values from 0 to 4096"):
        check_codes(codes, 1, name="ref", codebook_size=4096)
    with pytest.raises(ValueError, match=r"ref: codes must lie in \[0, 4096\); got values from -2 to 0"):
        check_codes(torch.tensor([[-2, 0]]), 1, name="ref", codebook_size=4096)
