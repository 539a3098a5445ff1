"""Streaming: chunks come in the serving window schedule, concatenate to the offline waveform of
the same codes, follow the click rule, and report the time to first audio."""

import pytest
import torch

from generation_helpers import SEMANTIC_START, prompt, script_main_tokens, tiny_model
from transformers_drama3.codec.take_audio import AudioChunk, default_stream_windows


@pytest.fixture(scope="module")
def model(codec64):
    # `random_tiny_model`'s weights, counting the tiny codec's frames (its rate and frame size)
    return tiny_model(seed=0, sampling_rate=codec64.sampling_rate, frame_size=codec64.hop_length)


@pytest.fixture(scope="module")
def codec(codec64):
    return codec64  # float64: streaming == offline up to 1e-9, not float32 rounding


class Collector:
    """A transformers BaseStreamer stand-in that keeps what it receives."""

    def __init__(self):
        self.values, self.ended = [], False

    def put(self, value):
        self.values.append(value)

    def end(self):
        self.ended = True


def test_window_schedule_is_10_10_12_32_then_64():
    windows = default_stream_windows()
    assert [next(windows) for _ in range(7)] == [10, 10, 12, 32, 64, 64, 64]


def test_streamed_chunks_concatenate_to_the_offline_waveform(model, codec):
    ids, codes = prompt(seed=1)
    offline = model.generate(ids[None], codes[None], seed=5, max_new_tokens=25, codec=codec, return_dict_in_generate=True)
    chunks = list(model.stream(ids[None], codes[None], seed=5, max_new_tokens=25, codec=codec))
    assert all(isinstance(chunk, AudioChunk) for chunk in chunks)
    assert [chunk.codes.shape[0] for chunk in chunks[:2]] == [10, 10]
    assert chunks[-1].is_last and not any(chunk.is_last for chunk in chunks[:-1])
    streamed_codes = torch.cat([chunk.codes for chunk in chunks if chunk.codes.numel()])
    assert torch.equal(streamed_codes, offline.audio_codes[0, : int(offline.lengths[0])])
    waveform = torch.cat([chunk.audio for chunk in chunks])
    assert waveform.shape == offline.audio[0].shape
    assert torch.allclose(waveform, offline.audio[0], atol=1e-9)
    assert chunks[0].elapsed > 0 and chunks[0].first_frame == 0 and chunks[1].first_frame == 10


def test_generate_with_a_streamer_puts_waveform_chunks_and_reports_time_to_first_audio(model, codec):
    ids, codes = prompt(seed=2)
    streamer = Collector()
    out = model.generate(
        ids[None], codes[None], seed=3, max_new_tokens=22, codec=codec, streamer=streamer, return_dict_in_generate=True
    )
    assert streamer.ended
    assert [value.shape[0] for value in streamer.values][:2] == [10 * codec.hop_length] * 2
    assert torch.allclose(torch.cat(streamer.values), out.audio[0], atol=1e-9)
    assert out.time_to_first_audio is not None and out.time_to_first_audio > 0


def test_without_a_codec_the_streamer_receives_frames(model):
    ids, codes = prompt(seed=3)
    streamer = Collector()
    out = model.generate(ids[None], codes[None], seed=1, max_new_tokens=4, streamer=streamer, return_dict_in_generate=True)
    assert all(value.shape == (1, 1, 4) for value in streamer.values)
    assert torch.equal(torch.cat(streamer.values, dim=1)[0], out.audio_codes[0])


def test_a_streamed_click_frame_before_eos_is_never_emitted():
    model = tiny_model(seed=0)
    script_main_tokens(model, [[SEMANTIC_START + 5, SEMANTIC_START, SEMANTIC_START + 2, SEMANTIC_START]])
    chunks = list(model.stream(*prompt(1), do_sample=False, max_new_tokens=10))
    emitted = [int(chunk.codes[0, 0]) for chunk in chunks if chunk.codes.numel()]
    assert emitted == [5, 0, 2]


def test_streaming_needs_a_single_prompt(model):
    ids, codes = prompt(seed=1)
    with pytest.raises(ValueError, match="batch of 1"):
        model.generate(torch.stack([ids, ids]), torch.stack([codes, codes]), streamer=Collector(), max_new_tokens=2)
