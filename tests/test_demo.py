"""The demo's logic without a browser: page fields -> checked engine requests, errors that name the
field (as gr.Error, before any work), a take spoken turn by turn and its revision."""

import sys
import types

import numpy as np
import pytest
import soundfile
import torch

gr = pytest.importorskip("gradio")

from transformers_drama3.serving.app import SpeechService  # noqa: E402
from transformers_drama3.serving.demo import (  # noqa: E402
    OWN_CLIP,
    SPEAKERS,
    Backend,
    Director,
    VoiceChoice,
    build_demo,
    gpu_call,
    on_zero_gpu,
)
from transformers_drama3.prompting import Script  # noqa: E402
from transformers_drama3.serving.app import driven_events  # noqa: E402
from transformers_drama3.serving.audio_formats import int16_samples  # noqa: E402
from transformers_drama3.serving.engine import DoneEvent, Drama3Engine, FramesEvent  # noqa: E402
from transformers_drama3.tiny import shipped  # noqa: E402

FRAMES = 16  # frame cap per request: enough to hear, cheap on a CPU


@pytest.fixture(scope="module")
def director(demo_backend):
    return Director(demo_backend)


def bundled(*voices):
    return [VoiceChoice(speaker, voice) for speaker, voice in enumerate(voices)]


def own_clip(speaker, samples, rate, transcript):
    return VoiceChoice(speaker, OWN_CLIP, (rate, samples), transcript)


def voice_a_clip():
    path, words = shipped.reference_voice("A")
    samples, rate = soundfile.read(path, dtype="int16")
    return samples, rate, words


def error_of(call) -> str:
    with pytest.raises(gr.Error) as raised:
        call()
    return raised.value.message


def test_an_empty_script_is_refused_naming_the_script(director):
    assert error_of(lambda: director.script("  \n", "", bundled("A"))).startswith("Script: nothing to say")


def test_a_speaker_beyond_the_voice_panel_is_refused_naming_the_script(director):
    message = error_of(lambda: director.script("<|speaker:7|> Hi.", "", bundled(*"ABDF")))
    assert message.startswith("Script: speaker 7 has no voice")


def test_a_speaker_without_a_voice_is_refused_naming_its_voice_field(director):
    voices = [VoiceChoice(0, "A"), VoiceChoice(1, None)]
    message = error_of(lambda: director.script("<|speaker:0|> Hi. <|speaker:1|> Hello.", "", voices))
    assert message.startswith("Speaker 1 voice:")


def test_an_unknown_voice_is_refused_naming_its_field(director):
    assert error_of(lambda: director.script("Hi.", "", bundled("Z"))).startswith("Speaker 0 voice: no voice 'Z'")


def test_an_own_voice_without_a_clip_or_transcript_is_refused_naming_the_missing_field(director):
    assert error_of(lambda: director.script("Hi.", "", [VoiceChoice(0, OWN_CLIP)])).startswith("Speaker 0 clip:")
    samples, rate, _ = voice_a_clip()
    message = error_of(lambda: director.script("Hi.", "", [own_clip(0, samples, rate, " ")]))
    assert message.startswith("Speaker 0 transcript:")


def test_a_silent_clip_is_refused_naming_the_speakers_clip(director):
    silence = np.zeros(22050 * 2, dtype=np.int16)
    message = error_of(lambda: director.script("Hi.", "", [own_clip(0, silence, 22050, "Hello there.")]))
    assert message.startswith("Speaker 0 clip.audio:") and "silent" in message


def test_a_clip_far_too_short_for_its_transcript_is_refused_naming_the_speakers_clip(director):
    samples, rate, words = voice_a_clip()
    short = samples[: rate // 10]  # a tenth of a second for a whole sentence
    message = error_of(lambda: director.script("Hi.", "", [own_clip(0, short, rate, words)]))
    assert message.startswith("Speaker 0 clip.audio:") and "transcript" in message


def test_a_malformed_tag_is_refused_naming_the_script(director):
    assert error_of(lambda: director.script("Hi <whisper>there.", "", bundled("A"))).startswith("Script")


def test_brackets_in_the_directors_note_are_refused_naming_the_note(director):
    assert error_of(lambda: director.script("Hi.", "a [b]", bundled("A"))).startswith("Director's note")


def test_bad_sampling_numbers_are_refused_naming_their_field(director):
    assert error_of(lambda: director.settings("model default", temperature=-1)).startswith("Temperature")
    assert error_of(lambda: director.settings("model default", top_p=1.5)).startswith("Top-p")
    assert error_of(lambda: director.settings("model default", seed=-3)).startswith("Seed")
    assert error_of(lambda: director.settings("loud")).startswith("Preset")


def test_empty_fields_leave_sampling_to_the_preset_and_no_seed_draws_one(director):
    settings = director.settings("paper evaluation", seed=None, temperature=None, top_p="", top_k=None)
    assert settings.preset == "paper-eval"
    assert settings.options == {}
    assert 0 <= settings.seed < 2**31


def test_a_field_set_to_zero_is_a_value_as_in_every_other_door(director):
    settings = director.settings("model default", temperature=0, top_k=0.0)  # greedy; no top-k (a field gives 0.0)
    assert settings.options == {"temperature": 0, "top_k": 0}


def test_each_speakers_voice_clones_that_speaker(director):
    script = director.script("<|speaker:0|> Hi. <|speaker:1|> Hello.", "", bundled("A", "B"))
    voices = director.service.voices
    assert [reference.speaker for reference in script.references] == [0, 1]
    assert torch.equal(script.references[1].audio.codes, voices.references("B")[0].audio)


def test_the_directors_note_goes_before_every_line(director):
    script = director.script("<|speaker:0|> Hi. <|speaker:1|> Hello.", "hushed", bundled("A", "B"))
    assert [line.note for line in script.lines] == ["hushed", "hushed"]


def test_drama3_tiny_speaks_a_scene_one_request_per_speaker_turn(director):
    voices = bundled("A", "B")
    script = director.script("<|speaker:0|> Hi. <|speaker:1|> Hello. <|speaker:0|> Bye.", "", voices)
    requests = director.scene_requests(script, voices)
    assert [item.speaker for item in requests] == [0, 1, 0]
    assert [item.prefix for item in requests] == ["A", "B", "A"]
    assert all({reference.speaker for reference in item.request.references} == {0} for item in requests)


def test_revising_before_any_take_is_refused_naming_the_revision_note(director):
    assert error_of(lambda: director.revision_requests(None, "slower")).startswith("Revision note: there is no take")


@pytest.mark.slow
def test_a_take_streams_its_audio_and_its_revision_keeps_each_turns_take_in_context(director):
    voices = bundled("A", "B")
    script = director.script("<|speaker:0|> Good morning. <|speaker:1|> Hello there.", "", voices)
    settings = director.settings("model default", seed=3, max_new_tokens=FRAMES)
    updates = list(director.speak(director.scene_requests(script, voices), settings, 1))
    streamed = np.concatenate([update.audio for update in updates if update.audio is not None])
    last = updates[-1]
    saved, rate = soundfile.read(last.path, dtype="int16")
    assert rate == director.service.processor.sampling_rate
    np.testing.assert_array_equal(saved, int16_samples(streamed))  # the file holds what streamed
    take = last.take
    assert [item.speaker for item in take.requests] == [0, 1]
    assert all(0 < item.codes.shape[0] <= FRAMES for item in take.requests)

    revised = director.revision_requests(take, "slower, more tired")
    for before, after in zip(take.requests, revised):
        assert after.request.instruction == "slower, more tired"
        assert torch.equal(after.request.history[-1].audio.codes, before.codes.T)
    second = list(director.speak(revised, settings, take.number + 1))[-1]
    assert second.take.number == 2 and "**Take 2**" in second.report
    assert all(0 < item.codes.shape[0] <= FRAMES for item in second.take.requests)


def work(value):
    return value + 1


def test_gpu_work_runs_unchanged_without_the_spaces_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "spaces", None)  # importing it raises ImportError
    assert gpu_call(work) is work


def test_gpu_work_is_wrapped_with_spaces_gpu_where_that_package_is_installed(monkeypatch):
    wrapped = []

    def gpu(duration):
        return lambda function: wrapped.append((function, duration)) or (lambda value: function(value) * 10)

    monkeypatch.setitem(sys.modules, "spaces", types.SimpleNamespace(GPU=gpu))
    assert gpu_call(work)(1) == 20 and wrapped[0][0] is work


def test_a_folder_named_spaces_is_not_the_spaces_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "spaces", types.ModuleType("spaces"))  # no GPU attribute
    assert gpu_call(work) is work


def test_the_engine_is_stepped_by_the_caller_only_on_zero_gpu_hardware(monkeypatch):
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert not on_zero_gpu()
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    assert on_zero_gpu()


def test_the_voice_panel_offers_every_bundled_voice(director):
    assert director.voice_names == shipped.voices() and SPEAKERS >= 2


@pytest.mark.slow
def test_a_caller_stepping_an_engine_without_its_thread_gets_the_take_the_thread_gives(demo_backend):
    service = demo_backend.service
    references = service.voices.references("A")
    job = service.job_of_rows(service.processor(Script("Good morning.", references)), None, {"seed": 4, "max_new_tokens": 12})
    expected = service.engine.submit(job).result(timeout=120)
    stepped = Drama3Engine(service.model, max_batch=2)  # never started: driven_events steps it
    events = list(driven_events(stepped, stepped.submit(job)))
    assert isinstance(events[-1], DoneEvent) and all(isinstance(event, FramesEvent) for event in events[:-1])
    assert torch.equal(events[-1].codes, expected.codes)
    assert torch.equal(torch.cat([event.frames for event in events[:-1]]), expected.codes)


def test_a_model_without_bundled_voices_gets_a_page_of_own_clips_and_plain_examples(tiny_checkpoint, tmp_path):
    folder, _, _ = tiny_checkpoint
    service = SpeechService.load(folder, str(tmp_path / "voices"), max_batch=1)
    try:
        demo = build_demo(Backend(service))
        pickers = [block for block in demo.blocks.values() if isinstance(block, gr.Dropdown)]
        assert len(pickers) == SPEAKERS + 1  # a voice per speaker, and the "Speak as it arrives" tab's voice
        assert all(picker.value == OWN_CLIP for picker in pickers)
        (examples,) = [block for block in demo.blocks.values() if isinstance(block, gr.Dataset)]
        assert all(len(sample) == 2 for sample in examples.samples)  # script and note, no bundled voice
    finally:
        service.engine.stop()


def test_an_own_clip_clones_its_speaker_as_the_same_bundled_clip_does(director):
    samples, rate, words = voice_a_clip()  # int16, as gradio hands over an upload or a recording
    own = director.script("<|speaker:1|> Hi.", "", [VoiceChoice(0, "B"), own_clip(1, samples, rate, words)])
    (reference,) = own.references
    assert reference.speaker == 1 and reference.transcript == words
    bundled_codes = director.service.voices.references("A")[0].audio
    assert torch.equal(reference.audio.codes, bundled_codes)
