"""The drama3-tiny corpus: directed speech synthesised with espeak-ng, reproducible from a seed.

    python -m recipes.drama3_tiny.corpus build OUT_DIR --seed 0 --utterances-per-voice 400

writes `OUT_DIR/wavs/*.wav` (espeak's native 22.05 kHz, mono, 16-bit) and `OUT_DIR/manifest.jsonl`,
one record per utterance (see `build_corpus`). The same seed and options give byte-identical files.

Directions are written the way the model will read them and mapped onto what espeak really does:
    (fast) (slow) (high) (low)     style prefixes -> espeak speed (-s) and pitch (-p) of the utterance
    [pause]                        -> an SSML break of `PAUSE_MS`
    <whisper>...</whisper>         -> the span is spoken by the voice's whisper variant
    <spanish>...</spanish>         -> the span is spoken by espeak's Spanish voice, same variant
Spans with different voices are synthesised by separate espeak calls and concatenated. No dither
is added here: the instruments (`instruments`) add it to whatever they score.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import wave
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np
from tqdm.auto import tqdm

from transformers_drama3.evaluation.espeak import ESPEAK, ESPEAK_RATE, INSTALL_HINT, espeak_available, espeak_pcm  # noqa: F401
from transformers_drama3.feature_extraction_drama3 import read_audio
from transformers_drama3.evaluation.asr import normalize_text
from transformers_drama3.evaluation.intelligibility import HELDOUT_SENTENCES
from .sentences import LENGTH_PROBES, english_sentence, english_utterance, spanish_sentence

SAMPLING_RATE = ESPEAK_RATE  # what espeak-ng writes; the corpus keeps it
PAUSE_MS = 400

# style -> (speed factor, pitch offset); espeak pitch is 0-99
STYLES = {"fast": (1.35, 0), "slow": (0.7, 0), "high": (1.0, 25), "low": (1.0, -25)}
LANGUAGES = {"spanish": "es", "french": "fr", "german": "de"}  # tag name -> espeak language
SPAN_TAGS = {"whisper", *LANGUAGES}


@dataclass(frozen=True)
class Voice:
    """One corpus speaker: an espeak language voice, a variant family, a pitch and a speed."""

    name: str
    language: str
    variant: str
    pitch: int = 50
    speed: int = 175  # words per minute, espeak's default

    @property
    def spec(self) -> str:
        """The espeak-ng options that give this voice, e.g. 'en-us+m1 -p50 -s170'."""
        return f"{self.language}+{self.variant} -p{self.pitch} -s{self.speed}"

    @property
    def whisper_variant(self) -> str:
        return "whisperf" if self.variant.startswith("f") or self.variant == "whisperf" else "whisper"


# Distinct variant families, as measured in docs/tiny_corpus.md (a pitch change alone is not a new
# speaker to a speaker encoder). Letters follow the instruments reference; C (en-gb+m4) is left out.
VOICES = (
    Voice("A", "en-us", "m1", pitch=50, speed=170),
    Voice("B", "en-us", "f2", pitch=65, speed=160),
    Voice("D", "en-gb-x-rp", "f4", pitch=55, speed=185),
    Voice("E", "en-us", "whisper"),
    Voice("F", "en-029", "m7"),
)
VOICES_BY_NAME = {voice.name: voice for voice in VOICES}


# ---- directed text ------------------------------------------------------------------------------

PAUSE = object()  # a `[pause]` inside a segment


@dataclass(frozen=True)
class Segment:
    """A run of directed text spoken with one espeak voice: words, with PAUSE markers between."""

    pieces: tuple  # str | PAUSE
    whisper: bool = False
    language: str | None = None  # espeak language; None = the speaker's own


@dataclass(frozen=True)
class Directed:
    """Parsed directed text: the style prefixes of the utterance and its voice segments."""

    styles: tuple[str, ...]
    segments: tuple[Segment, ...]


_STYLE_PREFIX = re.compile(r"\s*\((\w+)\)")
_TAG = re.compile(r"(</?\w+>|\[\w+\])")


def parse_directed(text: str) -> Directed:
    """Split directed text into style prefixes and voice segments; unknown directions raise."""
    styles = []
    position = 0
    while match := _STYLE_PREFIX.match(text, position):
        if match.group(1) not in STYLES:
            raise ValueError(f"directed text {text!r}: unknown style ({match.group(1)}); expected one of {sorted(STYLES)}")
        styles.append(match.group(1))
        position = match.end()
    open_tags: list[str] = []
    segments: list[Segment] = []

    def add(piece) -> None:
        language = next((LANGUAGES[t] for t in reversed(open_tags) if t in LANGUAGES), None)
        whisper = "whisper" in open_tags
        if segments and (segments[-1].whisper, segments[-1].language) == (whisper, language):
            segments[-1] = replace(segments[-1], pieces=segments[-1].pieces + (piece,))
        else:
            segments.append(Segment((piece,), whisper, language))

    for token in _TAG.split(text[position:]):
        if not token.strip():
            continue
        if token == "[pause]":
            add(PAUSE)
        elif token.startswith("["):
            raise ValueError(f"directed text {text!r}: unknown point direction {token}; expected [pause]")
        elif token.startswith("</"):
            name = token[2:-1]
            if not open_tags or open_tags[-1] != name:
                raise ValueError(f"directed text {text!r}: {token} closes nothing open")
            open_tags.pop()
        elif token.startswith("<"):
            name = token[1:-1]
            if name not in SPAN_TAGS:
                raise ValueError(f"directed text {text!r}: unknown span <{name}>; expected one of {sorted(SPAN_TAGS)}")
            open_tags.append(name)
        else:
            add(token.strip())
    if open_tags:
        raise ValueError(f"directed text {text!r}: <{open_tags[-1]}> is never closed")
    return Directed(tuple(styles), tuple(segments))


def plain_transcript(directed_text: str) -> str:
    """The words of directed text, without style prefixes, tags or pauses."""
    position = 0
    while match := _STYLE_PREFIX.match(directed_text, position):
        position = match.end()
    return " ".join(_TAG.sub(" ", directed_text[position:]).split())


# ---- synthesis ----------------------------------------------------------------------------------


# espeak-ng itself is called by the package (`transformers_drama3.evaluation.espeak`): `drama3
# eval` renders its originals with the same call, so a corpus and an evaluation hear the same voice.
def espeak_calls(directed_text: str, voice: Voice) -> list[tuple[str, str, int, int] | int]:
    """How `synthesize` speaks directed text: per segment, one espeak-ng call (SSML, voice name,
    pitch, speed) or, for a segment of pauses alone, its number of silent samples."""
    directed = parse_directed(directed_text)
    speed, pitch = float(voice.speed), voice.pitch
    for style in directed.styles:
        factor, offset = STYLES[style]
        speed, pitch = speed * factor, pitch + offset
    speed, pitch = int(round(speed)), min(99, max(0, pitch))
    pause = f'<break time="{PAUSE_MS}ms"/>'
    calls = []
    for segment in directed.segments:
        words = [p for p in segment.pieces if p is not PAUSE]
        if not words:  # pauses alone: espeak is not needed for silence
            calls.append(len(segment.pieces) * SAMPLING_RATE * PAUSE_MS // 1000)
            continue
        ssml = " ".join(pause if p is PAUSE else escape(p) for p in segment.pieces)
        variant = voice.whisper_variant if segment.whisper else voice.variant
        calls.append((f"<speak>{ssml}</speak>", f"{segment.language or voice.language}+{variant}", pitch, speed))
    return calls


def synthesize(directed_text: str, voice: Voice) -> np.ndarray:
    """Speak directed text in `voice` with espeak-ng; int16 samples [time] at 22.05 kHz."""
    parts = [np.zeros(call, dtype=np.int16) if isinstance(call, int) else espeak_pcm(*call)
             for call in espeak_calls(directed_text, voice)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)


def aligned_synthesize(directed_text: str, voice: Voice) -> tuple[np.ndarray, list[tuple[str, int]]]:
    """`synthesize` by libespeak-ng itself (the wheel the phoneme front end loads), keeping where
    each phoneme starts: int16 samples [time] and [(IPA phoneme with its stress mark, first sample)].
    The phonemes are the front end's own symbols in its order, so speech made this way labels each
    frame with what it says. Each segment is spoken in a forked child, as the espeak-ng program is
    run once a segment: the same samples every call. The wheel (1.52) is not Debian's program
    (1.51): they speak a few ms apart, so a labelled corpus is spoken by this, not relabelled."""
    from transformers_drama3.prompting.phonemes import speak_in_fresh_process

    parts, phonemes, offset = [], [], 0
    for call in espeak_calls(directed_text, voice):
        samples, starts = (np.zeros(call, dtype=np.int16), []) if isinstance(call, int) else speak_in_fresh_process(*call)
        phonemes += [(symbol, offset + start) for symbol, start in starts]
        parts.append(samples)
        offset += len(samples)
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)), phonemes


def write_wav(path: Path, samples: np.ndarray) -> None:
    """16-bit mono PCM WAV at SAMPLING_RATE with a deterministic header."""
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLING_RATE)
        out.writeframes(samples.astype("<i2").tobytes())


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """A corpus WAV as float32 samples in [-1, 1] [time] at the corpus rate, and that rate."""
    return read_audio(path, SAMPLING_RATE, str(path)), SAMPLING_RATE


# ---- the corpus ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One manifest line. `reference_id` names a different utterance of the same voice."""

    id: str
    speaker: int  # index into the corpus's voice list, 0..N-1
    voice: str  # voice letter, see VOICES
    voice_spec: str  # espeak-ng options of the voice
    sentence_id: str  # the same held-out sentence has the same id in every voice
    language: str  # "en" or the tag name of a second language, e.g. "spanish"
    directions: tuple[str, ...]  # e.g. ("slow", "pause", "whisper")
    directed_text: str  # what the TTS model reads, with directions
    transcript: str  # the plain words
    wav: str  # path relative to the corpus directory
    split: str  # "train" or "heldout"
    reference_id: str = ""
    num_samples: int = 0
    duration: float = 0.0
    sampling_rate: int = SAMPLING_RATE


GRAMMARS = {1: english_sentence, 2: english_utterance}
"""English grammar by version: 1 writes full sentences (the corpora of drama3-tiny's first
release); 2 writes utterances from one word up (`sentences.UTTERANCE_LENGTHS`)."""
MIN_DIRECTED_WORDS = 3
UNIQUE_WORDS = 4
"""Grammar 2 repeats utterances of fewer words (there are only so many one-word utterances);
longer ones, and every grammar-1 sentence, are distinct across the corpus."""
EVALUATED = frozenset(
    tuple(normalize_text(text)) for text in (*HELDOUT_SENTENCES, *(t for group in LENGTH_PROBES.values() for t in group))
)
"""What the evaluations ask the model to say (`drama3 eval`, `intelligibility_levers lm`): never in a corpus."""


def direct(sentence: str, rng: random.Random, whisper_allowed: bool = True) -> tuple[str, tuple[str, ...]]:
    """Add one or two random directions to a sentence; returns (directed text, direction names)."""
    words = sentence.split()
    kinds = ["style", "pause"] + (["whisper"] if whisper_allowed and len(words) >= 4 else [])
    chosen = set(rng.sample(kinds, k=rng.choice((1, 1, 2))))
    names = []
    if "whisper" in chosen:
        start = rng.randint(0, len(words) - 2)
        end = start + rng.randint(2, min(5, len(words) - start))
        words[start] = "<whisper>" + words[start]
        words[end - 1] = words[end - 1] + "</whisper>"
        names.append("whisper")
    if "pause" in chosen:
        words.insert(rng.randint(1, len(words) - 1), "[pause]")
        names.append("pause")
    text = " ".join(words)
    if "style" in chosen:
        style = rng.choice(sorted(STYLES))
        text = f"({style}) {text}"
        names.insert(0, style)
    return text, tuple(names)


def _wrap_language(text: str, language: str) -> str:
    """`(style) words` -> `(style) <language>words</language>`: the style stays outside the tag."""
    match = re.match(r"((?:\(\w+\)\s*)*)(.*)", text)
    return f"{match.group(1)}<{language}>{match.group(2)}</{language}>"


def plan_corpus(
    seed: int,
    utterances_per_voice: int,
    heldout_sentences: int = 40,
    voices: Sequence[Voice] = VOICES,
    direction_rate: float = 0.35,
    spanish_rate: float = 0.1,
    grammar: int = 1,
) -> list[Record]:
    """The records of a corpus (no audio yet), a pure function of the arguments.

    Held-out sentences are plain English full sentences, spoken by every voice, and never appear
    in train. Train sentences are distinct across the whole corpus (grammar 2: those of at least
    `UNIQUE_WORDS` words); a share is Spanish (`<spanish>` tag) and a share carries directions
    (never on utterances under `MIN_DIRECTED_WORDS` words). With grammar 2 nothing the evaluations
    ask for (`EVALUATED`) is in train. Every record's reference is a different train utterance of
    the same voice, preferring plain English ones (a clean view of the voice).
    """
    if utterances_per_voice < 2:
        raise ValueError(f"utterances_per_voice must be >= 2 (a reference must differ from its target); got {utterances_per_voice}")
    if grammar not in GRAMMARS:
        raise ValueError(f"grammar must be one of {sorted(GRAMMARS)}; got {grammar}")
    english = GRAMMARS[grammar]
    rng = random.Random(seed)
    heldout: list[str] = []
    while len(heldout) < heldout_sentences:
        sentence = english_sentence(rng)
        if sentence not in heldout:
            heldout.append(sentence)
    used = set(heldout)

    def fresh(sentence: str) -> bool:
        if grammar == 1:
            return sentence not in used
        if tuple(normalize_text(sentence)) in EVALUATED:
            return False
        return len(sentence.split()) < UNIQUE_WORDS or sentence not in used

    records: list[Record] = []
    for speaker, voice in enumerate(voices):
        for index in range(utterances_per_voice):
            spanish = rng.random() < spanish_rate
            sentence = spanish_sentence(rng) if spanish else english(rng)
            for _ in range(1000):
                if fresh(sentence):
                    break
                sentence = spanish_sentence(rng) if spanish else english(rng)
            else:
                raise RuntimeError("the sentence grammar ran out of new sentences; lower utterances_per_voice")
            used.add(sentence)
            text, directions = sentence, ()
            if rng.random() < direction_rate and len(sentence.split()) >= MIN_DIRECTED_WORDS:
                text, directions = direct(sentence, rng, whisper_allowed=not spanish)
            if spanish:
                text = _wrap_language(text, "spanish")
            utterance_id = f"{voice.name}-train-{index:05d}"
            records.append(
                Record(
                    id=utterance_id, speaker=speaker, voice=voice.name, voice_spec=voice.spec,
                    sentence_id=f"train-{voice.name}-{index:05d}", language="spanish" if spanish else "en",
                    directions=directions, directed_text=text, transcript=plain_transcript(text),
                    wav=f"wavs/{utterance_id}.wav", split="train",
                )
            )
        for index, sentence in enumerate(heldout):
            utterance_id = f"{voice.name}-heldout-{index:05d}"
            records.append(
                Record(
                    id=utterance_id, speaker=speaker, voice=voice.name, voice_spec=voice.spec,
                    sentence_id=f"heldout-{index:05d}", language="en", directions=(),
                    directed_text=sentence, transcript=sentence, wav=f"wavs/{utterance_id}.wav", split="heldout",
                )
            )
    return _assign_references(records, rng)


def _assign_references(records: list[Record], rng: random.Random) -> list[Record]:
    by_voice: dict[str, list[Record]] = {}
    for record in records:
        if record.split == "train":
            by_voice.setdefault(record.voice, []).append(record)
    assigned = []
    for record in records:
        pool = by_voice[record.voice]
        clean = [r for r in pool if r.id != record.id and not r.directions and r.language == "en"]
        candidates = clean or [r for r in pool if r.id != record.id]
        assigned.append(replace(record, reference_id=rng.choice(candidates).id))
    return assigned


def render_record(record: Record, out_dir: str | Path) -> Record:
    """Synthesise one record to `out_dir/record.wav`; returns it with its length filled in."""
    samples = synthesize(record.directed_text, VOICES_BY_NAME[record.voice])
    write_wav(Path(out_dir) / record.wav, samples)
    return replace(record, num_samples=len(samples), duration=round(len(samples) / SAMPLING_RATE, 4))


def build_corpus(
    out_dir: str | Path,
    seed: int,
    utterances_per_voice: int,
    heldout_sentences: int = 40,
    voices: Sequence[Voice] = VOICES,
    direction_rate: float = 0.35,
    spanish_rate: float = 0.1,
    jobs: int = 1,
    progress: bool = True,
    grammar: int = 1,
) -> list[Record]:
    """Plan and synthesise a corpus into `out_dir` (wavs/ + manifest.jsonl); returns its records."""
    if not espeak_available():
        raise RuntimeError(f"{ESPEAK} is not on PATH; {INSTALL_HINT}")
    unknown = [v.name for v in voices if VOICES_BY_NAME.get(v.name) != v]
    if unknown:
        raise ValueError(f"voices {unknown} are not in VOICES; add them there so records can be re-rendered")
    out_dir = Path(out_dir)
    (out_dir / "wavs").mkdir(parents=True, exist_ok=True)
    planned = plan_corpus(seed, utterances_per_voice, heldout_sentences, voices, direction_rate, spanish_rate, grammar)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # espeak runs as subprocesses
        rendered = list(
            tqdm(pool.map(lambda r: render_record(r, out_dir), planned), total=len(planned),
                 desc="espeak-ng", unit="utt", disable=not progress)
        )
    write_manifest(out_dir / "manifest.jsonl", rendered)
    return rendered


def write_manifest(path: str | Path, records: Sequence[Record]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(asdict(record), ensure_ascii=False, sort_keys=True) + "\n")


def read_manifest(path: str | Path) -> list[Record]:
    """Records of a manifest.jsonl written by `build_corpus`."""
    records = []
    with open(path, encoding="utf-8") as source:
        for line in source:
            fields = json.loads(line)
            fields["directions"] = tuple(fields["directions"])
            records.append(Record(**fields))
    return records


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.drama3_tiny.corpus", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="synthesise a corpus into OUT_DIR")
    build.add_argument("out_dir")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--utterances-per-voice", type=int, default=400, help="train utterances per voice")
    build.add_argument("--heldout-sentences", type=int, default=40, help="held-out sentences, each in every voice")
    build.add_argument("--voices", default=",".join(v.name for v in VOICES), help="voice letters, e.g. A,B,D,F")
    build.add_argument("--direction-rate", type=float, default=0.35, help="share of train utterances with directions")
    build.add_argument("--spanish-rate", type=float, default=0.1, help="share of train utterances in Spanish")
    build.add_argument("--jobs", type=int, default=1, help="espeak processes at once (output does not depend on it)")
    build.add_argument("--grammar", type=int, default=1, choices=sorted(GRAMMARS),
                       help="English grammar: 1 full sentences (the first release), 2 utterances from one word up")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.voices.split(",") if n.strip()]
    unknown = [n for n in names if n not in VOICES_BY_NAME]
    if unknown:
        parser.error(f"--voices: unknown {unknown}; expected letters from {sorted(VOICES_BY_NAME)}")
    if not espeak_available():
        parser.error(f"{ESPEAK} is not on PATH; {INSTALL_HINT}")
    records = build_corpus(
        args.out_dir, args.seed, args.utterances_per_voice, args.heldout_sentences,
        [VOICES_BY_NAME[n] for n in names], args.direction_rate, args.spanish_rate, args.jobs, grammar=args.grammar,
    )
    hours = sum(r.duration for r in records) / 3600
    print(f"{len(records)} utterances, {hours:.2f} h of audio -> {Path(args.out_dir) / 'manifest.jsonl'}")


if __name__ == "__main__":
    main()
