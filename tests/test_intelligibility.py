"""The Whisper instrument and `drama3 eval`: it reads espeak-ng, refuses to read garbled audio,
and measures the bundled drama3-tiny's codec resyntheses and outputs on fixed held-out sentences."""

import json

import numpy as np
import pytest

from transformers_drama3.evaluation import asr
from transformers_drama3.evaluation.espeak import ESPEAK_RATE, TINY_VOICES, espeak_available, speak
from transformers_drama3.evaluation.intelligibility import HELDOUT_SENTENCES, check_sentences, check_voices
from transformers_drama3.tiny import shipped

needs_espeak = pytest.mark.skipif(not espeak_available(), reason="espeak-ng not on PATH (CI installs it)")

SAMPLE = (HELDOUT_SENTENCES[0], HELDOUT_SENTENCES[9])
SAMPLE_VOICES = ("A", "B", "D", "F")
ORIGINALS_BAR = 0.20
"""Whisper on espeak's own renderings; measured on SAMPLE x SAMPLE_VOICES: 10.5% (on all 12
sentences: 24.1%, the RP and Caribbean voices D and F the hardest)."""
GARBLED_BAR = 0.80
RESYNTHESIS_BAR_TODAY = 0.55
"""What the shipped log-mel codec meets on SAMPLE x SAMPLE_VOICES (measured 43.4%; all 12
sentences: 50.0%). The issue's target is 15% (docs/tiny_codec.md: the levers measured for it)."""
DURATION_BOUNDS = (0.6, 1.6)


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
def test_the_heldout_sentences_are_in_no_training_corpus():
    from recipes.drama3_tiny.corpus import VOICES_BY_NAME, plan_corpus
    from recipes.drama3_tiny.lm_recipe import TINY_CORPUS_PLAN

    plan = {**TINY_CORPUS_PLAN, "voices": [VOICES_BY_NAME[name] for name in TINY_CORPUS_PLAN["voices"]]}
    corpus = {tuple(asr.normalize_text(record.transcript)) for record in plan_corpus(**plan)}
    assert not corpus & {tuple(asr.normalize_text(sentence)) for sentence in HELDOUT_SENTENCES}


def test_the_bundled_voices_are_the_corpus_voices():
    from recipes.drama3_tiny.corpus import VOICES_BY_NAME

    for name, voice in TINY_VOICES.items():
        corpus_voice = VOICES_BY_NAME[name]
        assert voice == (f"{corpus_voice.language}+{corpus_voice.variant}", corpus_voice.pitch, corpus_voice.speed)


# ---- the recogniser ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def renderings():
    """espeak-ng's renderings of the sample in every voice: [(sentence, float32 [time] at 22.05 kHz)]."""
    return [(sentence, speak(sentence, TINY_VOICES[voice])) for voice in SAMPLE_VOICES for sentence in SAMPLE]


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
    assert asr.wer(asr.transcribe(noise, 16000), SAMPLE[0]) >= GARBLED_BAR


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
                     "--quiet"])
    return code, out.getvalue(), json.loads(path.read_text()) if path.is_file() else None


@pytest.mark.slow
@needs_espeak
def test_drama3_eval_prints_a_wer_table_per_voice(eval_run):
    code, out, report = eval_run
    assert code == 0
    rows = [line.split(" | ")[0].strip("| ") for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["voice", *SAMPLE_VOICES, "all"]
    assert [take["text"] for take in report["takes"]] == list(SAMPLE) * len(SAMPLE_VOICES)


@pytest.mark.slow
@needs_espeak
def test_the_bundled_codec_resyntheses_hold_todays_word_error_rate(eval_run):
    """Resyntheses of the espeak originals through drama3-tiny's codec: today's level, a bar that
    catches a regression. The issue's target is <= 15% (not met yet: see docs/tiny_codec.md)."""
    _, _, report = eval_run
    assert report["overall"]["wer_resyntheses"] <= RESYNTHESIS_BAR_TODAY, report["overall"]


@pytest.mark.slow
@needs_espeak
def test_the_bundled_model_outputs_are_measured_and_stop_at_a_plausible_length(eval_run, record_property):
    """The outputs' WER is measured and reported (test property `wer_outputs`; measured 104% on
    this sample, 103% on all 12 sentences: fluent words that are not the sentence). The issue's
    bar, <= 35%, is not met yet (model_card.md), so it is not asserted; what is: every output
    stops by itself at a length near espeak's."""
    _, _, report = eval_run
    record_property("wer_outputs", report["overall"]["wer_outputs"])
    low, high = DURATION_BOUNDS
    for take in report["takes"]:
        assert take["finish"] == "eos" and low <= take["duration_ratio"] <= high, take


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
