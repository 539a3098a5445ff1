"""Long-form: a script longer than one chunk is spoken chunk by chunk, each chunk with the first
and the previous take as history, into one waveform or one stream."""

import pytest
import torch

from generation_helpers import RecordingStreamer
from transformers_drama3.codec.take_audio import WaveformStreamer, decode_audio
from transformers_drama3.runtime import long_form
from transformers_drama3.runtime.long_form import generate_long_form

SENTENCE = "This sentence is long enough that a few of them fill more than one chunk of text. "
TEXT = SENTENCE * 8  # ~660 bytes: three chunks of at most 300


class RecordingProcessor:
    """Delegates to a processor and keeps every request it is called with."""

    def __init__(self, processor):
        self.processor, self.requests = processor, []

    def __call__(self, request, **kwargs):
        self.requests.append(request)
        return self.processor(request, **kwargs)

    def __getattr__(self, name):
        return getattr(self.processor, name)


@pytest.fixture(scope="module")
def bundle(speech_bundle):
    return speech_bundle


def test_each_chunk_sees_the_first_and_the_previous_take(bundle):
    model, processor = bundle
    recorder = RecordingProcessor(processor)
    out = generate_long_form(model, recorder, TEXT, seed=0, max_new_tokens=3, progress=False)
    assert len(out.chunks) == len(recorder.requests) >= 3
    histories = [request.history for request in recorder.requests]
    assert histories[0] == ()
    assert len(histories[1]) == 1 and torch.equal(histories[1][0].audio.codes, out.audio_codes[: out.chunk_lengths[0]].T)
    first, previous = histories[2]
    assert torch.equal(first.audio.codes, histories[1][0].audio.codes)
    start = out.chunk_lengths[0]
    assert torch.equal(previous.audio.codes, out.audio_codes[start : start + out.chunk_lengths[1]].T)
    assert first.lines == out.chunks[0].lines and previous.lines == out.chunks[1].lines


def test_one_waveform_of_all_the_chunks(bundle):
    model, processor = bundle
    out = generate_long_form(model, processor, TEXT, seed=1, max_new_tokens=3, progress=False)
    assert out.audio_codes.shape[0] == sum(out.chunk_lengths)
    # the call's one streaming decoder, window by window (10, 10, 12, ...) across the chunk seams
    streamer = WaveformStreamer(processor.codec, 0.0)
    chunks = streamer.push(list(out.audio_codes)) + streamer.finish()
    assert torch.equal(out.audio, torch.cat([chunk.audio for chunk in chunks]))
    # float32 codec: its streaming state and one offline pass round differently (~1e-4 at most)
    expected = decode_audio(processor.codec, out.audio_codes[None], torch.tensor([out.audio_codes.shape[0]]))[0]
    torch.testing.assert_close(out.audio, expected, rtol=0, atol=1e-3)
    assert out.sampling_rate == 44100


def test_a_long_form_stream_equals_the_offline_waveform(bundle):
    model, processor = bundle
    streamer = RecordingStreamer()
    streamed = generate_long_form(model, processor, TEXT, seed=2, max_new_tokens=3, progress=False, streamer=streamer)
    offline = generate_long_form(model, processor, TEXT, seed=2, max_new_tokens=3, progress=False)
    assert streamer.ends == 1
    # both decode every frame once through one streaming decoder, in the same windows
    assert torch.equal(torch.cat(streamer.values), streamed.audio)
    assert torch.equal(streamed.audio, offline.audio)
    assert streamed.time_to_first_audio is not None


class RecordingBar:
    """Stands in for tqdm: keeps every update and the last postfix."""

    made = []

    def __init__(self, *args, disable=False, **kwargs):
        self.n, self.updates, self.postfix, self.closed = 0, [], "", False
        RecordingBar.made.append(self)

    def update(self, n):
        self.n += n
        self.updates.append(n)

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def close(self):
        self.closed = True


def test_the_progress_bar_counts_frames_as_they_are_made(bundle, monkeypatch):
    """The bar advances as frames are made (not once per chunk), says the seconds of audio they
    hold and which chunk is spoken, and showing it changes nothing in the take."""
    model, processor = bundle
    quiet = generate_long_form(model, processor, TEXT, seed=0, max_new_tokens=3, progress=False)
    monkeypatch.setattr(long_form, "tqdm", RecordingBar)
    RecordingBar.made.clear()
    shown = generate_long_form(model, processor, TEXT, seed=0, max_new_tokens=3, progress=True)
    assert torch.equal(shown.audio_codes, quiet.audio_codes)
    (bar,) = RecordingBar.made
    frames = shown.audio_codes.shape[0]
    assert bar.n == frames and len(bar.updates) > len(shown.chunks) and bar.closed
    assert bar.postfix == f"{frames / processor.frame_rate:.1f} s of audio, chunk {len(shown.chunks)}/{len(shown.chunks)}"
