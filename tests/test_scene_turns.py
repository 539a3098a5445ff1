"""Scenes spoken turn by turn: each speaker turn (a run of one speaker's lines) is its own
single-speaker cloning request, so drama3-tiny, trained only on such requests, can speak a scene."""

import importlib.util

import pytest
import soundfile
import torch

from generation_helpers import RecordingStreamer
from transformers_drama3.runtime.long_form import generate_long_form, resolve_scene_mode
from transformers_drama3.prompting import Line, Reference, Script, speaker_turns
from transformers_drama3.tiny import shipped

pytestmark = pytest.mark.skipif(not shipped.is_available(), reason="this checkout carries no drama3-tiny weights")
needs_resemblyzer = pytest.mark.skipif(importlib.util.find_spec("resemblyzer") is None, reason="resemblyzer not installed")

SCENE = (
    "<|speaker:0|>The cat sat on the mat.<|speaker:0|>It was warm."
    "<|speaker:1|>Where is the dog?<|speaker:1|>It ran away."
    "<|speaker:0|>Then let us find it.<|speaker:0|>Come with me."
)
SCENE_VOICES = ("A", "B")  # speaker i clones bundled voice i


def bundled_reference(voice: str, speaker: int) -> Reference:
    audio, transcript = shipped.reference_voice(voice)
    return Reference(transcript, audio, speaker)


SCENE_REFERENCES = tuple(bundled_reference(voice, speaker) for speaker, voice in enumerate(SCENE_VOICES))


@pytest.fixture(scope="module")
def tiny(bundled_tiny):
    """drama3-tiny, on 1 CPU thread for this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield bundled_tiny
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def scene(tiny):
    """The scene spoken with drama3-tiny's default scene mode (its generation config: turns)."""
    model, processor = tiny
    return generate_long_form(model, processor, SCENE, references=SCENE_REFERENCES, seed=0, progress=False)


def test_speaker_turns_keep_each_speakers_own_references_renumbered_to_speaker_0():
    script = Script(SCENE, references=SCENE_REFERENCES)
    turns = speaker_turns(script)
    assert [speaker for speaker, _ in turns] == [0, 1, 0]
    second = turns[1][1]
    assert second.lines == (Line("Where is the dog?", 0), Line("It ran away.", 0))
    assert [reference.speaker for reference in second.references] == [0]
    assert second.references[0].transcript == SCENE_REFERENCES[1].transcript


def test_the_tiny_models_generation_config_chooses_turns(tiny):
    model, _ = tiny
    assert resolve_scene_mode(model, None) == "turns"
    assert resolve_scene_mode(model, "joint") == "joint"
    with pytest.raises(ValueError, match="scene='both'"):
        resolve_scene_mode(model, "both")


@pytest.mark.slow
def test_one_speaker_in_turns_mode_gives_the_joint_take(tiny):
    model, processor = tiny
    text = "Good morning to you. The boats are ready."
    references = (bundled_reference("B", 0),)
    joint = generate_long_form(model, processor, text, references=references, seed=5, progress=False, scene="joint")
    turns = generate_long_form(model, processor, text, references=references, seed=5, progress=False, scene="turns")
    assert torch.equal(turns.audio_codes, joint.audio_codes)
    assert joint.turns is None
    assert [(turn.speaker, turn.start, turn.end) for turn in turns.turns] == [(0, 0, joint.audio_codes.shape[0])]


def test_a_two_speaker_scene_is_three_turns_covering_every_frame(scene):
    assert [turn.speaker for turn in scene.turns] == [0, 1, 0]
    assert scene.turns[0].start == 0
    assert all(before.end == after.start for before, after in zip(scene.turns, scene.turns[1:]))
    assert scene.turns[-1].end == scene.audio_codes.shape[0] == sum(scene.chunk_lengths)
    assert all(turn.end > turn.start for turn in scene.turns)
    assert all(turn.finish_reasons == ["eos"] for turn in scene.turns)


@pytest.mark.slow
@needs_resemblyzer
def test_each_turn_has_its_speakers_voice(scene, tiny):
    from recipes.drama3_tiny import instruments as I

    _, processor = tiny
    centroids = {}
    for voice in shipped.voices():
        audio, rate = soundfile.read(shipped.reference_voice(voice)[0])
        centroids[voice] = I.voice_centroid([I.speaker_embedding(audio, rate)])
    frame = processor.samples_per_frame
    heard = []
    for turn in scene.turns:
        segment = scene.audio[turn.start * frame : turn.end * frame].numpy()
        heard.append(I.identify_voice(I.speaker_embedding(segment, scene.sampling_rate), centroids))
    assert heard == [SCENE_VOICES[turn.speaker] for turn in scene.turns]


@pytest.mark.slow
def test_a_streamed_scene_equals_the_offline_scene(tiny, scene):
    model, processor = tiny
    streamer = RecordingStreamer()
    streamed = generate_long_form(
        model, processor, SCENE, references=SCENE_REFERENCES, seed=0, progress=False, streamer=streamer, scene="turns"
    )
    assert torch.equal(streamed.audio_codes, scene.audio_codes)
    assert streamer.ends == 1
    torch.testing.assert_close(torch.cat(streamer.values), scene.audio, rtol=0, atol=1e-4)


def test_a_speaker_without_a_reference_is_refused(tiny):
    model, processor = tiny
    text = SCENE + "<|speaker:2|>And me?"
    with pytest.raises(ValueError, match="speaker 2 has no reference"):
        generate_long_form(model, processor, text, references=SCENE_REFERENCES, progress=False, scene="turns")


def test_a_multi_speaker_script_without_references_is_refused(tiny):
    model, processor = tiny
    with pytest.raises(ValueError, match=r"references: .*speakers \[0, 1\] and no references"):
        generate_long_form(model, processor, SCENE, progress=False, scene="turns")


@pytest.mark.slow
def test_drama3_say_speaks_a_scene_with_one_bundled_voice_per_speaker(tmp_path, capsys):
    from transformers_drama3.cli import main

    text = "<|speaker:0|>Hello there.<|speaker:1|>Hi."
    code = main(["say", text, "-o", str(tmp_path / "scene.wav"), "--voice", "A,B", "--seed", "0", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "2 turn(s)" in captured.out and "A (speaker 0), B (speaker 1)" in captured.err
    audio, rate = soundfile.read(tmp_path / "scene.wav")
    assert rate == 22050 and len(audio) > rate * 0.5


def test_drama3_say_names_an_unknown_voice_in_the_list(tmp_path, capsys):
    from transformers_drama3.cli import main

    code = main(["say", "<|speaker:0|>Hi.<|speaker:1|>Hello.", "-o", str(tmp_path / "x.wav"), "--voice", "A,Z"])
    error = capsys.readouterr().err
    assert code == 2
    assert "--voice Z" in error and "'Z' is not bundled" in error and "Traceback" not in error


@pytest.mark.slow
def test_drama3_say_binds_each_reference_to_its_reference_speaker(tmp_path, capsys):
    from transformers_drama3.cli import main

    text = "<|speaker:0|>Hello there.<|speaker:1|>Hi."
    by_voice = main(["say", text, "-o", str(tmp_path / "voices.wav"), "--voice", "A,B", "--seed", "0", "--quiet"])
    references = []
    for speaker, voice in enumerate(("A", "B")):
        audio, transcript = shipped.reference_voice(voice)
        references += ["--reference", audio, "--reference-text", transcript, "--reference-speaker", str(speaker)]
    by_reference = main(["say", text, "-o", str(tmp_path / "references.wav"), *references, "--seed", "0", "--quiet"])
    captured = capsys.readouterr()
    assert by_voice == by_reference == 0, captured.err
    assert (soundfile.read(tmp_path / "voices.wav")[0] == soundfile.read(tmp_path / "references.wav")[0]).all()


def test_drama3_say_refuses_reference_speakers_that_do_not_match_the_references(tmp_path, capsys):
    from transformers_drama3.cli import main

    audio, transcript = shipped.reference_voice("A")
    one = ["--reference", audio, "--reference-text", transcript]
    code = main(["say", "Hi.", "-o", str(tmp_path / "x.wav"), *one, *one, "--reference-speaker", "1"])
    assert code == 2 and "--reference-speaker given 1 time(s) but --reference 2" in capsys.readouterr().err
    code = main(["say", "Hi.", "-o", str(tmp_path / "x.wav"), *one, "--reference-speaker", "-1"])
    assert code == 2 and "--reference-speaker -1: speakers are numbered from 0" in capsys.readouterr().err
