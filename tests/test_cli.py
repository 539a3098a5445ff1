"""The `drama3 say` command and the quick-start example, run on a tiny checkpoint written by the test."""

import runpy
import sys

import numpy as np
import pytest
import soundfile

from transformers_drama3.cli import build_parser, main


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint[0]


def say(checkpoint, output, *extra):
    return main(["say", "Hello there. How are you?", "-o", str(output), "--model", checkpoint,
                 "--max-frames", "6", "--quiet", *extra])


def test_say_writes_a_wav_file(checkpoint, tmp_path, capsys):
    assert say(checkpoint, tmp_path / "out.wav", "--seed", "0") == 0
    audio, rate = soundfile.read(tmp_path / "out.wav")
    assert rate == 44100 and audio.ndim == 1
    assert "wrote" in capsys.readouterr().out


def test_say_is_reproducible_with_a_seed(checkpoint, tmp_path):
    say(checkpoint, tmp_path / "a.wav", "--seed", "3")
    say(checkpoint, tmp_path / "b.wav", "--seed", "3")
    np.testing.assert_array_equal(soundfile.read(tmp_path / "a.wav")[0], soundfile.read(tmp_path / "b.wav")[0])


def test_say_streaming_writes_the_same_audio(checkpoint, tmp_path, capsys):
    say(checkpoint, tmp_path / "offline.wav", "--seed", "4")
    assert say(checkpoint, tmp_path / "streamed.wav", "--seed", "4", "--stream") == 0
    assert "first audio after" in capsys.readouterr().out
    offline, streamed = soundfile.read(tmp_path / "offline.wav")[0], soundfile.read(tmp_path / "streamed.wav")[0]
    np.testing.assert_allclose(streamed, offline, atol=2 / 32768)  # 16-bit PCM, one step of rounding


def test_say_with_a_reference(checkpoint, tmp_path):
    reference = tmp_path / "reference.wav"
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, 44100 // 4).astype(np.float32)
    soundfile.write(reference, noise, 44100)
    code = say(checkpoint, tmp_path / "cloned.wav", "--reference", str(reference), "--reference-text", "A reference.")
    assert code == 0 and (tmp_path / "cloned.wav").exists()


def test_a_missing_model_gives_a_clear_message(tmp_path, capsys):
    code = main(["say", "hi", "-o", str(tmp_path / "x.wav"), "--model", str(tmp_path / "nowhere")])
    error = capsys.readouterr().err
    assert code == 2
    assert "no Drama 3 model" in error and "huggingface-cli download" in error and "Traceback" not in error


def test_a_reference_without_its_transcript_is_refused(checkpoint, tmp_path, capsys):
    code = main(["say", "hi", "-o", str(tmp_path / "x.wav"), "--model", checkpoint, "--reference", "a.wav"])
    assert code == 2 and "--reference-text" in capsys.readouterr().err


def test_ras_flag_sets_repetition_aware_sampling(tmp_path):
    from transformers_drama3.cli import _check_say_arguments

    def sampling(*extra):
        return _check_say_arguments(build_parser().parse_args(["say", "hi", "-o", str(tmp_path / "x.wav"), *extra]))

    assert "repetition_aware" not in sampling()  # the model's own setting
    assert sampling("--ras", "off")["repetition_aware"] is False
    assert sampling("--ras", "on")["repetition_aware"] is True
    with pytest.raises(SystemExit):
        sampling("--ras", "maybe")


def test_alignment_flag_turns_the_models_phoneme_alignment_off_or_asks_for_it(tmp_path):
    from transformers_drama3.cli import _check_say_arguments

    def sampling(*extra):
        return _check_say_arguments(build_parser().parse_args(["say", "hi", "-o", str(tmp_path / "x.wav"), *extra]))

    assert "phoneme_alignment" not in sampling()  # the model's own table, if it has one
    assert sampling("--alignment", "off")["phoneme_alignment"] is False
    assert sampling("--alignment", "on")["phoneme_alignment"] is True


def test_alignment_on_is_refused_for_a_model_without_a_table(checkpoint, tmp_path, capsys):
    code = main(["say", "hi", "-o", str(tmp_path / "x.wav"), "--model", checkpoint, "--alignment", "on", "--quiet"])
    assert code != 0 and "phoneme_alignment=True" in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists()


def test_say_without_ras_takes_the_models_setting_which_for_this_checkpoint_is_on(checkpoint, tmp_path):
    say(checkpoint, tmp_path / "on.wav", "--seed", "5", "--ras", "on")
    say(checkpoint, tmp_path / "default.wav", "--seed", "5")
    np.testing.assert_array_equal(soundfile.read(tmp_path / "on.wav")[0], soundfile.read(tmp_path / "default.wav")[0])
    assert say(checkpoint, tmp_path / "off.wav", "--seed", "5", "--ras", "off") == 0


def test_subcommands_are_pluggable():
    assert "say" in build_parser()._subparsers._group_actions[0].choices


def test_quickstart_example_runs_on_a_tiny_model(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--model", checkpoint, "-o", str(tmp_path / "q.wav"), "--max-frames", "5"])
    runpy.run_path("examples/quickstart.py", run_name="__main__")
    out = capsys.readouterr().out
    assert "1. generate" in out and "2. pipeline" in out and "3. stream" in out
    assert (tmp_path / "q.wav").exists()


NO_TORCH_CHECK = """
import sys
import drama3_cli
try:
    drama3_cli.main(sys.argv[1:])
except SystemExit as exit:
    print("exit", exit.code)
print("torch imported" if "torch" in sys.modules else "torch not imported")
"""


@pytest.mark.parametrize(
    "argv", [["--help"], ["say", "--help"], ["say"], ["nonsense"], ["demo", "--help"], ["demo", "--port", "x"]],
    ids=["help", "say-help", "say-missing-text", "unknown-command", "demo-help", "demo-bad-port"],
)
def test_help_and_argument_errors_answer_without_importing_torch(argv):
    import subprocess

    result = subprocess.run([sys.executable, "-c", NO_TORCH_CHECK, *argv], capture_output=True, text=True, timeout=120)
    assert "torch not imported" in result.stdout, result.stdout + result.stderr
    expected_exit = "exit 0" if argv[-1] == "--help" else "exit 2"
    assert expected_exit in result.stdout


def test_the_console_script_is_the_light_front():
    from importlib.metadata import entry_points

    (script,) = [entry for entry in entry_points(group="console_scripts") if entry.name == "drama3"]
    assert script.value == "drama3_cli:main"


def test_quiet_says_nothing_but_the_result(checkpoint, tmp_path, capsys):
    assert say(checkpoint, tmp_path / "quiet.wav", "--seed", "0") == 0  # say() passes --quiet
    captured = capsys.readouterr()
    assert "Loading weights" not in captured.err and "speaking" not in captured.err
    assert captured.out.startswith("wrote")


def test_a_speaker_without_a_reference_is_named_in_the_commands_own_flags(tmp_path, capsys):
    code = main(["say", "<|speaker:0|>Hello. <|speaker:1|>Hi there.", "-o", str(tmp_path / "x.wav"), "--voice", "A"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "speaker 1 has no reference" in error and "--voice" in error
    assert "strict_speakers" not in error and "Reference(" not in error and "speaker=" not in error
    assert not (tmp_path / "x.wav").exists()


def test_demo_passes_its_options_to_the_launch(monkeypatch):
    pytest.importorskip("gradio")
    from transformers_drama3.serving import demo

    launched = []
    monkeypatch.setattr(demo, "launch", lambda *args, **kwargs: launched.append((args, kwargs)))
    assert main(["demo", "--model", "some/repo", "--host", "0.0.0.0", "--port", "7999", "--share"]) == 0
    assert launched == [(("some/repo", "0.0.0.0", 7999, True, "auto", 4), {"adapter_specs": []})]


def test_demo_refuses_a_port_below_one_before_loading_anything(capsys):
    assert main(["demo", "--port", "0"]) == 2
    assert "--port 0: expected a positive number" in capsys.readouterr().err
