"""The drama3-tiny corpus: reproducible from a seed, held-out sentences kept out of train, cloning
references that differ from their targets, and directions that really change espeak's audio."""

import random
import wave

import numpy as np
import pytest

from recipes.drama3_tiny.corpus import (
    EVALUATED,
    MIN_DIRECTED_WORDS,
    PAUSE,
    PAUSE_MS,
    SAMPLING_RATE,
    UNIQUE_WORDS,
    VOICES_BY_NAME,
    build_corpus,
    espeak_available,
    main,
    parse_directed,
    plain_transcript,
    plan_corpus,
    read_manifest,
    render_record,
    synthesize,
)
from transformers_drama3.evaluation.asr import normalize_text
from transformers_drama3.evaluation.intelligibility import HELDOUT_SENTENCES
from recipes.drama3_tiny.sentences import english_content_words, english_sentence, number_to_words, year_to_words

needs_espeak = pytest.mark.skipif(
    not espeak_available(), reason="espeak-ng binary not on PATH (CI installs it: apt-get install -y espeak-ng)"
)
SENTENCE = "The old fisherman carried a heavy lantern to the harbour."
VOICE_A = VOICES_BY_NAME["A"]


# ---- text ---------------------------------------------------------------------------------------


def test_numbers_are_spelled_out():
    assert number_to_words(0) == "zero"
    assert number_to_words(42) == "forty two"
    assert number_to_words(700) == "seven hundred"
    assert number_to_words(2417) == "two thousand four hundred seventeen"
    assert year_to_words(1984) == "nineteen eighty four"
    assert year_to_words(1906) == "nineteen oh six"
    assert year_to_words(2007) == "two thousand seven"
    with pytest.raises(ValueError, match="0..9999"):
        number_to_words(10000)


def test_the_grammar_has_several_hundred_content_words_and_no_digits():
    assert len(english_content_words()) >= 400
    rng = random.Random(0)
    sentences = [english_sentence(rng) for _ in range(2000)]
    words = {w.strip(".,?").lower() for s in sentences for w in s.split()}
    assert len(words & english_content_words()) >= 300
    assert not any(ch.isdigit() for s in sentences for ch in s)
    assert len(set(sentences)) > 1900


def test_directed_text_parses_into_styles_and_voice_segments():
    directed = parse_directed("(slow) (high) We <whisper>saw the [pause] lamp</whisper> today.")
    assert directed.styles == ("slow", "high")
    assert [(s.pieces, s.whisper, s.language) for s in directed.segments] == [
        (("We",), False, None),
        (("saw the", PAUSE, "lamp"), True, None),
        (("today.",), False, None),
    ]
    spanish = parse_directed("(fast) <spanish>Hola [pause] amigo.</spanish>")
    assert spanish.styles == ("fast",)
    assert [(s.pieces, s.language) for s in spanish.segments] == [(("Hola", PAUSE, "amigo."), "es")]


@pytest.mark.parametrize(
    "text, message",
    [("(angry) Hi.", "unknown style"), ("Hi [laughs] there.", "unknown point direction"),
     ("<shout>Hi</shout>", "unknown span"), ("<whisper>Hi", "never closed"), ("Hi</whisper>", "closes nothing")],
)
def test_unknown_or_unbalanced_directions_are_rejected(text, message):
    with pytest.raises(ValueError, match=message):
        parse_directed(text)


def test_the_transcript_is_the_directed_text_without_directions():
    assert plain_transcript("(fast) We <whisper>saw the</whisper> [pause] lamp.") == "We saw the lamp."
    assert plain_transcript("(low) <spanish>Hola amigo.</spanish>") == "Hola amigo."


# ---- plan ---------------------------------------------------------------------------------------


def test_the_plan_is_a_pure_function_of_the_seed():
    assert plan_corpus(3, 30) == plan_corpus(3, 30)
    assert plan_corpus(3, 30) != plan_corpus(4, 30)


def test_heldout_sentences_never_appear_in_train_in_any_voice():
    records = plan_corpus(0, 300, heldout_sentences=40)
    heldout = {r.transcript for r in records if r.split == "heldout"}
    train = {r.transcript for r in records if r.split == "train"}
    assert len(heldout) == 40
    assert not heldout & train
    for voice in VOICES_BY_NAME:  # each held-out sentence is spoken by every voice
        assert {r.transcript for r in records if r.split == "heldout" and r.voice == voice} == heldout


def test_references_are_other_train_utterances_of_the_same_voice():
    records = plan_corpus(1, 40)
    by_id = {r.id: r for r in records}
    for record in records:
        reference = by_id[record.reference_id]
        assert reference.id != record.id
        assert reference.voice == record.voice and reference.speaker == record.speaker
        assert reference.split == "train"
        assert not reference.directions and reference.language == "en"  # a clean view of the voice


def test_a_share_of_train_is_directed_and_a_share_is_tagged_spanish():
    train = [r for r in plan_corpus(0, 200) if r.split == "train"]
    directed = [r for r in train if r.directions]
    spanish = [r for r in train if r.language == "spanish"]
    assert 0.25 < len(directed) / len(train) < 0.45
    assert 0.05 < len(spanish) / len(train) < 0.15
    assert all("<spanish>" in r.directed_text and "<" not in r.transcript for r in spanish)
    kinds = {d for r in directed for d in r.directions}
    assert kinds == {"fast", "slow", "high", "low", "pause", "whisper"}


def test_grammar_1_is_the_default_and_gives_the_first_release_plan():
    assert plan_corpus(2, 40) == plan_corpus(2, 40, grammar=1)
    assert plan_corpus(2, 40) != plan_corpus(2, 40, grammar=2)


def test_grammar_2_speaks_from_one_word_up():
    train = [r for r in plan_corpus(0, 400, grammar=2) if r.split == "train" and r.language == "en"]
    words = [len(r.transcript.split()) for r in train]
    shares = {n: sum(1 for w in words if lo <= w <= hi) / len(words) for n, (lo, hi) in
              {"1": (1, 1), "2-3": (2, 3), "4-6": (4, 6)}.items()}
    assert 0.08 < shares["1"] < 0.16 and 0.12 < shares["2-3"] < 0.26 and shares["4-6"] > 0.2
    assert all(len(r.transcript.split()) >= MIN_DIRECTED_WORDS for r in train if r.directions)


def test_grammar_2_keeps_what_the_evaluations_ask_for_out_of_train():
    records = plan_corpus(0, 3000, voices=[VOICES_BY_NAME[v] for v in "ABDF"], grammar=2)
    spoken = {tuple(normalize_text(r.transcript)) for r in records if r.split == "train"}
    assert not spoken & EVALUATED
    assert tuple(normalize_text("Hello.")) in EVALUATED and len(EVALUATED) == len(HELDOUT_SENTENCES) + 9


def test_grammar_2_repeats_only_short_utterances():
    train = [r.transcript for r in plan_corpus(0, 400, grammar=2) if r.split == "train"]
    long = [t for t in train if len(t.split()) >= UNIQUE_WORDS]
    assert len(set(long)) == len(long) and len(set(train)) < len(train)


def test_speakers_are_numbered_in_voice_order():
    records = plan_corpus(0, 3, heldout_sentences=1)
    assert sorted({(r.speaker, r.voice) for r in records}) == [(0, "A"), (1, "B"), (2, "D"), (3, "E"), (4, "F")]


# ---- audio --------------------------------------------------------------------------------------


def _voiced_frames(samples: np.ndarray, rate: int = SAMPLING_RATE):
    """(pitch Hz, periodicity) of each loud 40 ms frame, by normalised autocorrelation (60-400 Hz)."""
    x = samples.astype(np.float64) / 32768.0
    window, hop = int(0.04 * rate), int(0.01 * rate)
    shortest, longest = rate // 400, rate // 60
    loudness = np.sqrt(np.mean(x**2))
    for start in range(0, len(x) - window, hop):
        frame = x[start : start + window] - x[start : start + window].mean()
        if np.sqrt(np.mean(frame**2)) < 0.5 * loudness:
            continue
        correlation = np.correlate(frame, frame, "full")[window - 1 :]
        correlation = correlation / correlation[0]
        lag = shortest + int(np.argmax(correlation[shortest:longest]))
        yield rate / lag, correlation[lag]


def median_pitch(samples):
    return float(np.median([pitch for pitch, _ in _voiced_frames(samples)]))


def median_periodicity(samples):
    return float(np.median([periodicity for _, periodicity in _voiced_frames(samples)]))


def longest_inner_silence(samples) -> float:
    """Seconds of the longest run of exact zeros between the first and last non-zero sample."""
    loud = np.flatnonzero(samples)
    inner = samples[loud[0] : loud[-1] + 1] == 0
    edges = np.diff(np.concatenate(([0], inner.astype(np.int8), [0])))
    runs = np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)
    return runs.max(initial=0) / SAMPLING_RATE


@needs_espeak
def test_slow_lengthens_and_fast_shortens_the_utterance():
    plain = len(synthesize(SENTENCE, VOICE_A))
    assert len(synthesize(f"(slow) {SENTENCE}", VOICE_A)) > 1.15 * plain
    assert len(synthesize(f"(fast) {SENTENCE}", VOICE_A)) < 0.85 * plain


@needs_espeak
def test_high_raises_and_low_lowers_the_median_pitch():
    plain = median_pitch(synthesize(SENTENCE, VOICE_A))
    assert median_pitch(synthesize(f"(high) {SENTENCE}", VOICE_A)) > 1.15 * plain
    assert median_pitch(synthesize(f"(low) {SENTENCE}", VOICE_A)) < 0.9 * plain


@needs_espeak
def test_pause_inserts_a_silence_of_the_pause_length():
    plain = synthesize(SENTENCE, VOICE_A)
    paused = synthesize(SENTENCE.replace("fisherman", "fisherman [pause]"), VOICE_A)
    added = (len(paused) - len(plain)) / SAMPLING_RATE
    assert PAUSE_MS / 1000 - 0.05 < added < PAUSE_MS / 1000 + 0.15
    assert longest_inner_silence(paused) > PAUSE_MS / 1000 - 0.05
    assert longest_inner_silence(plain) < PAUSE_MS / 1000 - 0.15


@needs_espeak
def test_whisper_spans_have_little_periodicity():
    voiced = median_periodicity(synthesize(SENTENCE, VOICE_A))
    whispered = median_periodicity(synthesize(f"<whisper>{SENTENCE}</whisper>", VOICE_A))
    assert voiced > 0.4
    assert whispered < 0.3 and whispered < 0.6 * voiced


@needs_espeak
def test_a_whisper_span_changes_only_its_own_part():
    plain = synthesize("Open the door. Close the window.", VOICE_A)
    mixed = synthesize("Open the door. <whisper>Close the window.</whisper>", VOICE_A)
    head = synthesize("Open the door.", VOICE_A)
    assert np.array_equal(mixed[: len(head)], head)
    assert not np.array_equal(mixed, plain)


@needs_espeak
def test_a_spanish_span_is_spoken_by_another_voice():
    english = synthesize("Hola amigo.", VOICE_A)
    spanish = synthesize("<spanish>Hola amigo.</spanish>", VOICE_A)
    assert len(spanish) > 0 and not np.array_equal(english, spanish)


@needs_espeak
def test_render_record_writes_native_rate_mono_16_bit_wav(tmp_path):
    records = plan_corpus(0, 4, heldout_sentences=1)[:3]
    (tmp_path / "wavs").mkdir()
    for record in records:
        rendered = render_record(record, tmp_path)
        with wave.open(str(tmp_path / rendered.wav)) as wav:
            assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (SAMPLING_RATE, 1, 2)
            assert wav.getnframes() == rendered.num_samples > SAMPLING_RATE // 2
        assert rendered.duration == round(rendered.num_samples / SAMPLING_RATE, 4)


@needs_espeak
def test_the_same_seed_builds_byte_identical_wavs_and_manifest(tmp_path):
    arguments = ["--seed", "7", "--utterances-per-voice", "3", "--heldout-sentences", "2", "--voices", "A,E"]
    main(["build", str(tmp_path / "one"), *arguments])
    build_corpus(tmp_path / "two", seed=7, utterances_per_voice=3, heldout_sentences=2,
                 voices=[VOICES_BY_NAME["A"], VOICES_BY_NAME["E"]], jobs=2, progress=False)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert len(files) == 1 + 2 * (3 + 2)
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    records = read_manifest(tmp_path / "one" / "manifest.jsonl")
    assert [r.voice_spec for r in records[:1]] == ["en-us+m1 -p50 -s170"]
    assert all(r.duration > 0.5 for r in records)


# ---- phoneme-labelled speech (libespeak-ng itself) ---------------------------------------------


def test_the_library_speaks_the_front_ends_phonemes_repeatably_and_says_where_each_starts():
    from recipes.drama3_tiny.corpus import aligned_synthesize
    from transformers_drama3.prompting.phonemes import espeak

    pytest.importorskip("espeakng_loader")
    front = espeak().phonemes(SENTENCE, "en-us")
    samples, phonemes = aligned_synthesize(SENTENCE, VOICE_A)
    assert samples.dtype == np.int16 and len(samples) > SAMPLING_RATE  # a sentence, not a blip
    spoken = "".join(symbol for symbol, _ in phonemes)
    assert spoken == "".join(c for c in front if c not in " ,.!?")  # the same symbols in the same order
    starts = [start for _, start in phonemes]
    assert starts == sorted(starts) and 0 <= starts[0] and starts[-1] < len(samples)
    # nothing is loud before the first phoneme starts
    assert np.abs(samples[: starts[0]]).max(initial=0) < 0.05 * np.abs(samples).max()
    # the same samples and phonemes on every call, and the front end is left as it was
    again, phonemes_again = aligned_synthesize(SENTENCE, VOICE_A)
    assert np.array_equal(again, samples) and phonemes_again == phonemes
    assert espeak().phonemes(SENTENCE, "en-us") == front


def test_library_speech_keeps_pauses_and_offsets_each_segments_phonemes():
    from recipes.drama3_tiny.corpus import aligned_synthesize, espeak_calls

    pytest.importorskip("espeakng_loader")
    text = "Hello there. <whisper>Quietly now.</whisper>"
    calls = espeak_calls(text, VOICE_A)
    assert len(calls) == 2 and calls[1][1] == f"{VOICE_A.language}+{VOICE_A.whisper_variant}"
    samples, phonemes = aligned_synthesize(text, VOICE_A)
    first, first_phonemes = aligned_synthesize("Hello there.", VOICE_A)
    assert np.array_equal(samples[: len(first)], first)
    assert phonemes[: len(first_phonemes)] == first_phonemes
    assert len(phonemes) > len(first_phonemes)
    assert all(start >= len(first) for _, start in phonemes[len(first_phonemes):])
    # a segment of pauses alone is silence of the pause length, without phonemes
    silent, none = aligned_synthesize("[pause] [pause]", VOICE_A)
    assert len(silent) == 2 * SAMPLING_RATE * PAUSE_MS // 1000 and not silent.any() and none == []


def test_an_unknown_library_voice_is_refused_by_name():
    from transformers_drama3.prompting.phonemes import espeak, speak_in_fresh_process

    pytest.importorskip("espeakng_loader")
    with pytest.raises(ValueError, match="no voice 'xx-nowhere'"):
        speak_in_fresh_process("<speak>Hi.</speak>", "xx-nowhere", 50, 170)
    assert espeak().phonemes("Hello", "en-us") == "həlˈoʊ"
