"""Does a model say the words? WER of espeak originals, codec resyntheses and model outputs, per voice.

For each voice and each sentence (default `HELDOUT_SENTENCES`, everyday English that no training
corpus of this project holds):
    original     espeak-ng speaks the sentence in the voice (what drama3-tiny was trained to imitate)
    resynthesis  the original through the model's codec (encode, decode): what the codec lets through
    output       the model speaks the sentence, cloning the voice from its bundled reference clip
and Whisper tiny.en (`asr.transcribe`) writes down what it hears in each. The WER of the originals
is the recogniser's own floor, the resyntheses' the codec's ceiling for any model, the outputs'
the model's. Also per voice: the share of outputs that stop by themselves and the median ratio
of their duration to the original's. The outputs are drawn, so one seed's WER moves by several
points; several seeds pool their takes (the originals and resyntheses are the same for each).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import asr
from .espeak import ESPEAK_RATE, TINY_VOICES, speak

HELDOUT_SENTENCES = (
    "Please close the door when you leave the kitchen.",
    "The train to the city leaves at seven every morning.",
    "My sister bought a new phone last week.",
    "We should water the plants before it gets dark.",
    "Can you tell me where the nearest bank is?",
    "The children played football in the park all afternoon.",
    "I forgot my umbrella and got wet on the way home.",
    "He drinks a cup of coffee with milk every day.",
    "The museum is closed on Mondays and public holidays.",
    "Turn left at the next corner and walk straight on.",
    "Our neighbours are planning a party for Saturday night.",
    "This soup needs a little more salt and pepper.",
)
"""Fixed held-out sentences: everyday English, none of them in drama3-tiny's corpus (a test
checks it against the corpus plan)."""


@dataclass
class VoiceIntelligibility:
    """One voice's numbers: WERs pool edits over the voice's sentences (and seeds: `takes` outputs
    of `sentences` sentences)."""

    voice: str
    sentences: int
    wer_originals: float
    wer_resyntheses: float
    wer_outputs: float
    stopped_by_itself: float
    duration_ratio_median: float
    takes: int = 0


@dataclass
class IntelligibilityReport:
    """Per-voice rows, all voices pooled, and each take's words (`takes`)."""

    voices: list[VoiceIntelligibility] = field(default_factory=list)
    overall: VoiceIntelligibility | None = None
    takes: list[dict] = field(default_factory=list)

    def table(self) -> str:
        """Markdown: one row per voice and one for all voices together."""
        lines = [
            "| voice | sentences x seeds | WER espeak originals | WER codec resyntheses | WER model outputs "
            "| outputs that stop by themselves | duration / espeak (median) |",
            "|---|---|---|---|---|---|---|",
        ]
        rows = self.voices + ([self.overall] if self.overall is not None else [])
        for row in rows:
            lines.append(
                f"| {row.voice} | {row.sentences} x {row.takes // max(row.sentences, 1)} | {row.wer_originals:.1%} | {row.wer_resyntheses:.1%} "
                f"| {row.wer_outputs:.1%} | {row.stopped_by_itself:.0%} | {_ratio(row.duration_ratio_median)} |"
            )
        return "\n".join(lines)


def _ratio(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}"


def check_voices(voices: Sequence[str]) -> list[str]:
    """The voice names, checked against the espeak voices known here (bundled with drama3-tiny)."""
    voices = list(voices)
    if not voices:
        raise ValueError("voices: none given; expected names like A,B")
    unknown = [name for name in voices if name not in TINY_VOICES]
    if unknown:
        raise ValueError(f"voice {unknown[0]!r} has no espeak-ng voice here; choose from {sorted(TINY_VOICES)}")
    return voices


def check_sentences(sentences: Sequence[str]) -> list[str]:
    """The sentences, each checked to hold words to score."""
    sentences = list(sentences)
    if not sentences:
        raise ValueError("sentences: none given; expected at least one")
    for index, sentence in enumerate(sentences):
        if not asr.normalize_text(sentence):
            raise ValueError(f"sentence {index} ({sentence!r}) holds no words to score")
    return sentences


def resynthesize(codec, audio: np.ndarray, sampling_rate: int) -> np.ndarray:
    """`audio` through the codec and back: the waveform [time] at `codec.sampling_rate`."""
    encoded = codec.encode(audio, sampling_rate=sampling_rate)
    return codec.decode(encoded.audio_codes, encoded.lengths).audio_values[0].detach().cpu().float().numpy()


def speak_with_model(model, processor, sentence: str, reference: tuple[str, str], seed: int, **sampling):
    """(waveform [time] at the codec's rate, finish reason) of the model speaking `sentence` in the
    voice of `reference` (clip path, transcript)."""
    clip, transcript = reference
    inputs = processor(sentence, reference_audio=[clip], reference_text=[transcript])
    output = model.generate(**inputs, codec=processor.codec, seed=seed, return_dict_in_generate=True, **sampling)
    return output.audio[0].detach().cpu().float().numpy(), output.finish_reasons[0]


def summarize(voice: str, takes: Sequence[dict]) -> VoiceIntelligibility:
    """Pool `takes` (dicts with "text", "heard_*", "finish", "duration_ratio", and "seed" when
    several seeds spoke each sentence) into one row; originals and resyntheses count once a sentence."""
    def pooled(kind):
        if kind != "output":  # the same words for every seed of a sentence
            once = {(take["voice"], take["text"]): take for take in takes}.values()
            return asr.corpus_wer([(take[f"heard_{kind}"], take["text"]) for take in once])
        return asr.corpus_wer([(take[f"heard_{kind}"], take["text"]) for take in takes])

    ratios = [take["duration_ratio"] for take in takes if take["duration_ratio"] is not None]
    return VoiceIntelligibility(
        voice=voice, sentences=len({(take["voice"], take["text"]) for take in takes}),
        wer_originals=pooled("original"), wer_resyntheses=pooled("resynthesis"),
        wer_outputs=pooled("output"), stopped_by_itself=float(np.mean([take["finish"] == "eos" for take in takes])),
        duration_ratio_median=float(np.median(ratios)) if ratios else math.nan, takes=len(takes),
    )


def measure_intelligibility(
    model, processor, references: dict[str, tuple[str, str]], sentences: Sequence[str] = HELDOUT_SENTENCES,
    seed: int | Sequence[int] = 0, transcribe: Callable = asr.transcribe, progress: bool = True, **sampling,
) -> IntelligibilityReport:
    """Every voice of `references` (name -> (clip path, transcript); names from `TINY_VOICES`)
    speaks every sentence; see the module docstring. Take i of a voice uses seed `seed + i`; with
    several seeds (a sequence) every sentence is spoken once per seed, and each take records its
    seed."""
    from tqdm.auto import tqdm

    voices = check_voices(list(references))
    sentences = check_sentences(sentences)
    seeds = [seed] if isinstance(seed, int) else list(seed)
    if not seeds or len(set(seeds)) != len(seeds) or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"seed={seed!r}; expected an int or distinct ints")
    codec = processor.codec
    report = IntelligibilityReport()
    jobs = [(voice, index, sentence) for voice in voices for index, sentence in enumerate(sentences)]
    bar = tqdm(total=len(jobs) * len(seeds), desc="drama3 eval", unit="take", disable=not progress)
    for voice, index, sentence in jobs:
        original = speak(sentence, TINY_VOICES[voice])
        heard_original = transcribe(original, ESPEAK_RATE)
        heard_resynthesis = transcribe(resynthesize(codec, original, ESPEAK_RATE), codec.sampling_rate)
        for base in seeds:
            output, finish = speak_with_model(model, processor, sentence, references[voice], base + index, **sampling)
            seconds = len(output) / codec.sampling_rate
            report.takes.append({
                "voice": voice, "text": sentence, "heard_original": heard_original,
                "heard_resynthesis": heard_resynthesis,
                "heard_output": transcribe(output, codec.sampling_rate), "finish": finish,
                "seconds": round(seconds, 3), "duration_ratio": round(seconds / (len(original) / ESPEAK_RATE), 3),
                **({"seed": base} if len(seeds) > 1 else {}),
            })
            bar.update()
    bar.close()
    report.voices = [summarize(voice, [t for t in report.takes if t["voice"] == voice]) for voice in voices]
    report.overall = summarize("all", report.takes)
    return report


__all__ = ["HELDOUT_SENTENCES", "VoiceIntelligibility", "IntelligibilityReport", "check_voices", "check_sentences",
           "resynthesize", "speak_with_model", "summarize", "measure_intelligibility"]
