"""Frame budgets, expected durations and the anomaly guards of a take (paper §7, §9).

Every take gets a frame budget: 2.5x its expected duration, at most 4096 frames. The expected
duration comes from the text of the turn to speak, which the processor's rows say
(`speak_span`); rows given without it are read by `prompting.bare_rows`, the one fallback.
"""

from __future__ import annotations

import math

import torch

from ..prompting.bare_rows import turn_spans
from ..prompting.text import is_cjk

# ----------------------------------------------------------------------------- guards (paper §7, §9)

MAX_FRAMES = 4096
"""No take is longer (the paper's cap, ~190 s)."""
BUDGET_FACTOR = 2.5
"""A take may last at most this many times its expected duration (paper §7)."""
TOKENS_PER_SECOND = 3.0
"""Expected speaking rate in text tokens per second. Qwen's tokenizer spends ~1.3 tokens on an
English word (read at ~2.5 words/s) and ~0.7 on a Chinese character (read at ~4.5 chars/s), both
~3.2 tokens/s; 3.0 errs towards a longer expected duration, the safe side for a budget."""
WORDS_PER_SECOND = 2.5
"""Expected speaking rate of space-separated text (English and similar)."""
CJK_CHARACTERS_PER_SECOND = 4.5
"""Expected speaking rate of Chinese, Japanese and Korean characters."""
MIN_EXPECTED_SECONDS = 1.0
"""The expected duration of any text, however short (a word still takes a breath)."""
TOO_SHORT_FRACTION = 0.25
"""A take that ends (eos) before this fraction of its expected duration is too short."""
SILENCE_RMS = 10 ** (-50 / 20)
"""A waveform window whose RMS is below -50 dBFS is silence."""
SILENCE_WINDOW_SECONDS = 0.1
LONG_SILENCE_SECONDS = 3.0
"""A take with a silence longer than this inside it is anomalous (paper §9 "long silence")."""

ANOMALIES = ("silent", "too_short", "runaway", "long_silence", "overlong")


# ----------------------------------------------------------------------------- budgets and anomalies


def expected_seconds_of_text(text: str) -> float:
    """How long `text` takes to say: CJK characters at 4.5/s plus other words at 2.5/s, at least 1 s.

    Tags (`<|speaker:N|>`, `[laughs]`, `<whisper>`) count as a word each: they cost a little time."""
    cjk = sum(is_cjk(character) for character in text)
    words = len("".join(" " if is_cjk(character) else character for character in text).split())
    return max(MIN_EXPECTED_SECONDS, cjk / CJK_CHARACTERS_PER_SECOND + words / WORDS_PER_SECOND)


MIN_SPEECH_FRACTION = 0.2
"""Audio shorter than this fraction of its transcript's expected duration cannot hold that
transcript (it would be five times the assumed speaking rate): it is cut, or the wrong transcript."""


def speech_shortfall(seconds: float, text: str, fraction: float = MIN_SPEECH_FRACTION) -> str | None:
    """Why `seconds` of audio cannot be a recording of `text` (shorter than `fraction` of its
    expected duration), or None."""
    expected = expected_seconds_of_text(text)
    if seconds >= fraction * expected:
        return None
    return f"{seconds:.3f} s of audio for a transcript of about {expected:.1f} s (at least {fraction * expected:.2f} s expected)"


def target_text_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, eos_token_id: int, is_semantic) -> torch.Tensor:
    """Text tokens of the turn to speak, per prompt `[batch]`, for rows given without `speak_span`:
    the real text rows of the span `prompting.bare_rows.turn_spans` reads (the few layout tokens
    of the turn count too, a slight overestimate)."""
    spans, _ = turn_spans(input_ids, attention_mask, eos_token_id)
    real = attention_mask.bool() & ~is_semantic(input_ids)
    return torch.tensor([int(real[item, start:stop].sum()) for item, (start, stop) in enumerate(spans.tolist())],
                        dtype=torch.long)


def speak_span_tokens(speak_span: torch.Tensor) -> torch.Tensor:
    """Text tokens of the turn to speak, per prompt `[batch]`, from the layout's `speak_span`
    `[batch, 2]` (the processor's rows say where that turn's text is; nothing is searched)."""
    return (speak_span[:, 1] - speak_span[:, 0]).clamp(min=0).cpu()


def expected_seconds_of_tokens(tokens: torch.Tensor, tokens_per_second: float = TOKENS_PER_SECOND) -> torch.Tensor:
    """Expected speech duration of `tokens` text tokens at `tokens_per_second` (default
    `TOKENS_PER_SECOND`, Qwen's tokenizer; see `text_tokens_per_second`), at least 1 s."""
    return (tokens.float() / tokens_per_second).clamp(min=MIN_EXPECTED_SECONDS)


def _config_number(model, name: str, above: float, expected: str) -> float | None:
    """The generation config's number `name` (None when it has none), refused unless finite and above `above`."""
    value = getattr(getattr(model, "generation_config", None), name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= above:
        raise ValueError(f"generation_config.{name}={value!r}; expected {expected}")
    return float(value)


def overlong_factor(model) -> float | None:
    """The generation config's `overlong_factor`: a take that ends by itself after more than this
    many times its expected duration is anomalous ("overlong"). None (the default) checks nothing:
    the published model's expected duration is a rough words-a-second guess, and directed speech
    with its pauses may well last twice that. A model whose speaking rate is measured may set it
    to catch takes that loop back over their text and then stop (drama3-tiny's takes of one text
    vary little in length, but its loops come back on retries, so it does not set it:
    recipes/drama3_tiny/README.md)."""
    return _config_number(model, "overlong_factor", 1, "a number above 1 (or None: off)")


def text_tokens_per_second(model) -> float:
    """The speaking rate, in text tokens per second, that sets this model's frame budgets: the
    generation config's `text_tokens_per_second` when it has one (a model whose tokenizer spends
    more tokens a word, such as a phoneme front end, records its own), else `TOKENS_PER_SECOND`."""
    rate = _config_number(model, "text_tokens_per_second", 0, "a positive number of tokens a second")
    return TOKENS_PER_SECOND if rate is None else rate


def frame_budgets(
    expected_seconds: torch.Tensor,
    frame_rate: float,
    max_new_tokens: int | None = None,
    budget_factor: float = BUDGET_FACTOR,
    max_frames: int = MAX_FRAMES,
) -> torch.Tensor:
    """Frames each take may use: `budget_factor` (2.5) x its expected duration, never above
    `max_frames` (4096) nor `max_new_tokens`, at least 1. expected_seconds: [batch] -> [batch]."""
    budgets = (expected_seconds.double() * budget_factor * frame_rate).ceil().long().clamp(max=max_frames)
    if max_new_tokens is not None:
        budgets = budgets.clamp(max=int(max_new_tokens))
    return budgets.clamp(min=1)


def longest_silence_seconds(waveform: torch.Tensor, sampling_rate: int) -> float:
    """Longest run of silent 100 ms windows in a waveform `[samples]`, in seconds."""
    window = max(1, int(SILENCE_WINDOW_SECONDS * sampling_rate))
    windows = waveform.float().flatten()
    usable = windows.shape[0] // window * window
    if usable == 0:
        return waveform.numel() / sampling_rate if float(waveform.float().pow(2).mean().sqrt().nan_to_num()) < SILENCE_RMS else 0.0
    rms = windows[:usable].view(-1, window).pow(2).mean(dim=-1).sqrt()
    longest = run = 0
    for silent in (rms < SILENCE_RMS).tolist():
        run = run + 1 if silent else 0
        longest = max(longest, run)
    return longest * window / sampling_rate


def detect_anomalies(
    length: int,
    finish_reason: str,
    expected_frames: float,
    budget: int,
    waveform: torch.Tensor | None = None,
    sampling_rate: int | None = None,
    overlong: float | None = None,
) -> list[str]:
    """What is wrong with one take (paper §9): a subset of `ANOMALIES`, empty when it looks fine.

    - runaway: it used its whole budget (2.5x the expected duration, or 4096 frames) without eos;
    - too_short: it ended before 25% of its expected duration (or produced nothing);
    - silent: its waveform is below -50 dBFS throughout (needs the waveform);
    - long_silence: its waveform holds more than 3 s of silence (needs the waveform);
    - overlong: it ended by itself after more than `overlong` times its expected duration (only
      with `overlong`, see `overlong_factor`).
    """
    found = []
    if finish_reason == "length" and length >= budget:
        found.append("runaway")
    if finish_reason == "eos" and (length == 0 or length < TOO_SHORT_FRACTION * expected_frames):
        found.append("too_short")
    if finish_reason == "eos" and overlong is not None and length > overlong * expected_frames:
        found.append("overlong")
    if waveform is not None and waveform.numel():
        rms = float(waveform.float().pow(2).mean().sqrt())
        if rms < SILENCE_RMS:
            found.append("silent")
        elif longest_silence_seconds(waveform, sampling_rate) > LONG_SILENCE_SECONDS:
            found.append("long_silence")
    return found
