"""The Whisper instrument and `drama3 eval`: it reads espeak-ng, refuses to read garbled audio,
and measures the bundled drama3-tiny's codec resyntheses and outputs on fixed held-out sentences."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from transformers_drama3.evaluation import asr
from transformers_drama3.evaluation.espeak import ESPEAK_RATE, TINY_VOICES, espeak_available, speak
from transformers_drama3.evaluation.intelligibility import HELDOUT_SENTENCES, check_sentences, check_voices
from transformers_drama3.tiny import shipped

needs_espeak = pytest.mark.skipif(not espeak_available(), reason="espeak-ng not on PATH (CI installs it)")

SAMPLE = HELDOUT_SENTENCES
SAMPLE_VOICES = ("A", "B")
"""`drama3 eval`'s fixed held-out sample: its 12 everyday sentences in each bundled voice."""
ESPEAK_SAMPLE = (HELDOUT_SENTENCES[0], HELDOUT_SENTENCES[9])
ESPEAK_VOICES = ("A", "B", "D", "F")
ORIGINALS_BAR = 0.20
"""Whisper on espeak's own renderings; measured on ESPEAK_SAMPLE x ESPEAK_VOICES: 10.5% (on all
12 sentences: 24.1%, the RP and Caribbean voices D and F the hardest)."""
GARBLED_BAR = 0.80
SEEDS = (0, 100, 200)
"""The outputs are drawn: one seed's 24 takes move the WER by a few points (19.2-19.6% at seeds 0, 100,
200; 36-46% without the alignment, with the decoder before), so the guard pools three seeds."""
RESYNTHESIS_BAR = 0.15
"""The issue's bar on the bundled codec's resyntheses (Whisper WER, pooled over SAMPLE x
SAMPLE_VOICES). Measured 12.9% (A 6.2%, B 19.6%; their originals 11.6% and 19.6%); the decoder
before the everyday-sentence fine-tune read 18.3% on the same machine (B 27.7%)."""
OUTPUTS_BAR = 0.35
"""The issue's bar on the bundled model's outputs (Whisper WER, pooled over SAMPLE x SAMPLE_VOICES
x SEEDS), with its generation config as shipped (phoneme-aligned decoding). Measured 19.3% (A 15.2%,
B 23.5%; seeds 0 / 100 / 200: 19.2%, 19.2%, 19.6%)."""
README_JOB_BAR = 0.50
"""Guard on the README's main job (its sentence, voice A, seeds 0-2 pooled); measured 33.3%: "Below
there, this is the tidy model speaking." / "Below there, this is the tidy mod of speaking." / "Below
there, this is the tidy model speaking."."""
STOP_BAR = 0.95
"""Outputs that end with eos, not at their frame budget. Voice B now and then loses its place in
a sentence and is let go at the budget: 2 of 156 voice-B takes (seeds 300-600 and 700-1200) with
the sampler's earlier per-item torch generators, 4 of 156 with the counter-based numbers, 2 of 36
at SEEDS (voice A: none of 48)."""
DURATION_BOUNDS = (0.6, 1.6)
"""Output duration over espeak's: at least 95% of takes within these bounds (72 takes measured:
0.91-1.67, two above 1.6: one sentence in voice B loses its place and is let go at 1.5x its expected
duration), their median within 10% of espeak's."""


# ---- normalisation (no recogniser) ----------------------------------------------------------------


def test_numbers_are_scored_as_the_words_they_are_read_as():
    assert asr.normalize_text("The train leaves at 7, gate 42.") == ["the", "train", "leaves", "at", "seven", "gate", "forty", "two"]
    assert asr.spoken_number(305) == ["three", "hundred", "five"]
    assert asr.wer("I have 1,200 sheep", "I have one thousand two hundred sheep") == 0


def test_british_and_american_spellings_score_alike():
    assert asr.wer("our neighbors painted the harbor", "Our neighbours painted the harbour") == 0


def test_directions_and_speaker_tags_are_not_words():
    assert asr.normalize_text("(slow) <|speaker:0|>Hello [pause] <whisper>there</whisper>!") == ["hello", "there"]


def test_nothing_to_hear_is_heard_as_nothing_without_loading_the_recogniser():
    asr.whisper_model.cache_clear()
    assert asr.transcribe(np.zeros(0, dtype=np.float32), 16000) == ""
    assert asr.whisper_model.cache_info().currsize == 0


@pytest.mark.parametrize("waveform, rate, message", [
    (np.zeros((2, 100), dtype=np.float32), 16000, r"shape \(2, 100\)"),
    (np.array([0.0, np.nan], dtype=np.float32), 16000, "NaN"),
    (np.zeros(100, dtype=np.float32), 0, "sampling_rate 0"),
])
def test_bad_audio_is_refused_with_its_fault_named(waveform, rate, message):
    with pytest.raises(ValueError, match=message):
        asr.transcribe(waveform, rate)


def test_unknown_voices_and_empty_sentences_are_refused_by_name():
    with pytest.raises(ValueError, match="'Z' has no espeak-ng voice"):
        check_voices(["A", "Z"])
    with pytest.raises(ValueError, match=r"sentence 1 \('\.\.\.'\) holds no words"):
        check_sentences(["Fine.", "..."])


@pytest.mark.slow  # plans drama3-tiny's 24,000-utterance corpus: ~15-50 s
def test_the_heldout_and_development_sentences_are_in_no_training_corpus():
    from recipes.drama3_tiny.corpus import VOICES_BY_NAME, plan_corpus
    from recipes.drama3_tiny.lm_recipe import TINY_CORPUS_PLAN

    plan = {**TINY_CORPUS_PLAN, "voices": [VOICES_BY_NAME[name] for name in TINY_CORPUS_PLAN["voices"]]}
    corpus = {tuple(asr.normalize_text(record.transcript)) for record in plan_corpus(**plan)}
    assert not corpus & {tuple(asr.normalize_text(sentence)) for sentence in HELDOUT_SENTENCES}
    # the recipe's development sentences (its decisions are measured on them, never on the held-out 12)
    development = Path(__file__).resolve().parent.parent / "recipes" / "drama3_tiny" / "dev_sentences.txt"
    sentences = [line.strip() for line in development.read_text(encoding="utf-8").splitlines() if line.strip()]
    normalised = {tuple(asr.normalize_text(sentence)) for sentence in sentences}
    assert len(normalised) == len(sentences) == 36
    assert not normalised & corpus and not normalised & {tuple(asr.normalize_text(s)) for s in HELDOUT_SENTENCES}


def test_the_bundled_voices_are_the_corpus_voices():
    from recipes.drama3_tiny.corpus import VOICES_BY_NAME

    for name, voice in TINY_VOICES.items():
        corpus_voice = VOICES_BY_NAME[name]
        assert voice == (f"{corpus_voice.language}+{corpus_voice.variant}", corpus_voice.pitch, corpus_voice.speed)


# ---- the recogniser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def renderings():
    """espeak-ng's renderings of a sample in every corpus voice: [(sentence, float32 [time] at 22.05 kHz)]."""
    return [(sentence, speak(sentence, TINY_VOICES[voice])) for voice in ESPEAK_VOICES for sentence in ESPEAK_SAMPLE]


@pytest.mark.slow
@needs_espeak
def test_whisper_reads_espeak_renderings_of_heldout_sentences(renderings):
    heard = [(asr.transcribe(audio, ESPEAK_RATE), sentence) for sentence, audio in renderings]
    assert asr.corpus_wer(heard) <= ORIGINALS_BAR, heard


@pytest.mark.slow
@needs_espeak
def test_whisper_does_not_read_the_same_renderings_played_backwards(renderings):
    heard = [(asr.transcribe(audio[::-1].copy(), ESPEAK_RATE), sentence) for sentence, audio in renderings]
    assert asr.corpus_wer(heard) >= GARBLED_BAR, heard


@pytest.mark.slow
@needs_espeak
def test_whisper_does_not_loop_on_the_rendering_that_once_sent_it_into_a_loop():
    """Greedy Whisper heard ~180 words in this 3-second rendering until repeats were blocked."""
    sentence = "The rocket by the fountain was tidy and elegant."
    heard = asr.transcribe(speak(sentence, TINY_VOICES["D"]), ESPEAK_RATE)
    assert len(asr.normalize_text(heard)) <= 2 * len(asr.normalize_text(sentence)), heard


@pytest.mark.slow
def test_whisper_hears_no_sentence_in_noise():
    noise = 0.1 * np.random.default_rng(0).standard_normal(2 * 16000).astype(np.float32)
    assert asr.wer(asr.transcribe(noise, 16000), ESPEAK_SAMPLE[0]) >= GARBLED_BAR


# ---- drama3 eval on the bundled drama3-tiny ------------------------------------------------------------


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory):
    """`drama3 eval` on the sample (every voice speaks every sentence): (exit code, stdout, its JSON)."""
    if not shipped.is_available():
        pytest.skip("this checkout carries no drama3-tiny weights")
    import contextlib
    import io

    from transformers_drama3.cli import main

    folder = tmp_path_factory.mktemp("eval")
    sentences, path = folder / "sentences.txt", folder / "eval.json"
    sentences.write_text("\n".join(SAMPLE) + "\n", encoding="utf-8")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["eval", "--voice", ",".join(SAMPLE_VOICES), "--sentences-file", str(sentences), "--json", str(path),
                     "--seeds", ",".join(map(str, SEEDS)), "--quiet"])
    return code, out.getvalue(), json.loads(path.read_text()) if path.is_file() else None


@pytest.mark.slow
@needs_espeak
def test_drama3_eval_prints_a_wer_table_per_voice(eval_run):
    code, out, report = eval_run
    assert code == 0
    assert "model outputs decoded phoneme-aligned" in out  # drama3-tiny's generation config holds its table
    rows = [line.split(" | ")[0].strip("| ") for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["voice", *SAMPLE_VOICES, "all"]
    assert [(take["text"], take["seed"]) for take in report["takes"]] == [
        (sentence, seed) for _ in SAMPLE_VOICES for sentence in SAMPLE for seed in SEEDS]


@pytest.mark.slow
@needs_espeak
def test_the_bundled_codec_resyntheses_let_the_words_through(eval_run):
    """Resyntheses of the espeak originals through drama3-tiny's codec (encode, decode) are read
    by Whisper at most at RESYNTHESIS_BAR."""
    _, _, report = eval_run
    assert report["overall"]["wer_resyntheses"] <= RESYNTHESIS_BAR, report["overall"]


@pytest.mark.slow
@needs_espeak
def test_the_bundled_model_says_the_words_and_stops_at_a_plausible_length(eval_run, record_property):
    """The outputs (each voice cloned from its bundled clip, SEEDS pooled) are read by Whisper at
    most at OUTPUTS_BAR, and at least STOP_BAR of them stop by themselves, at a length near espeak's."""
    _, _, report = eval_run
    record_property("wer_outputs", report["overall"]["wer_outputs"])
    assert report["overall"]["wer_outputs"] <= OUTPUTS_BAR, report["overall"]
    low, high = DURATION_BOUNDS
    ratios = np.array([take["duration_ratio"] for take in report["takes"]])
    assert np.mean([take["finish"] == "eos" for take in report["takes"]]) >= STOP_BAR, report["overall"]
    assert np.mean((ratios >= low) & (ratios <= high)) >= 0.95 and 0.9 <= np.median(ratios) <= 1.1, sorted(ratios)


def test_drama3_eval_refuses_bad_arguments_before_loading_anything(capsys):
    from transformers_drama3.cli import main

    assert main(["eval", "--voice", "A,Z"]) == 2
    assert "--voice A,Z: voice 'Z'" in capsys.readouterr().err
    assert main(["eval", "--sentences", "13"]) == 2
    assert "--sentences 13: expected 1 to 12" in capsys.readouterr().err
    assert main(["eval", "--sentences", "2", "--sentences-file", "x.txt"]) == 2
    assert "either --sentences or --sentences-file" in capsys.readouterr().err
    assert main(["eval", "--sentences-file", "/nonexistent/s.txt"]) == 2
    assert "--sentences-file /nonexistent/s.txt: could not read it" in capsys.readouterr().err
    assert main(["eval", "--seeds", "0,x"]) == 2
    assert "--seeds 0,x: expected integers" in capsys.readouterr().err
    assert main(["eval", "--seeds", "5,5"]) == 2
    assert "--seeds 5,5: each seed once" in capsys.readouterr().err
    assert main(["eval", "--seed", "1", "--seeds", "0,100"]) == 2
    assert "either --seed or --seeds" in capsys.readouterr().err


def readme_main_job_sentence() -> str:
    """The sentence the README's main job (`... && drama3 say "..." -o hello.wav`) speaks."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    found = re.search(r'drama3 say "([^"]+)" -o hello\.wav', readme)
    assert found, "the README's main job command (drama3 say \"...\" -o hello.wav) was not found"
    return found.group(1)


@pytest.mark.slow
def test_the_readme_main_job_is_heard_saying_its_sentence(tmp_path):
    """`drama3 say "<the README's sentence>" -o hello.wav` (the bundled model, its default voice),
    three seeds: Whisper hears most of the sentence, pooled WER within README_JOB_BAR."""
    if not shipped.is_available():
        pytest.skip("this checkout carries no drama3-tiny weights")
    import soundfile

    from transformers_drama3.cli import main

    sentence = readme_main_job_sentence()
    heard = []
    for seed in range(3):
        path = tmp_path / f"hello-{seed}.wav"
        assert main(["say", sentence, "-o", str(path), "--seed", str(seed), "--quiet"]) == 0
        audio, rate = soundfile.read(path, dtype="float32")
        heard.append((asr.transcribe(audio, rate), sentence))
    assert asr.corpus_wer(heard) <= README_JOB_BAR, heard


@needs_espeak
def test_eval_over_several_seeds_speaks_each_sentence_once_per_seed_and_pools_the_outputs():
    """With seeds [0, 100] every sentence is spoken twice (take i with seed + i), the original and
    its resynthesis are transcribed once, and the outputs' WER pools both seeds' takes."""
    from types import SimpleNamespace

    from transformers_drama3.evaluation.intelligibility import measure_intelligibility

    class Codec:
        sampling_rate = ESPEAK_RATE

        def encode(self, audio, sampling_rate):
            return SimpleNamespace(audio_codes=np.asarray(audio), lengths=None)

        def decode(self, codes, lengths):
            import torch
            return SimpleNamespace(audio_values=torch.as_tensor(codes)[None].float())

    seeds_used = []

    def generate(*, seed, **_):
        import torch
        seeds_used.append(seed)
        audio = torch.full((1, 2205 if seed < 100 else 4410), 0.1)  # seed 100+: a take twice as long
        return SimpleNamespace(audio=audio, finish_reasons=["eos"])

    calls = []

    def transcribe(audio, rate):
        calls.append(len(audio))
        return SAMPLE[0] if len(audio) == 2205 else ""  # seed 0's takes heard right, seed 100's not at all

    model = SimpleNamespace(generate=generate)
    processor = type("Processor", (), {"codec": Codec(), "__call__": lambda self, *args, **kwargs: {}})()
    report = measure_intelligibility(model, processor, {"A": ("clip.wav", "text")}, SAMPLE[:2], seed=[0, 100],
                                     transcribe=transcribe, progress=False)
    assert seeds_used == [0, 100, 1, 101]
    assert [(t["text"], t["seed"]) for t in report.takes] == [(SAMPLE[0], 0), (SAMPLE[0], 100), (SAMPLE[1], 0), (SAMPLE[1], 100)]
    assert len(calls) == 2 * 2 + 4  # original + resynthesis once a sentence, one output a take
    row = report.overall
    assert (row.sentences, row.takes) == (2, 4)
    assert row.wer_outputs == asr.corpus_wer([(SAMPLE[0], SAMPLE[0]), ("", SAMPLE[0]), (SAMPLE[0], SAMPLE[1]), ("", SAMPLE[1])])
    assert row.wer_originals == 1.0  # espeak's renderings are not 2205 samples long: heard as nothing
    assert "| A | 2 x 2 |" in report.table()
    with pytest.raises(ValueError, match="distinct ints"):
        measure_intelligibility(model, processor, {"A": ("clip.wav", "text")}, SAMPLE[:1], seed=[0, 0], progress=False)


@needs_espeak
def test_eval_with_alignment_on_for_a_model_without_a_table_is_refused_before_speaking(tiny_checkpoint, capsys):
    """`--alignment on` asks for the model's table; a checkpoint without one is refused, naming it,
    before any sentence is spoken."""
    from transformers_drama3.cli import main

    folder, _, _ = tiny_checkpoint
    assert main(["eval", "--model", folder, "--alignment", "on", "--sentences", "1", "--quiet"]) == 2
    error = capsys.readouterr().err
    assert "phoneme_alignment=True" in error and "no alignment table" in error
