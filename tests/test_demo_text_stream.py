"""The demo's "Speak as it arrives" tab: a text fed word by word on a clock (a simulated language
model) goes to `model.stream_text` through the server's text-stream path, and its audio starts
while later words have not been read yet; bad fields are refused naming the field, before any work."""

import re

import numpy as np
import pytest
import soundfile

gr = pytest.importorskip("gradio")
gradio_client = pytest.importorskip("gradio_client")

from transformers_drama3.generation.live_text import ChunkSpoken  # noqa: E402
from transformers_drama3.serving.demo import ArrivingText, Director, TakeSettings, VoiceChoice  # noqa: E402

TEXT = "Good morning to you. It is a lovely day. Shall we walk to the river? The boats are out."
FRAMES = 40  # frame cap per chunk: more than the codec holds back before a first block (its decoder reads 8
# frames ahead), so a chunk is heard before the text ends; still cheap on a CPU


@pytest.fixture(scope="module")
def director(demo_backend):
    return Director(demo_backend)


class FakeClock:
    """A clock that only moves when the feed sleeps."""

    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def error_of(call) -> str:
    with pytest.raises(gr.Error) as raised:
        call()
    return raised.value.message


def test_the_feed_releases_each_word_at_its_arrival_time_and_joins_back_to_the_text():
    clock = FakeClock()
    feed = ArrivingText("  One two, three.\nFour  ", 2.0, clock=clock, sleep=clock.sleep)
    assert feed.arrived() == 0
    words = list(feed)
    assert "".join(words) == "One two, three.\nFour"
    assert clock.sleeps == pytest.approx([0.5, 0.5, 0.5])  # the first word at once, then one per 1/rate
    assert feed.arrived() == 4 and feed.arrival(3) == pytest.approx(1.5)


def test_a_word_due_while_the_reader_was_busy_is_read_without_waiting():
    clock = FakeClock()
    feed = ArrivingText("a b c", 1.0, clock=clock, sleep=clock.sleep)
    next(feed)
    clock.now += 5.0  # the model spoke for five seconds: both later words have arrived
    assert feed.arrived() == 3
    assert [next(feed), next(feed)] == ["b ", "c"] and clock.sleeps == []


@pytest.mark.parametrize(
    ("text", "rate", "chunk", "field"),
    [
        ("   ", 4, 60, "Text: nothing to say"),
        ("<|speaker:1|> Hi there.", 4, 60, "Text: speaker 1 has no voice here"),
        ("Hello <whisper>there.", 4, 60, "Text"),
        ("Hello there.", 0, 60, "Words per second"),
        ("Hello there.", 4, 2, "Chunk size"),
    ],
    ids=["empty", "second speaker", "unclosed tag", "zero rate", "tiny chunks"],
)
def test_bad_fields_are_refused_naming_the_field(director, text, rate, chunk, field):
    assert error_of(lambda: director.arriving_text(text, rate, chunk)).startswith(field)


def test_an_unknown_voice_is_refused_naming_the_voice_before_any_text_is_read(director):
    feed = director.arriving_text(TEXT, 50, 24)
    settings = TakeSettings(None, {"max_new_tokens": FRAMES}, 1)
    message = error_of(lambda: next(director.speak_as_it_arrives(feed, VoiceChoice(0, "nobody"), settings, 24)))
    assert message.startswith("Speaker 0 voice: no voice 'nobody'") and feed.read == 0


@pytest.mark.slow
def test_audio_starts_before_the_last_word_is_read_and_every_chunk_is_spoken(director):
    feed = director.arriving_text(TEXT, 50, 24)
    settings = TakeSettings(None, {"max_new_tokens": FRAMES}, 3)
    read_at_first_audio, updates = None, []
    for update in director.speak_as_it_arrives(feed, VoiceChoice(0, "A"), settings, 24):
        if update.audio is not None and read_at_first_audio is None:
            read_at_first_audio = feed.read
        updates.append(update)
    assert read_at_first_audio is not None and read_at_first_audio < len(feed.words)
    chunks = updates[-1].chunks
    assert all(isinstance(chunk, ChunkSpoken) and chunk.frames > 0 for chunk in chunks)
    spoken = " ".join(re.sub(r"<\|speaker:\d+\|>", "", chunk.text).strip() for chunk in chunks)
    assert spoken.split() == TEXT.split()  # the chunks are the whole text, in order
    samples, rate = soundfile.read(updates[-1].path, dtype="float32")
    assert rate == 22050 and np.sqrt(np.mean(samples**2)) > 0.01
    assert samples.size == sum(update.audio.size for update in updates if update.audio is not None)
    assert updates[-1].report.startswith(f"**{len(chunks)} chunks**")


@pytest.mark.slow
def test_the_endpoint_streams_the_text_as_it_arrives_and_ends_in_a_wav(demo_url):
    client = gradio_client.Client(demo_url, verbose=False)
    assert "/speak_as_it_arrives" in client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    job = client.submit("Hello there. Good morning to you.", "A", None, "", 50, 16, 4, api_name="/speak_as_it_arrives")
    job.result(timeout=240)
    _, arrived, timeline, path, report = job.outputs()[-1]
    assert arrived.startswith("**6 of 6 words have arrived:**")
    assert timeline.count("\n| ") >= 2 and "no audio" not in timeline
    samples, _ = soundfile.read(path, dtype="float32")
    assert np.sqrt(np.mean(samples**2)) > 0.01 and "chunks**" in report


def test_the_endpoint_refuses_an_empty_text_naming_it(demo_url):
    client = gradio_client.Client(demo_url, verbose=False)
    with pytest.raises(gradio_client.exceptions.AppError, match="^Text: nothing to say"):
        client.predict("", "A", None, "", 4, 60, 1, api_name="/speak_as_it_arrives")
