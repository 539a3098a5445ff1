"""The drama3-tiny instruments: WER, MFCC + DTW content identification, speaker identification.
The Whisper recogniser itself is tested in test_intelligibility.py."""

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch

from recipes.drama3_tiny import instruments as I
from recipes.drama3_tiny.corpus import SAMPLING_RATE, VOICES_BY_NAME, espeak_available, synthesize

needs_espeak = pytest.mark.skipif(
    not espeak_available(), reason="espeak-ng binary not on PATH (CI installs it: apt-get install -y espeak-ng)"
)
needs_resemblyzer = pytest.mark.skipif(
    importlib.util.find_spec("resemblyzer") is None, reason=f"resemblyzer not installed ({I.INSTALL_HINT})"
)

SENTENCES = (
    "The old fisherman carried a heavy lantern to the harbour.",
    "Please open the window before breakfast.",
    "My cousin keeps forty two pebbles in a wooden box.",
    "Why did the sleepy donkey wander across the valley?",
)


# ---- word error rate ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hypothesis, reference, expected",
    [
        ("the cat sat down", "the cat sat down", 0.0),
        ("the dog sat down", "the cat sat down", 0.25),  # one substitution
        ("the cat down", "the cat sat down", 0.25),  # one deletion
        ("the cat sat right down", "the cat sat down", 0.25),  # one insertion
        ("", "the cat sat down", 1.0),
        ("a b c d e f", "x y", 3.0),  # insertions can push WER above 1
        ("", "", 0.0),
        ("anything", "", 1.0),
    ],
)
def test_wer_counts_word_edits_over_reference_words(hypothesis, reference, expected):
    assert I.wer(hypothesis, reference) == pytest.approx(expected)


def test_wer_ignores_case_punctuation_and_directions():
    assert I.wer("the train leaves at five o'clock", "(fast) The train [pause] <whisper>leaves</whisper> at five o'clock!") == 0
    assert I.normalize_text("Did Anna, really?") == ["did", "anna", "really"]


def test_corpus_wer_weights_by_reference_length():
    pairs = [("a b c d", "a b c d"), ("x", "a b")]  # 0 errors of 4 words, 2 of 2
    assert I.corpus_wer(pairs) == pytest.approx(2 / 6)


# ---- signals, MFCC, DTW -------------------------------------------------------------------------


def test_prepare_resamples_to_16_khz_and_adds_the_same_dither_every_time():
    silence = np.zeros(22050, dtype=np.int16)
    first, second = I.prepare(silence, 22050), I.prepare(torch.zeros(1, 22050), 22050)
    assert first.shape == (16000,) and first.dtype == np.float32
    np.testing.assert_array_equal(first, second)
    assert np.std(first) == pytest.approx(I.DITHER_STD, rel=0.05)


def test_signals_of_the_wrong_shape_are_rejected():
    with pytest.raises(ValueError, match=r"shape \(2, 100\); expected mono"):
        I.prepare(np.zeros((2, 100), dtype=np.float32), 16000)


def test_mfcc_gives_a_frame_every_10_ms_of_normalised_coefficients():
    chirp = np.sin(2 * np.pi * np.cumsum(np.linspace(200, 3000, 16000)) / 16000).astype(np.float32)
    features = I.mfcc(chirp, 16000)
    assert features.shape == (1 + (16000 - I.MFCC_WINDOW) // I.MFCC_HOP, I.MFCC_COEFFICIENTS)
    np.testing.assert_allclose(features.mean(axis=0), 0, atol=1e-4)
    np.testing.assert_allclose(features.std(axis=0), 1, atol=1e-3)


@needs_espeak
def test_mfcc_distances_ignore_the_noise_floor():
    voice = VOICES_BY_NAME["A"]
    renderings = [synthesize(s, voice) for s in SENTENCES]
    rng = np.random.default_rng(0)
    noisy = [r / 32768 + 0.01 * np.std(r / 32768) * 10 * rng.standard_normal(len(r)) for r in renderings]  # ~20 dB SNR
    outputs = [I.mfcc(x, SAMPLING_RATE) for x in noisy]
    clean = [I.mfcc(x, SAMPLING_RATE) for x in renderings]
    assert I.dtw_identification_rate(outputs, clean, distractors=3) == 1.0


def test_dtw_distance_of_a_sequence_to_itself_is_zero():
    a = np.random.default_rng(0).standard_normal((50, 13))
    assert I.dtw_distance(a, a) == pytest.approx(0.0, abs=1e-6)


def test_dtw_prefers_a_time_warped_copy_to_a_different_sequence():
    rng = np.random.default_rng(0)
    a = np.cumsum(rng.standard_normal((60, 13)), axis=0)  # a smooth random trajectory
    warped = np.repeat(a, 2, axis=0)[::3]  # the same path at 2/3 of the frames
    stretched = np.repeat(a, 2, axis=0)  # the same path twice as slowly
    other = np.cumsum(rng.standard_normal((60, 13)), axis=0)
    assert I.dtw_distance(a, stretched) == pytest.approx(0.0, abs=1e-6)  # every frame of a is matched exactly
    assert I.dtw_distance(a, warped) < 0.2 * I.dtw_distance(a, other)
    assert I.dtw_distance(a, other) == pytest.approx(I.dtw_distance(other, a))


def test_dtw_distance_matches_the_textbook_recursion():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((7, 3)), rng.standard_normal((5, 3))
    cost = np.linalg.norm(a[:, None] - b[None], axis=-1)
    total = np.full((8, 6), np.inf)
    total[0, 0] = 0
    for i in range(1, 8):
        for j in range(1, 6):
            c = cost[i - 1, j - 1]
            total[i, j] = min(total[i - 1, j] + c, total[i, j - 1] + c, total[i - 1, j - 1] + 2 * c)
    assert I.dtw_distance(a, b) == pytest.approx(total[7, 5] / 12)


def test_dtw_rejects_mismatched_feature_sizes():
    with pytest.raises(ValueError, match="equal dim"):
        I.dtw_distance(np.zeros((3, 13)), np.zeros((3, 12)))


def test_dtw_identification_finds_the_sequence_an_output_was_made_from():
    rng = np.random.default_rng(2)
    renderings = [np.cumsum(rng.standard_normal((40, 13)), axis=0) for _ in range(12)]
    outputs = [np.repeat(r, 3, axis=0)[::2] + 0.1 * rng.standard_normal((60, 13)) for r in renderings]
    assert I.dtw_identification_rate(outputs, renderings) == 1.0
    shuffled = outputs[1:] + outputs[:1]
    assert I.dtw_identification_rate(shuffled, renderings) == 0.0


def test_identify_voice_picks_the_most_similar_centroid():
    centroids = {"A": np.array([1.0, 0.0, 0.0]), "B": np.array([0.0, 1.0, 0.0])}
    assert I.identify_voice(np.array([0.2, 0.9, 0.1]), centroids) == "B"
    assert I.voice_centroid([np.array([2.0, 0.0]), np.array([0.0, 2.0])]) == pytest.approx([2**-0.5, 2**-0.5])


def test_duration_ratio_compares_seconds_not_samples():
    assert I.duration_ratio(np.zeros(16000), 16000, np.zeros(44100), 22050) == pytest.approx(0.5)


# ---- on espeak speech ---------------------------------------------------------------------------


@needs_espeak
def test_dtw_identifies_espeak_sentences_spoken_at_another_speed():
    voice = VOICES_BY_NAME["A"]
    slower = replace(voice, speed=int(voice.speed * 0.85), pitch=voice.pitch + 8)
    renderings = [I.mfcc(synthesize(s, voice), SAMPLING_RATE) for s in SENTENCES]
    outputs = [I.mfcc(synthesize(s, slower), SAMPLING_RATE) for s in SENTENCES]
    assert I.dtw_identification_rate(outputs, renderings, distractors=3) == 1.0


@pytest.mark.slow  # resemblyzer's first call in a process: model load, librosa imports, ~10-20 s
@needs_espeak
@needs_resemblyzer
def test_resemblyzer_identifies_four_espeak_voices():
    names = ("A", "B", "D", "F")
    embeddings = {
        name: [I.speaker_embedding(synthesize(s, VOICES_BY_NAME[name]), SAMPLING_RATE) for s in SENTENCES]
        for name in names
    }
    centroids = {name: I.voice_centroid(e[:3]) for name, e in embeddings.items()}  # enrol on three
    for name in names:  # identify the fourth, a sentence not enrolled
        assert I.identify_voice(embeddings[name][3], centroids) == name
    same = I.speaker_similarity(embeddings["A"][0], embeddings["A"][1])
    cross = I.speaker_similarity(embeddings["A"][0], embeddings["B"][0])
    assert same > 0.8 > cross


# ---- prosody: the directions' instruments ---------------------------------------------------------


def test_median_pitch_finds_the_frequency_of_a_pulse_train():
    rate = 16000
    for f0 in (90.0, 150.0, 240.0):
        t = np.arange(rate) / rate
        pulses = np.sign(np.sin(2 * np.pi * f0 * t)) * 0.3  # harmonic-rich, like a voice
        assert abs(I.median_pitch(pulses, rate) - f0) / f0 < 0.03
    noise = np.random.default_rng(0).standard_normal(rate).astype(np.float32) * 0.3
    assert I.voiced_share(noise, rate) < 0.1  # white noise has no period: a whisper reads as unvoiced


def test_longest_pause_measures_silence_between_sounds_only():
    rate = 16000
    tone = 0.3 * np.sin(2 * np.pi * 200 * np.arange(rate // 2) / rate)
    gap = np.zeros(int(0.4 * rate))
    assert abs(I.longest_pause(np.concatenate([tone, gap, tone]), rate) - 0.4) < 0.05
    # silence before and after the speech is not a pause
    assert I.longest_pause(np.concatenate([gap, tone, gap]), rate) < 0.05


@needs_espeak
@pytest.mark.parametrize("voice", ["A", "B", "D", "F"])
def test_espeak_renderings_follow_every_direction_by_the_evaluation_margins(voice):
    """The instruments behind the evaluation's directions part read what espeak does to a sentence."""
    from recipes.drama3_tiny.evaluation import DIRECTION_MARGINS, direction_effect, direction_pairs

    for name, texts in direction_pairs(SENTENCES[0]).items():
        more, less = (synthesize(text, VOICES_BY_NAME[voice]) for text in texts)
        assert direction_effect(name, more, less, SAMPLING_RATE) > DIRECTION_MARGINS[name], (voice, name)
        # and the opposite order does not pass
        assert not direction_effect(name, less, more, SAMPLING_RATE) > DIRECTION_MARGINS[name], (voice, name)


def test_the_evaluation_table_marks_each_bar_and_never_prints_nan():
    """A one-voice run cannot tell voices apart: those rows read n/a, not nan; each bar says met or not."""
    from recipes.drama3_tiny.evaluation import TinyEvaluation

    result = TinyEvaluation(outputs=3, voices=["A"], wer_originals=0.1, wer_resyntheses=0.2, wer_outputs=0.5,
                              dtw_resyntheses=1.0, dtw_outputs=0.9, codec_similarity=0.85,
                              similarity_to_reference_voice=0.9, stopped_by_itself=1.0, duration_ratio_median=1.0,
                              duration_within_bounds=1.0, semantic_loss_right_text=0.7, semantic_loss_wrong_text=1.5)
    table = result.table()
    assert "nan" not in table
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in table.splitlines()[2:]}
    assert rows["WER model outputs"][-1].strip(" |") == "not met"      # 30 points above the resyntheses
    assert rows["DTW identification, outputs"][-1].strip(" |") == "met"
    assert rows["voice identification of outputs"][1] == "n/a (needs 2 or more voices)"
    assert rows["voice identification of outputs"][-1].strip(" |") == "n/a"
