"""Bad input, at every entry point, is refused with an error naming it, and no file is lost.

The table `CASES` holds one bad input per entry: the CLI (`drama3 say`, `table`, `eval`, run
through `main(argv)`), the processor, `generate()`, the codec loader, the model loader and
drama3-tiny's export. Each case builds its files in a scratch folder; the harness snapshots every
file there (bytes and mtime), runs the case, and checks the error (type, or exit code 2 and
stderr), that its message names the input, and that no file was created, changed or removed.

Below the table: the four ways a user's file used to be lost, each reproduced, and the
training-data rules (a bad record is skipped and reported, a corrupt cache entry is rebuilt).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from codec_helpers import tiny_codec_config
from generation_helpers import prompt
from model_helpers import CODEBOOK_SIZE, tiny_model
from processor_helpers import random_codes, tiny_processor
from transformers_drama3 import Drama3Config, Drama3ForSpeechGeneration
from transformers_drama3.cli import main
from transformers_drama3.codec import Drama3CodecModel
from transformers_drama3.codec.convert import to_fish_speech_state_dict
from transformers_drama3.prompting import Reference, Script
from recipes.drama3_tiny import evaluation
from recipes.drama3_tiny import export as recipe_export

CLI = "cli"  # the case is a `drama3` command: exit code 2, message on stderr
RATE = 44100
FULL_TRANSCRIPT = "This is the whole sentence that the speaker reads out loud in the recording, word for word."


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return Path(tiny_checkpoint[0])


@pytest.fixture(scope="module")
def model():
    return tiny_model()


class Workspace:
    """A scratch folder holding a user's files, and the ways to run the entry points on them."""

    def __init__(self, root: Path, checkpoint: Path, model):
        self.root, self.checkpoint, self.model = root, checkpoint, model
        self.take = self.wav("take.wav", 1.0, seed=1)  # a file the user already has
        self.reference = self.wav("reference.wav", 4.0, seed=2)

    def wav(self, name: str, seconds: float, seed: int = 0) -> Path:
        path = self.root / name
        noise = np.random.default_rng(seed).uniform(-0.3, 0.3, int(seconds * RATE)).astype(np.float32)
        soundfile.write(path, noise, RATE)
        return path

    def say(self, *argv: str, output: Path | None = None, model: bool = True):
        """`drama3 say` on the tiny checkpoint (or the bundled drama3-tiny), writing over the user's take."""
        output = self.take if output is None else output
        extra = ["--model", str(self.checkpoint)] if model else []
        return lambda: cli(["say", "Hello there.", "-o", str(output), "--quiet", "--max-frames", "4", *extra, *argv])

    def copy_checkpoint(self, name: str) -> Path:
        folder = self.root / name
        shutil.copytree(self.checkpoint, folder)
        return folder


def cli(argv: list[str], command=main) -> tuple[int, str]:
    """Exit code and stderr of `drama3 ARGV` (argparse's own errors included), or of another
    command line's `main`."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = command(argv)
        except SystemExit as exit:
            code = exit.code
    return code, stderr.getvalue()


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `root`: relative path -> (mtime in ns, bytes)."""
    return {
        str(path.relative_to(root)): (path.stat().st_mtime_ns, path.read_bytes())
        for path in sorted(root.rglob("*")) if path.is_file() or path.is_symlink()
    }


@pytest.fixture
def workspace(tmp_path, checkpoint, model):
    root = tmp_path / "user"
    root.mkdir()
    return Workspace(root, checkpoint, model)


# ---- the table -------------------------------------------------------------------------------------

CASES: dict = {}


def case(error, *needles):
    """Register a bad input: `build(workspace)` prepares its files and returns the action; the
    action must raise `error` (or, for CLI, exit 2) with every needle in the message."""

    def register(build):
        CASES[build.__name__] = (build, error, needles)
        return build

    return register


# drama3 say: numbers
@case(CLI, "--max-frames 0", "positive")
def say_max_frames_zero(ws):
    return ws.say("--max-frames", "0")


@case(CLI, "--max-frames -3", "positive")
def say_max_frames_negative(ws):
    return ws.say("--max-frames", "-3")


@case(CLI, "--temperature nan", "finite")
def say_temperature_nan(ws):
    return ws.say("--temperature", "nan")


@case(CLI, "--temperature -1.0")
def say_temperature_negative(ws):
    return ws.say("--temperature", "-1")


@case(CLI, "--top-p 0.0", "(0, 1]")
def say_top_p_zero(ws):
    return ws.say("--top-p", "0")


@case(CLI, "--top-p 1.5", "(0, 1]")
def say_top_p_over_one(ws):
    return ws.say("--top-p", "1.5")


@case(CLI, "--regenerate -1")
def say_regenerate_negative(ws):
    return ws.say("--regenerate", "-1")


@case(CLI, "--stream and --regenerate")
def say_stream_with_regenerate(ws):
    return ws.say("--stream", "--regenerate", "2")


@case(CLI, "100000 characters", "--max-chars limit of 4096")
def say_text_over_the_size_cap(ws):
    return lambda: cli(["say", "a" * 100_000, "-o", str(ws.take), "--model", str(ws.checkpoint)])


@case(CLI, "--max-chars 0")
def say_max_chars_zero(ws):
    return ws.say("--max-chars", "0")


# drama3 say: the output file
@case(CLI, "-o", "out.mp3", ".wav or .flac")
def say_output_of_an_unknown_format(ws):
    return ws.say(output=ws.root / "out.mp3")


@case(CLI, "-o", "no-such-folder", "does not exist")
def say_output_in_a_missing_folder(ws):
    return ws.say(output=ws.root / "no-such-folder" / "out.wav")


@case(CLI, "-o", "is a folder")
def say_output_that_is_a_folder(ws):
    (ws.root / "takes.wav").mkdir()
    return ws.say(output=ws.root / "takes.wav")


@case(CLI, "-o", "not writable")
def say_output_in_a_read_only_folder(ws):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder = ws.root / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    return ws.say(output=folder / "out.wav")


@case(CLI, "-o", "is the --reference", "destroy the recording")
def say_output_is_the_reference(ws):
    return ws.say("--reference", str(ws.reference), "--reference-text", FULL_TRANSCRIPT, output=ws.reference)


@case(CLI, "is the --reference")
def say_streamed_output_is_the_reference(ws):
    return ws.say("--stream", "--reference", str(ws.reference), "--reference-text", FULL_TRANSCRIPT, output=ws.reference)


@case(CLI, "is the --reference")
def say_output_is_a_symlink_to_the_reference(ws):
    link = ws.root / "link.wav"
    link.symlink_to(ws.reference)
    return ws.say("--reference", str(ws.reference), "--reference-text", FULL_TRANSCRIPT, output=link)


@case(CLI, "is the --reference")
def say_output_is_a_hard_link_to_the_reference(ws):
    link = ws.root / "hard.wav"
    os.link(ws.reference, link)
    return ws.say("--reference", str(ws.reference), "--reference-text", FULL_TRANSCRIPT, output=link)


@case(CLI, "is the --reference")
def say_output_is_the_reference_by_another_spelling(ws):
    other = ws.root / "." / ".." / ws.root.name / "reference.wav"
    return ws.say("--reference", str(ws.reference), "--reference-text", FULL_TRANSCRIPT, output=other)


# drama3 say: references, voices, devices, models
@case(CLI, "--reference", "missing.wav", "no such file")
def say_missing_reference(ws):
    return ws.say("--reference", str(ws.root / "missing.wav"), "--reference-text", "words")


@case(CLI, "--reference-text")
def say_reference_without_transcript(ws):
    return ws.say("--reference", str(ws.reference))


@case(CLI, "--reference-speaker -1")
def say_negative_reference_speaker(ws):
    return ws.say("--reference", str(ws.reference), "--reference-text", FULL_TRANSCRIPT, "--reference-speaker", "-1")


# the bundled drama3-tiny (a real frame rate; the tiny checkpoint's codec makes ~1400 frames a second)
@case(CLI, "references[0].audio", "transcript")
def say_reference_of_one_millisecond(ws):
    clip = ws.wav("blip.wav", 0.001, seed=3)
    return ws.say("--reference", str(clip), "--reference-text", FULL_TRANSCRIPT, model=False)


@case(CLI, "references[0].audio", "transcript")
def say_reference_cut_to_a_tenth(ws):
    cut = ws.root / "cut.wav"
    samples, rate = soundfile.read(ws.reference, dtype="float32")
    soundfile.write(cut, samples[: len(samples) // 10], rate)
    long_transcript = " ".join([FULL_TRANSCRIPT] * 2)  # ~8 s of words for a 0.4 s clip
    return ws.say("--reference", str(cut), "--reference-text", long_transcript, model=False)


@case(CLI, "--voice Z", "not bundled")
def say_unknown_bundled_voice(ws):
    return ws.say("--voice", "Z", model=False)


@case(CLI, "--voice")
def say_bundled_voice_with_a_model(ws):
    return ws.say("--voice", "A")


@case(CLI, "--device gpu0", "not a device")
def say_malformed_device(ws):
    return ws.say("--device", "gpu0")


@case(CLI, "--device cuda", "no CUDA")
def say_cuda_without_cuda(ws):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    return ws.say("--device", "cuda")


@case(CLI, "--dtype", "float33")
def say_dtype_typo(ws):
    return ws.say("--dtype", "float33")


@case(CLI, "--model", "config.json")
def say_model_folder_without_config(ws):
    (ws.root / "empty-model").mkdir()
    return ws.say("--model", str(ws.root / "empty-model"), model=False)


@case(CLI, "model.safetensors", "incomplete", "download it again")
def say_model_with_truncated_weights(ws):
    folder = ws.copy_checkpoint("truncated")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return ws.say("--model", str(folder), model=False)


@case(CLI, "config.json", "no text_config")
def say_model_config_without_text_config(ws):
    folder = ws.copy_checkpoint("no-text-config")
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return ws.say("--model", str(folder), model=False)


@case(CLI, "speaker")
def say_text_with_a_speaker_out_of_range(ws):
    return lambda: cli(["say", "<|speaker:99|> Hello.", "-o", str(ws.take), "--model", str(ws.checkpoint), "--quiet"])


# drama3 table / eval
@case(CLI, "--config", "broken.json", "not valid JSON")
def table_config_with_broken_json(ws):
    (ws.root / "broken.json").write_text('{"text_config": {"hidden_size": 64,')
    return lambda: cli(["table", "--config", str(ws.root / "broken.json")])


@case(CLI, "--config", "no text_config")
def table_config_without_text_config(ws):
    (ws.root / "partial.json").write_text(json.dumps({"model_type": "fish_omni"}))
    return lambda: cli(["table", "--config", str(ws.root / "partial.json")])


@case(CLI, "--config", "no such file")
def table_missing_config(ws):
    return lambda: cli(["table", "--config", str(ws.root / "nowhere.json")])


@case(CLI, "--corpus", "no manifest.jsonl")
def eval_missing_corpus(ws):
    return lambda: cli(["--model", str(ws.checkpoint), "--corpus", str(ws.root / "no-corpus")], evaluation.main)


@case(CLI, "--json", "does not exist")
def eval_json_in_a_missing_folder(ws):
    corpus = ws.root / "corpus"
    corpus.mkdir()
    (corpus / "manifest.jsonl").write_text("")
    return lambda: cli(["--model", str(ws.checkpoint), "--corpus", str(corpus), "--json", str(ws.root / "x" / "e.json")],
                       evaluation.main)


# the processor
@case(ValueError, "reference", "int16", "16-bit PCM")
def processor_int16_pcm_reference(ws):
    pcm = (np.random.default_rng(0).uniform(-0.3, 0.3, 8000) * 32767).astype(np.int16)
    return lambda: tiny_processor()("Hi.", reference_audio=pcm, reference_text="words")


@case(ValueError, "references[0].audio", "transcript")
def processor_reference_codes_far_too_short(ws):
    return lambda: tiny_processor(min_reference_fraction=0.2)("Hi.", reference_audio=random_codes(1), reference_text=FULL_TRANSCRIPT)


@case(ValueError, "references[0].audio", "[0, 4096)")
def processor_reference_codes_out_of_range(ws):
    codes = random_codes(30)
    codes[3, 2] = 5000
    return lambda: tiny_processor()("Hi.", reference_audio=codes, reference_text="words")


@case(ValueError, "reference_audio/reference_text", "transcripts")
def processor_references_without_transcripts(ws):
    return lambda: tiny_processor()("Hi.", reference_audio=[random_codes(30), random_codes(30)], reference_text=["one"])


@case(ValueError, "path", ".wav or .flac")
def processor_save_audio_to_an_unknown_format(ws):
    return lambda: tiny_processor().save_audio(torch.zeros(100), ws.root / "take.mp3")


@case(ValueError, "audio", "one waveform")
def processor_save_audio_of_a_batch(ws):
    return lambda: tiny_processor().save_audio(torch.zeros(2, 100), ws.take)


# generate()
def generate_call(ws, **kwargs):
    input_ids, audio_codes = prompt(0)
    arguments = dict(input_ids=input_ids, audio_codes=audio_codes, max_new_tokens=2, seed=0)
    arguments.update(kwargs)
    return lambda: ws.model.generate(**arguments)


@case(ValueError, "max_new_tokens=0", "positive")
def generate_max_new_tokens_zero(ws):
    return generate_call(ws, max_new_tokens=0)


@case(ValueError, "max_new_tokens=-4")
def generate_max_new_tokens_negative(ws):
    return generate_call(ws, max_new_tokens=-4)


@case(ValueError, "temperature=nan", "finite")
def generate_temperature_nan(ws):
    return generate_call(ws, temperature=math.nan)


@case(ValueError, "temperature=-0.5")
def generate_temperature_negative(ws):
    return generate_call(ws, temperature=-0.5)


@case(ValueError, "top_p=0", "(0, 1]")
def generate_top_p_zero(ws):
    return generate_call(ws, top_p=0.0)


@case(ValueError, "regenerate_on_anomaly=-1")
def generate_regenerate_negative(ws):
    return generate_call(ws, regenerate_on_anomaly=-1)


@case(ValueError, "input_ids", "[0, 104)", "vocabulary")
def generate_input_ids_over_the_vocabulary(ws):
    input_ids, audio_codes = prompt(0)
    input_ids[2] = 10_000
    return generate_call(ws, input_ids=input_ids, audio_codes=audio_codes)


@case(ValueError, "input_ids", "-1")
def generate_negative_input_ids(ws):
    input_ids, audio_codes = prompt(0)
    input_ids[0] = -1
    return generate_call(ws, input_ids=input_ids, audio_codes=audio_codes)


@case(ValueError, "audio_codes", f"[0, {CODEBOOK_SIZE})", "codebook")
def generate_audio_codes_out_of_range(ws):
    input_ids, audio_codes = prompt(0)
    audio_codes[6, 3] = CODEBOOK_SIZE + 7
    return generate_call(ws, input_ids=input_ids, audio_codes=audio_codes)


@case(ValueError, "attention_mask", "1 real row")
def generate_prompt_of_one_real_row(ws):
    input_ids, audio_codes = prompt(0)
    mask = torch.zeros_like(input_ids)
    mask[-1] = 1
    return generate_call(ws, input_ids=input_ids, audio_codes=audio_codes, attention_mask=mask)


@case(ValueError, "expected_seconds")
def generate_expected_seconds_nan(ws):
    return generate_call(ws, expected_seconds=math.nan)


@case(ValueError, "unknown arguments", "max_frames")
def generate_misspelt_argument(ws):
    return generate_call(ws, max_frames=3)


# loaders: the model, its config, the codec
@case(ValueError, "model.safetensors", "incomplete", "download it again")
def load_model_with_truncated_weights(ws):
    folder = ws.copy_checkpoint("truncated")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return lambda: Drama3ForSpeechGeneration.from_pretrained(folder)


@case(ValueError, "model.safetensors", "incomplete")
def load_model_with_weights_cut_inside_the_header(ws):
    folder = ws.copy_checkpoint("header-cut")
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:5])
    return lambda: Drama3ForSpeechGeneration.from_pretrained(folder)


@case(ValueError, "config.json", "no text_config")
def load_config_without_text_config(ws):
    folder = ws.copy_checkpoint("no-text-config")
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return lambda: Drama3ForSpeechGeneration.from_pretrained(folder)


@case(ValueError, "dtype='float33'")
def load_model_with_a_dtype_typo(ws):
    return lambda: Drama3ForSpeechGeneration.from_pretrained(ws.checkpoint, dtype="float33")


@case(ValueError, "config dtype='float33'", "config.json")
def load_model_whose_config_has_a_dtype_typo(ws):
    folder = ws.copy_checkpoint("dtype-typo")
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "float33"
    (folder / "config.json").write_text(json.dumps(config))
    return lambda: Drama3ForSpeechGeneration.from_pretrained(folder)


@case(ValueError, "text_config.torch_dtype='bfloat61'")
def config_whose_text_config_has_a_dtype_typo(ws):
    config = ws.model.config.to_dict()
    config["text_config"]["torch_dtype"] = "bfloat61"
    return lambda: Drama3Config(**config)


# the model's forward
@case(ValueError, "input_ids holds values in", "text vocabulary")
def forward_with_ids_beyond_the_vocabulary(ws):
    vocabulary = ws.model.config.text_config.vocab_size
    return lambda: ws.model(torch.tensor([[1, 2, vocabulary + 5]]))


@case(ValueError, "labels has shape (1, 2)", "(1, 3)")
def forward_with_labels_of_the_wrong_shape(ws):
    return lambda: ws.model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2]]))


@case(ValueError, "audio_codes holds values in", "codebook size")
def forward_with_codes_beyond_the_codebook(ws):
    codes = torch.zeros(1, 3, ws.model.config.num_codebooks, dtype=torch.long)
    codes[0, 1, 2] = ws.model.config.codebook_size
    return lambda: ws.model(torch.tensor([[1, 2, 3]]), audio_codes=codes)


@case(ValueError, "bad.json", "not valid JSON")
def config_file_with_broken_json(ws):
    (ws.root / "bad.json").write_text("{ not json")
    return lambda: Drama3Config.from_json_file(ws.root / "bad.json")


@case(ValueError, "junk.pth", "not a PyTorch checkpoint")
def codec_checkpoint_that_is_not_a_checkpoint(ws):
    (ws.root / "junk.pth").write_bytes(b"these bytes are no checkpoint" * 20)
    return lambda: Drama3CodecModel.from_pretrained(ws.root / "junk.pth", config=tiny_codec_config())


@case(ValueError, "unsafe.pth", "never unpickled")
def codec_checkpoint_holding_code(ws):
    torch.save({"weight": torch.zeros(2), "hook": shutil.rmtree}, ws.root / "unsafe.pth")
    return lambda: Drama3CodecModel.from_pretrained(ws.root / "unsafe.pth", config=tiny_codec_config())


@case(FileNotFoundError, "missing/codec.pth", "no such codec file")
def codec_checkpoint_that_is_missing(ws):
    return lambda: Drama3CodecModel.from_pretrained(ws.root / "missing" / "codec.pth")


@case(FileNotFoundError, "no-codec-folder", "no such codec")
def codec_folder_that_is_missing(ws):
    return lambda: Drama3CodecModel.from_pretrained(str(ws.root / "no-codec-folder"))


# drama3-tiny's export
@case(ValueError, "no-run", "config.json")
def export_from_a_missing_run(ws):
    destination = ws.root / "package"
    destination.mkdir()
    (destination / "model.safetensors").write_bytes(b"the user's model")
    return lambda: recipe_export.export(ws.root / "no-run", ws.root, destination)


def cli_export(argv):
    return cli(argv, lambda argv: recipe_export.main(argv) or 0)


def test_the_table_covers_every_entry_point_with_at_least_forty_cases():
    assert len(CASES) >= 40
    prefixes = {name.split("_")[0] for name in CASES}
    assert {"say", "table", "eval", "processor", "generate", "load", "config", "codec", "export", "forward"} <= prefixes


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused_naming_it_and_no_file_changes(name, workspace):
    build, error, needles = CASES[name]
    action = build(workspace)
    before = snapshot(workspace.root)
    if error == CLI:
        code, message = action()
        assert code == 2, message
    else:
        with pytest.raises(error) as raised:
            action()
        message = str(raised.value)
    for needle in needles:
        assert needle in message, message
    assert "Traceback" not in message
    assert snapshot(workspace.root) == before


# ---- the four ways a file used to be lost ------------------------------------------------------------


def test_a_refused_streamed_take_leaves_the_existing_file_and_creates_none(workspace):
    before = snapshot(workspace.root)
    code, message = cli(["say", "<|speaker:99|> Hello.", "-o", str(workspace.take), "--stream", "--quiet",
                         "--model", str(workspace.checkpoint)])
    assert code == 2 and "speaker" in message
    code, _ = cli(["say", "<|speaker:99|> Hello.", "-o", str(workspace.root / "new.wav"), "--stream", "--quiet",
                   "--model", str(workspace.checkpoint)])
    assert code == 2
    assert snapshot(workspace.root) == before


@pytest.mark.parametrize("stream", [False, True], ids=["offline", "streamed"])
def test_the_output_is_never_written_over_a_reference(workspace, stream):
    before = snapshot(workspace.root)
    code, message = cli(["say", "Hello.", "-o", str(workspace.reference), "--reference", str(workspace.reference),
                         "--reference-text", FULL_TRANSCRIPT, "--model", str(workspace.checkpoint), "--quiet",
                         "--max-frames", "4", *(["--stream"] if stream else [])])
    assert code == 2 and "--reference" in message
    assert snapshot(workspace.root) == before


def failing_write(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("stream", [False, True], ids=["offline", "streamed"])
def test_a_failed_write_leaves_the_existing_file_whole(workspace, monkeypatch, stream):
    before = snapshot(workspace.root)
    monkeypatch.setattr(soundfile.SoundFile, "write", failing_write)
    code, message = cli(["say", "Hello there.", "-o", str(workspace.take), "--model", str(workspace.checkpoint),
                         "--quiet", "--max-frames", "4", "--seed", "0", *(["--stream"] if stream else [])])
    assert code == 2 and "-o" in message and "No space left" in message
    assert snapshot(workspace.root) == before


def test_save_audio_that_fails_leaves_the_existing_file_whole(workspace, monkeypatch):
    before = snapshot(workspace.root)
    monkeypatch.setattr(soundfile.SoundFile, "write", failing_write)
    with pytest.raises(OSError, match="No space left"):
        tiny_processor().save_audio(torch.zeros(1000), workspace.take)
    assert snapshot(workspace.root) == before


def test_export_checks_its_source_before_touching_the_destination(workspace):
    destination = workspace.root / "package"
    destination.mkdir()
    (destination / "model.safetensors").write_bytes(b"the bundled model")
    before = snapshot(workspace.root)
    with pytest.raises(ValueError, match="no config.json"):
        recipe_export.export(workspace.root / "typo-run" / "model", workspace.root, destination)
    assert snapshot(workspace.root) == before


def test_export_refuses_the_installed_model_folder_without_force(workspace, monkeypatch):
    package = workspace.copy_checkpoint("installed")  # stands in for the installed package's folder
    monkeypatch.setattr(recipe_export, "TINY_MODEL_PATH", str(package))
    before = snapshot(workspace.root)
    with pytest.raises(ValueError, match="installed with the package"):
        recipe_export.export(workspace.checkpoint, workspace.root, package)
    code, message = cli_export([str(workspace.root / "typo"), "--corpus", str(workspace.root)])
    assert code == 2 and "--to" in message
    assert snapshot(workspace.root) == before


# ---- what still works ---------------------------------------------------------------------------------


def test_a_successful_take_replaces_the_file_and_leaves_no_temporary(workspace):
    old = workspace.take.read_bytes()
    os.chmod(workspace.take, 0o640)
    code, message = cli(["say", "Hello there.", "-o", str(workspace.take), "--model", str(workspace.checkpoint),
                         "--quiet", "--max-frames", "4", "--seed", "0"])
    assert code == 0, message
    assert workspace.take.read_bytes() != old and soundfile.info(workspace.take).samplerate == RATE
    assert workspace.take.stat().st_mode & 0o777 == 0o640  # the file keeps its permissions
    assert sorted(p.name for p in workspace.root.iterdir()) == ["reference.wav", "take.wav"]


def test_a_legacy_format_codec_checkpoint_loads_like_the_zip_format(tmp_path):
    codec = Drama3CodecModel(tiny_codec_config()).eval()
    state = to_fish_speech_state_dict(codec)
    torch.save(state, tmp_path / "zip.pth")
    torch.save(state, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    modern = Drama3CodecModel.from_pretrained(tmp_path / "zip.pth", config=tiny_codec_config())
    legacy = Drama3CodecModel.from_pretrained(tmp_path / "legacy.pth", config=tiny_codec_config())
    for (name, a), b in zip(modern.state_dict().items(), legacy.state_dict().values()):
        assert torch.equal(a, b), name  # the same saved bytes, read two ways


def test_a_reference_long_enough_for_its_transcript_is_accepted():
    processor = tiny_processor(min_reference_fraction=0.2)
    codes = random_codes(int(4 * processor.frame_rate))  # 4 s for ~1 s of words
    batch = processor(Script("Hi.", references=[Reference("A few words here.", codes)]))
    assert int(batch["attention_mask"].sum()) > codes.shape[1]


def test_int16_codes_that_are_codes_still_count_as_codes():
    codes = random_codes(5).to(torch.int16)
    assert tiny_processor()("Hi.", reference_audio=codes, reference_text="words")["input_ids"].shape[0] == 1


# ---- training data ------------------------------------------------------------------------------------


def voice_folder(root: Path) -> Path:
    folder = root / "voice"
    folder.mkdir()
    for index, seconds in enumerate((1.0, 1.2)):
        tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(int(seconds * 16000)) / 16000)
        soundfile.write(folder / f"clip{index}.wav", tone.astype(np.float32), 16000)
        (folder / f"clip{index}.txt").write_text("two words", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def codec():
    return Drama3CodecModel(tiny_codec_config()).eval()


def test_a_transcript_that_is_not_utf8_is_skipped_and_reported(tmp_path, codec):
    from transformers_drama3.training import load_speech_records, prepare_dataset

    folder = voice_folder(tmp_path)
    (folder / "clip1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    records = load_speech_records(folder)  # used to raise UnicodeDecodeError for the whole folder
    dataset, report = prepare_dataset(records, codec, tmp_path / "cache", progress=False)
    assert report.kept == 1 == len(dataset)
    assert report.reasons == {"unreadable transcript": 1}
    assert "clip1.wav" in report.summary()


def test_a_transcript_far_too_long_for_its_audio_is_skipped_and_reported(tmp_path, codec):
    from transformers_drama3.training import load_speech_records, prepare_dataset

    folder = voice_folder(tmp_path)
    (folder / "clip0.txt").write_text(" ".join(["word"] * 300), encoding="utf-8")  # 300 words in 1 s
    dataset, report = prepare_dataset(load_speech_records(folder), codec, tmp_path / "cache", progress=False)
    assert report.kept == 1 and report.reasons == {"transcript too long for the audio": 1}
    assert "120.0 s" in report.skipped[0].detail


def test_a_corrupt_cache_entry_is_encoded_again(tmp_path, codec):
    from transformers_drama3.training import load_speech_records, prepare_dataset

    records = load_speech_records(voice_folder(tmp_path))
    first, _ = prepare_dataset(records, codec, tmp_path / "cache", progress=False)
    entries = sorted((tmp_path / "cache").glob("*.npy"))
    entries[0].write_bytes(b"\x93NUMPY garbage")  # a half-written or damaged file
    entries[1].write_bytes(np.zeros((3, 2), dtype=np.float32).tobytes())
    second, report = prepare_dataset(records, codec, tmp_path / "cache", progress=False)
    assert report.kept == 2 and report.from_cache == 0
    assert second["codes"] == first["codes"]
    third, report = prepare_dataset(records, codec, tmp_path / "cache", progress=False)
    assert report.from_cache == 2 and third["codes"] == first["codes"]


def test_writing_through_a_symlink_replaces_the_file_it_names_and_keeps_the_link(tmp_path):
    from transformers_drama3.output_files import atomic_output

    target, link = tmp_path / "real.txt", tmp_path / "link.txt"
    target.write_text("old")
    link.symlink_to(target)
    with atomic_output(link) as temporary:
        Path(temporary).write_text("new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.txt", "real.txt"]
