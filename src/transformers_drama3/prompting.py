"""The script model and the "reference-bracket-v1" prompt layout of Drama 3.

A *script* says what should be spoken: lines bound to speakers 0-15, voice references (a
transcript and its audio, several per speaker allowed), earlier takes kept in context for a
revision, inline tags. This module turns scripts into *layouts*: lists of segments, each segment
either a literal (text and special tokens, tokenized on its own) or a run of audio frames.
`encode_layout` turns a layout into model rows with a tokenizer. Audio is handled by the caller
(the processor): every clip reaches this module through a `LayoutContext.codes_of` callback
that returns codes `[num_codebooks, frames]`.

Published layout (spec §4, both public implementations agree), used by `Script`:

    <|im_start|>system\\n
      "convert the provided text to speech"                               (no references)
      "convert the provided text to speech reference to the following:"  (references)
      per reference i (1-based): "\\n\\n[Reference i]\\nText: " <|speaker:N|> " transcript\\nSpeech: " frames
    <|im_end|>\\n
    per history take: <|im_start|>user\\n <lines> <|im_end|>\\n
                      <|im_start|>assistant\\n<|voice|> frames <|im_end|>\\n
    <|im_start|>user\\n <lines> <|im_end|>\\n
    <|im_start|>assistant\\n<|voice|>

where <lines> is `<|speaker:N|> text` per line, lines joined by "\\n". Each literal is tokenized on
its own: joining the string first would change ids at the seams.

Layouts designed from the paper (no public code has them; see docs/prompt_layouts.md):
`LineByLineScript` (lines and audio segments separated by `<|audio_separator|>`; also the
multi-character scene layout), `Infill` (speech infilling) and `StreamingScript` (streaming text
input, each turn = current chunk + one look-ahead chunk).

Text conventions designed here (the paper names the features, no public code spells them):
a style prefix is written "(style) ", a director's note "[note] ", a revision instruction
"[instruction] " before the first line, a language tag wraps the line in `<language>...</language>`.
Point tags `[laughs]` and scoped tags `<whisper>...</whisper>` are written by the user in the text.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

import numpy as np
import torch

# ---- the vocabulary of the layout ---------------------------------------------------------------

TEMPLATE_VERSION = "reference-bracket-v1"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VOICE = "<|voice|>"
TEXT = "<|text|>"
INTERLEAVE = "<|interleave|>"
AUDIO_SEPARATOR = "<|audio_separator|>"
NUM_SPEAKERS = 16
MAX_SPEAKER = NUM_SPEAKERS - 1
NUM_CODEBOOKS = 10
CODEBOOK_SIZE = 4096
TTS_INSTRUCTION = "convert the provided text to speech"
REFERENCE_INSTRUCTION = "convert the provided text to speech reference to the following:"
IGNORE_INDEX = -100

# Long text (spec §4): about this many UTF-8 bytes of text per chunk, at most this many speakers.
CHUNK_BYTES = 300
CHUNK_SPEAKERS = 3
# References longer than this are refused: they crowd the context and the paper's data never has them.
MAX_REFERENCE_SECONDS = 60.0


def speaker_token(speaker: int) -> str:
    return f"<|speaker:{speaker}|>"


def semantic_token(code: int) -> str:
    return f"<|semantic:{code}|>"


# Unicode White_Space. str.strip() would also strip the separators U+001C..U+001F.
WHITE_SPACE = "\t\n\v\f\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
LINE_BREAKS = "\n\r\v\f\x85\u2028\u2029"
_LINE_BREAK_RUN = re.compile(f"[{re.escape(WHITE_SPACE)}]*[{re.escape(LINE_BREAKS)}][{re.escape(WHITE_SPACE)}]*")
# Anything spelled like a special token; user text may never contain one.
_SPECIAL_LIKE = re.compile(r"<\|.*?\|>", re.S)
# Speaker tags in raw text: the digits are checked separately so 16 or 01 get a clear error.
_SPEAKER_TAG = re.compile(r"<\|speaker:([^|>]*)\|>")
_SCOPED_TAG = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9_-]*)>")
_POINT_TAG = re.compile(r"\[[^\[\]]*\]")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


# ---- text checks ----------------------------------------------------------------------------------


def strip_white_space(text: str) -> str:
    return text.strip(WHITE_SPACE)


def flatten_line_breaks(text: str) -> str:
    """Each white-space run holding a line break becomes one space; the ends are stripped.

    A line break inside a turn would look like the end of a message to the model."""
    return strip_white_space(_LINE_BREAK_RUN.sub(" ", text))


def check_speaker(speaker: Any, location: str) -> int:
    if isinstance(speaker, bool) or not isinstance(speaker, (int, np.integer)):
        raise ValueError(f"{location}: speaker must be an int in 0..{MAX_SPEAKER}; got {speaker!r}")
    if not 0 <= int(speaker) <= MAX_SPEAKER:
        raise ValueError(
            f"{location}: speaker {int(speaker)} is out of range; the tokenizer has speakers 0..{MAX_SPEAKER}"
        )
    return int(speaker)


def check_no_special_tokens(text: str, location: str) -> None:
    """Refuse text that spells a special token: only the layout writes structure."""
    match = _SPECIAL_LIKE.search(text)
    if match is not None:
        raise ValueError(
            f"{location}: {match.group(0)!r} is spelled like a special token; structural tokens "
            f"(<|im_start|>, <|semantic:N|>, <|speaker:N|>, ...) are written by the processor, never "
            f"taken from user text. Give speakers with Line(speaker=...) or a leading <|speaker:N|> tag "
            f"in raw text."
        )


def check_tags(text: str, location: str) -> None:
    """Scoped tags must nest and close; point tags must close and not nest."""
    stack: list[str] = []
    for match in _SCOPED_TAG.finditer(text):
        closing, name = match.group(1), match.group(2)
        if not closing:
            stack.append(name)
        elif not stack:
            raise ValueError(f"{location}: closing tag </{name}> has no opening <{name}>")
        elif stack[-1] != name:
            raise ValueError(f"{location}: closing tag </{name}> does not match the open <{stack[-1]}>")
        else:
            stack.pop()
    if stack:
        raise ValueError(f"{location}: scoped tag <{stack[-1]}> is never closed with </{stack[-1]}>")
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"{location}: point tags [...] cannot nest")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{location}: ']' closes no point tag")
    if depth:
        raise ValueError(f"{location}: point tag '[' is never closed with ']'")


def check_free_text(text: Any, location: str, allow_empty: bool = False) -> str:
    """Validate user text and return it with line breaks flattened and the ends stripped."""
    if not isinstance(text, str):
        raise ValueError(f"{location}: text must be a str; got {type(text).__name__}")
    check_no_special_tokens(text, location)
    flat = flatten_line_breaks(text)
    if not flat and not allow_empty:
        raise ValueError(f"{location}: text is empty")
    check_tags(flat, location)
    return flat


def _check_annotation(value: str | None, location: str, forbidden: str) -> str | None:
    if value is None:
        return None
    flat = check_free_text(value, location)
    bad = [char for char in forbidden if char in flat]
    if bad:
        raise ValueError(f"{location}: {bad[0]!r} is not allowed here; got {value!r}")
    return flat


# ---- audio given three ways -----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # compared by identity: tensors have no single truth value
class Clip:
    """Audio given as precomputed codes `[num_codebooks, frames]`, a waveform, or a file path / URL.

    `waveform` is `[samples]` or `[channels, samples]` float at `sampling_rate` (the codec's rate
    when None)."""

    codes: torch.Tensor | None = None
    waveform: np.ndarray | torch.Tensor | None = None
    sampling_rate: int | None = None
    path: str | None = None

    def __post_init__(self):
        given = sum(value is not None for value in (self.codes, self.waveform, self.path))
        if given != 1:
            raise ValueError(f"a Clip needs exactly one of codes, waveform or path; got {given}")


AudioLike = Union[Clip, torch.Tensor, np.ndarray, str, os.PathLike]


def as_clip(audio: AudioLike, location: str, sampling_rate: int | None = None) -> Clip:
    """Integer arrays are codes `[num_codebooks, frames]`; float arrays are waveforms; strings are paths."""
    if isinstance(audio, Clip):
        return audio
    if isinstance(audio, (str, os.PathLike)):
        return Clip(path=os.fspath(audio))
    if isinstance(audio, np.ndarray):
        audio = torch.from_numpy(audio) if audio.dtype.kind in "iu" else audio
    if isinstance(audio, torch.Tensor) and not audio.is_floating_point():
        return Clip(codes=audio)
    if isinstance(audio, (torch.Tensor, np.ndarray)):
        return Clip(waveform=audio, sampling_rate=sampling_rate)
    raise ValueError(
        f"{location}: audio must be codes (an int tensor [num_codebooks, frames]), a float waveform, "
        f"a path or a Clip; got {type(audio).__name__}"
    )


def check_codes(codes: Any, num_codebooks: int, codebook_size: int, location: str) -> torch.Tensor:
    """Codes as an int64 CPU tensor `[num_codebooks, frames]` with at least one frame."""
    if isinstance(codes, np.ndarray):
        codes = torch.from_numpy(codes)
    if not isinstance(codes, torch.Tensor) or codes.is_floating_point() or codes.dtype == torch.bool:
        raise ValueError(f"{location}: codes must be an integer tensor [num_codebooks, frames]")
    if codes.ndim != 2 or codes.shape[0] != num_codebooks or codes.shape[1] == 0:
        raise ValueError(
            f"{location}: codes must be [{num_codebooks}, frames] with at least one frame; "
            f"got {tuple(codes.shape)}"
        )
    if int(codes.min()) < 0 or int(codes.max()) >= codebook_size:
        raise ValueError(f"{location}: codes must lie in [0, {codebook_size})")
    return codes.to(device="cpu", dtype=torch.long)


# ---- the script model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One line to speak.

    Args:
        text: what to say, with optional point tags `[laughs]` and scoped tags `<whisper>..</whisper>`.
        speaker: 0-15; rendered as the `<|speaker:N|>` token before the line.
        style: a style prefix for the whole line, rendered "(style) " (e.g. "fast", "angry").
        note: a director's note in free language, rendered "[note] " before the text.
        language: a language tag, rendered `<language>text</language>` (e.g. "french"); experimental
            in the published model.
    """

    text: str
    speaker: int = 0
    style: str | None = None
    note: str | None = None
    language: str | None = None

    def checked(self, location: str) -> Line:
        """The line with its text normalised, or a ValueError naming `location`."""
        if not isinstance(self, Line):
            raise ValueError(f"{location}: expected a Line or a str; got {type(self).__name__}")
        language = self.language
        if language is not None and not _NAME.fullmatch(language):
            raise ValueError(f"{location}: language must be a tag name like 'french'; got {language!r}")
        return Line(
            text=check_free_text(self.text, f"{location}.text"),
            speaker=check_speaker(self.speaker, f"{location}.speaker"),
            style=_check_annotation(self.style, f"{location}.style", "()[]"),
            note=_check_annotation(self.note, f"{location}.note", "[]"),
            language=language,
        )

    def body(self, instruction: str | None = None) -> str:
        """The text after the speaker token, decorations included."""
        text = f"<{self.language}>{self.text}</{self.language}>" if self.language else self.text
        if self.note:
            text = f"[{self.note}] {text}"
        if self.style:
            text = f"({self.style}) {text}"
        if instruction:
            text = f"[{instruction}] {text}"
        return text


def parse_text(text: str, location: str = "text", default_speaker: int = 0) -> tuple[Line, ...]:
    """Raw text with optional `<|speaker:N|>` tags -> lines.

    Text before the first tag belongs to `default_speaker`; empty turns are dropped. Any other
    special-token spelling is refused."""
    if not isinstance(text, str):
        raise ValueError(f"{location}: text must be a str; got {type(text).__name__}")
    lines = []
    speaker, start = default_speaker, 0
    for match in [*_SPEAKER_TAG.finditer(text), None]:
        end = match.start() if match is not None else len(text)
        piece = text[start:end]
        check_no_special_tokens(piece, location)
        if strip_white_space(piece):
            lines.append(Line(piece, speaker).checked(f"{location} (turn {len(lines)})"))
        if match is not None:
            digits = match.group(1)
            if not digits.isdigit() or digits != str(int(digits)) or int(digits) > MAX_SPEAKER:
                raise ValueError(
                    f"{location}: {match.group(0)!r} is not a speaker tag; use <|speaker:0|> .. "
                    f"<|speaker:{MAX_SPEAKER}|> without leading zeros"
                )
            speaker, start = int(digits), match.end()
    if not lines:
        raise ValueError(f"{location}: text is empty")
    return tuple(lines)


def as_lines(lines: str | Line | Sequence[Line | str], location: str) -> tuple[Line, ...]:
    if isinstance(lines, str):
        return parse_text(lines, location)
    if isinstance(lines, Line):
        lines = [lines]
    if not isinstance(lines, Sequence) or not lines:
        raise ValueError(f"{location}: give a str, a Line or a non-empty list of lines")
    result: list[Line] = []
    for index, line in enumerate(lines):
        if isinstance(line, str):
            result.extend(parse_text(line, f"{location}[{index}]"))
        elif isinstance(line, Line):
            result.append(line.checked(f"{location}[{index}]"))
        else:
            raise ValueError(f"{location}[{index}]: expected a Line or a str; got {type(line).__name__}")
    return tuple(result)


@dataclass(frozen=True)
class Reference:
    """A voice reference: what is said (`transcript`) and how it sounds (`audio`), bound to `speaker`.

    `audio` is codes `[num_codebooks, frames]` (int), a float waveform (at `sampling_rate`, the
    codec's rate when None), a file path, or a `Clip`."""

    transcript: str
    audio: AudioLike
    speaker: int = 0
    sampling_rate: int | None = None

    def checked(self, location: str) -> Reference:
        return Reference(
            transcript=check_free_text(self.transcript, f"{location}.transcript"),
            audio=as_clip(self.audio, f"{location}.audio", self.sampling_rate),
            speaker=check_speaker(self.speaker, f"{location}.speaker"),
        )


@dataclass(frozen=True)
class Take:
    """An earlier turn kept in context: the lines that were asked for and the audio that came back."""

    lines: str | Line | Sequence[Line | str]
    audio: AudioLike
    sampling_rate: int | None = None

    def checked(self, location: str) -> Take:
        return Take(
            lines=as_lines(self.lines, f"{location}.lines"),
            audio=as_clip(self.audio, f"{location}.audio", self.sampling_rate),
        )


# ---- segments and layouts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Special:
    """A special token written by the layout; `supervised` marks it as the model's own output."""

    token: str
    supervised: bool = False


@dataclass(frozen=True)
class Literal:
    """Text and special tokens tokenized on their own (adjacent text parts are joined first)."""

    parts: tuple[str | Special, ...]


@dataclass(frozen=True, eq=False)
class Frames:
    """Audio rows: codes `[num_codebooks, frames]`."""

    codes: torch.Tensor
    supervised: bool = False


Segment = Union[Literal, Frames]


@dataclass(frozen=True)
class LayoutContext:
    """What a layout needs from the processor: audio -> checked codes, and the codec's frame rate.

    `codes_of(clip, location, is_reference)` returns int64 codes `[num_codebooks, frames]`."""

    codes_of: Callable[[Clip, str, bool], torch.Tensor]
    frame_rate: float


def _turn_start(role: str) -> Literal:
    return Literal((Special(IM_START), f"{role}\n"))


_TURN_END = Literal((Special(IM_END), "\n"))
_SUPERVISED_TURN_END = Literal((Special(IM_END, supervised=True), "\n"))
_VOICE_START = Literal((Special(IM_START), "assistant\n", Special(VOICE)))


def lines_parts(
    lines: Sequence[Line], separator: Special | str = "\n", instruction: str | None = None
) -> list[str | Special]:
    """`<|speaker:N|> body` per line, lines joined by `separator`."""
    parts: list[str | Special] = []
    for index, line in enumerate(lines):
        if index:
            parts.append(separator)
        parts += [Special(speaker_token(line.speaker)), " " + line.body(instruction if index == 0 else None)]
    return parts


def system_segments(references: Sequence[Reference], context: LayoutContext) -> list[Segment]:
    segments: list[Segment] = [_turn_start("system"), Literal((REFERENCE_INSTRUCTION if references else TTS_INSTRUCTION,))]
    for index, reference in enumerate(references):
        segments.append(
            Literal(
                (
                    f"\n\n[Reference {index + 1}]\nText: ",
                    Special(speaker_token(reference.speaker)),
                    f" {reference.transcript}\nSpeech: ",
                )
            )
        )
        segments.append(Frames(context.codes_of(reference.audio, f"references[{index}].audio", True)))
    segments.append(_TURN_END)
    return segments


def user_segments(parts: list[str | Special]) -> list[Segment]:
    return [_turn_start("user"), Literal(tuple(parts)), _TURN_END]


def take_segments(lines: Sequence[Line], codes: torch.Tensor, supervised: bool) -> list[Segment]:
    end = _SUPERVISED_TURN_END if supervised else _TURN_END
    return [*user_segments(lines_parts(lines)), _VOICE_START, Frames(codes, supervised), end]


def _check_reference_speakers(
    references: Sequence[Reference], line_groups: Sequence[tuple[str, Sequence[Line]]]
) -> None:
    """With references, every speaker that speaks must have one (a voice the model can copy)."""
    if not references:
        return
    known = sorted({reference.speaker for reference in references})
    for location, lines in line_groups:
        for index, line in enumerate(lines):
            if line.speaker not in known:
                raise ValueError(
                    f"{location}[{index}]: speaker {line.speaker} has no reference (references cover "
                    f"speakers {known}); add a Reference for it, or pass strict_speakers=False to let "
                    f"the model invent that voice"
                )


def _checked_common(request) -> None:
    object.__setattr__(
        request,
        "references",
        tuple(as_reference(reference, f"references[{index}]") for index, reference in enumerate(request.references)),
    )


def as_reference(reference: Any, location: str) -> Reference:
    if not isinstance(reference, Reference):
        raise ValueError(f"{location}: expected a Reference; got {type(reference).__name__}")
    return reference.checked(location)


def as_take(take: Any, location: str) -> Take:
    if not isinstance(take, Take):
        raise ValueError(f"{location}: expected a Take; got {type(take).__name__}")
    return take.checked(location)


@dataclass(frozen=True)
class Script:
    """A request in the published layout: references, history takes, then the lines to speak.

    Args:
        lines: raw text (with optional `<|speaker:N|>` tags), a `Line`, or a list of lines/strings.
            All lines go into one user turn, joined by "\\n" (a multi-speaker dialogue).
        references: voice references; several per speaker allowed; rendered in order, 1-based.
        history: earlier takes kept in context (multi-turn revision, or the long-text chunk history).
        instruction: a relative instruction for a revision, e.g. "softer than the previous take",
            rendered "[instruction] " before the first line.
        target: the assistant's audio, for training rows (then `labels` supervise it); None for a
            generation prompt that ends with `<|im_start|>assistant\\n<|voice|>`.
        strict_speakers: with references, refuse lines whose speaker has none (default True).
    """

    lines: str | Line | Sequence[Line | str]
    references: Sequence[Reference] = ()
    history: Sequence[Take] = ()
    instruction: str | None = None
    target: AudioLike | None = None
    strict_speakers: bool = True

    def __post_init__(self):
        _checked_common(self)
        set_ = object.__setattr__
        set_(self, "lines", as_lines(self.lines, "lines"))
        set_(self, "history", tuple(as_take(take, f"history[{index}]") for index, take in enumerate(self.history)))
        set_(self, "instruction", _check_annotation(self.instruction, "instruction", "[]"))
        if self.target is not None:
            set_(self, "target", self._checked_target(self.target))
        if self.strict_speakers:
            groups = [("lines", self.lines)] + [(f"history[{i}].lines", t.lines) for i, t in enumerate(self.history)]
            _check_reference_speakers(self.references, groups)

    def _checked_target(self, target: Any) -> Any:
        return as_clip(target, "target")

    def layout(self, context: LayoutContext) -> list[Segment]:
        segments = system_segments(self.references, context)
        for index, take in enumerate(self.history):
            segments += take_segments(take.lines, context.codes_of(take.audio, f"history[{index}].audio", False), False)
        segments += user_segments(lines_parts(self.lines, instruction=self.instruction))
        segments.append(_VOICE_START)
        if self.target is not None:
            segments += [Frames(context.codes_of(self.target, "target", False), supervised=True), _SUPERVISED_TURN_END]
        return segments

    def chunks(self, max_bytes: int = CHUNK_BYTES, max_speakers: int = CHUNK_SPEAKERS) -> list[Script]:
        """Long text as a list of scripts, one per chunk (spec §4), same references and instruction.

        Generate them in order; give chunk k the history `long_text_history(takes)` of the takes
        made so far (the first chunk's take and the previous one's). A target cannot be chunked."""
        if self.target is not None:
            raise ValueError("target: a script with a target cannot be chunked; align the audio per chunk yourself")
        return [
            Script(
                lines=chunk,
                references=self.references,
                history=self.history,
                instruction=self.instruction,
                strict_speakers=self.strict_speakers,
            )
            for chunk in chunk_lines(self.lines, max_bytes, max_speakers)
        ]

    def with_history(self, history: Sequence[Take]) -> Script:
        return Script(
            self.lines, self.references, tuple(history), self.instruction, self.target, self.strict_speakers
        )


def long_text_history(takes: Sequence[Take]) -> tuple[Take, ...]:
    """History for the next chunk of a long text: the first chunk's take and the previous one's."""
    if not takes:
        return ()
    if len(takes) == 1:
        return (takes[0],)
    return (takes[0], takes[-1])


def speaker_turns(script: Script) -> list[tuple[int, Script]]:
    """A scene as single-speaker cloning requests, one per speaker turn, in order.

    A speaker turn is a maximal run of consecutive lines of one speaker. Its request holds only
    that speaker's references and the turn's lines, both renumbered to speaker 0 (text, tags and
    directions unchanged), and the script's instruction. Returns (the script's speaker, request)
    pairs. With references, every speaker must have one; a script with several speakers must have
    references; a script with history takes cannot be split (the takes mix the speakers)."""
    if script.history:
        raise ValueError(
            "history: a scene spoken turn by turn cannot keep history takes (they mix speakers); "
            "speak it jointly (scene='joint')"
        )
    speakers = sorted({line.speaker for line in script.lines})
    covered = sorted({reference.speaker for reference in script.references})
    if not covered and len(speakers) > 1:
        raise ValueError(
            f"references: speaking turn by turn clones each speaker from its own references, but this script "
            f"has speakers {speakers} and no references; give a Reference per speaker, or speak it jointly "
            f"(scene='joint')"
        )
    for index, line in enumerate(script.lines):
        if covered and line.speaker not in covered:
            raise ValueError(
                f"lines[{index}]: speaker {line.speaker} has no reference; speaking turn by turn clones each "
                f"speaker from its own references (references cover speakers {covered}); add a Reference "
                f"with speaker={line.speaker}"
            )
    turns = []
    for speaker, run in itertools.groupby(script.lines, key=lambda line: line.speaker):
        own = [reference for reference in script.references if reference.speaker == speaker]
        references = tuple(replace(reference, speaker=0) for reference in own)
        lines = tuple(replace(line, speaker=0) for line in run)
        turns.append((speaker, Script(lines, references, instruction=script.instruction)))
    return turns


@dataclass(frozen=True)
class LineByLineScript(Script):
    """Line-by-line synthesis and multi-character scenes (designed from the paper).

    All lines go into one user turn separated by `<|audio_separator|>`; the assistant answers with
    one audio segment per line, segments separated by `<|audio_separator|>`, then `<|im_end|>`.
    Since every line is in context at once, each line can use the later lines and the scene (the
    paper's "multi-character scene" data). `target` is a list of per-line audio: all of them for a
    training example; the first k of them to continue generation at line k + 1 (the rows then end
    with the separator after segment k). Generation draws the separators between the remaining
    lines and reports where each line starts (`generate(..., audio_separator_token_id=...)`).
    """

    def _checked_target(self, target: Any) -> Any:
        if not isinstance(target, Sequence) or isinstance(target, (str, bytes)):
            raise ValueError("target: a LineByLineScript takes a list of per-line audio")
        if len(target) > len(self.lines):
            raise ValueError(f"target: {len(target)} audio segments for {len(self.lines)} lines")
        return tuple(as_clip(segment, f"target[{index}]") for index, segment in enumerate(target))

    def layout(self, context: LayoutContext) -> list[Segment]:
        segments = system_segments(self.references, context)
        for index, take in enumerate(self.history):
            segments += take_segments(take.lines, context.codes_of(take.audio, f"history[{index}].audio", False), False)
        segments += user_segments(lines_parts(self.lines, Special(AUDIO_SEPARATOR), self.instruction))
        segments.append(_VOICE_START)
        target = self.target or ()
        for index, clip in enumerate(target):
            segments.append(Frames(context.codes_of(clip, f"target[{index}]", False), supervised=True))
            if index + 1 < len(self.lines):
                segments.append(Literal((Special(AUDIO_SEPARATOR, supervised=True),)))
        if len(target) == len(self.lines):
            segments.append(_SUPERVISED_TURN_END)
        return segments

    def chunks(self, max_bytes: int = CHUNK_BYTES, max_speakers: int = CHUNK_SPEAKERS) -> list[Script]:
        if self.target:
            raise ValueError("target: a script with a target cannot be chunked; align the audio per chunk yourself")
        return [
            LineByLineScript(
                lines=chunk,
                references=self.references,
                history=self.history,
                instruction=self.instruction,
                strict_speakers=self.strict_speakers,
            )
            for chunk in chunk_lines(self.lines, max_bytes, max_speakers)
        ]


# A scene is a line-by-line script whose lines have several speakers, all given at once.
SceneScript = LineByLineScript


@dataclass(frozen=True)
class Infill:
    """Speech infilling (designed from the paper): regenerate one window of a recording.

    The user turn holds the full new transcript. The assistant turn keeps the source frames after
    the window, then `<|audio_separator|>`, then the source frames before it; the model continues
    from the prefix with the new middle and ends with `<|im_end|>`:

        <|im_start|>assistant\\n<|voice|> suffix <|audio_separator|> prefix [middle] <|im_end|>

    Putting the suffix first lets a causal model see what it must join up with, while the middle
    still directly continues the prefix. Decode prefix + middle + suffix together
    (`assemble_infill`), never paste waveforms.

    The window is given either on `source` (`start`/`end` in `unit` "seconds" or "frames"; the
    window is widened to whole frames), or as `prefix` and `suffix` audio. `target` is the middle
    audio, for training rows.
    """

    lines: str | Line | Sequence[Line | str]
    source: AudioLike | None = None
    start: float | None = None
    end: float | None = None
    unit: str = "seconds"
    prefix: AudioLike | None = None
    suffix: AudioLike | None = None
    references: Sequence[Reference] = ()
    target: AudioLike | None = None
    strict_speakers: bool = True

    def __post_init__(self):
        _checked_common(self)
        set_ = object.__setattr__
        set_(self, "lines", as_lines(self.lines, "lines"))
        if self.unit not in ("seconds", "frames"):
            raise ValueError(f"unit: must be 'seconds' or 'frames'; got {self.unit!r}")
        by_window = self.source is not None
        by_audio = self.prefix is not None or self.suffix is not None
        if by_window == by_audio:
            raise ValueError("give either source with start/end, or prefix and/or suffix audio (not both)")
        if by_window:
            if self.start is None and self.end is None:
                raise ValueError("start/end: give the edit window on the source")
            if self.start is not None and self.end is not None and not self.start < self.end:
                raise ValueError(f"start/end: the window must not be empty; got start={self.start}, end={self.end}")
            if (self.start is not None and self.start < 0) or (self.end is not None and self.end < 0):
                raise ValueError("start/end: the window must not start before the source")
            set_(self, "source", as_clip(self.source, "source"))
        for name in ("prefix", "suffix", "target"):
            if getattr(self, name) is not None:
                set_(self, name, as_clip(getattr(self, name), name))
        if self.strict_speakers:
            _check_reference_speakers(self.references, [("lines", self.lines)])

    def window_frames(self, frames: int, frame_rate: float) -> tuple[int, int]:
        """The edit window on a source of `frames` frames, as [first, last) frame indices."""
        if self.unit == "seconds":
            first = 0 if self.start is None else math.floor(self.start * frame_rate)
            last = frames if self.end is None else math.ceil(self.end * frame_rate)
        else:
            first = 0 if self.start is None else int(self.start)
            last = frames if self.end is None else int(self.end)
        if first >= frames:
            raise ValueError(f"start: the window starts at frame {first}, past the source's {frames} frames")
        return first, min(last, frames)

    def kept_codes(self, context: LayoutContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The source codes kept before and after the window: (prefix, suffix), each `[K, frames]`."""
        if self.source is not None:
            source = context.codes_of(self.source, "source", False)
            first, last = self.window_frames(source.shape[1], context.frame_rate)
            prefix, suffix = source[:, :first], source[:, last:]
        else:
            prefix = context.codes_of(self.prefix, "prefix", False) if self.prefix is not None else None
            suffix = context.codes_of(self.suffix, "suffix", False) if self.suffix is not None else None
            empty = (prefix if prefix is not None else suffix)[:, :0]
            prefix = empty if prefix is None else prefix
            suffix = empty if suffix is None else suffix
        if prefix.shape[1] + suffix.shape[1] == 0:
            raise ValueError("the edit window covers the whole source; use a Script to speak it from scratch")
        return prefix, suffix

    def layout(self, context: LayoutContext) -> list[Segment]:
        prefix, suffix = self.kept_codes(context)
        segments = system_segments(self.references, context)
        segments += user_segments(lines_parts(self.lines))
        segments.append(_VOICE_START)
        if suffix.shape[1]:
            segments.append(Frames(suffix))
        segments.append(Literal((Special(AUDIO_SEPARATOR),)))
        if prefix.shape[1]:
            segments.append(Frames(prefix))
        if self.target is not None:
            segments += [Frames(context.codes_of(self.target, "target", False), supervised=True), _SUPERVISED_TURN_END]
        return segments


def assemble_infill(prefix: torch.Tensor, middle: torch.Tensor, suffix: torch.Tensor) -> torch.Tensor:
    """prefix + middle + suffix along frames; all `[num_codebooks, frames]`."""
    return torch.cat([prefix, middle.to(prefix.dtype), suffix], dim=1)


@dataclass(frozen=True)
class StreamingScript:
    """Streaming text input (designed from the paper): text arrives in chunks while audio plays.

    Turn k's user message holds chunk k, `<|interleave|>`, then chunk k + 1 as look-ahead (nothing
    after `<|interleave|>` once the text has ended); the assistant speaks chunk k only. `spoken[k]`
    is the audio already made for chunk k; the rows end with the voice turn of chunk len(spoken).
    All assistant turns are the model's own output, so with labels all of them are supervised
    (`spoken` doubles as the training target when it covers every chunk: then no open turn is left).
    """

    chunks: Sequence[str | Line | Sequence[Line | str]]
    references: Sequence[Reference] = ()
    spoken: Sequence[AudioLike] = ()
    strict_speakers: bool = True

    def __post_init__(self):
        _checked_common(self)
        set_ = object.__setattr__
        if isinstance(self.chunks, str) or not isinstance(self.chunks, Sequence) or not self.chunks:
            raise ValueError("chunks: give a non-empty list of text chunks")
        set_(self, "chunks", tuple(as_lines(chunk, f"chunks[{index}]") for index, chunk in enumerate(self.chunks)))
        if len(self.spoken) > len(self.chunks):
            raise ValueError(f"spoken: {len(self.spoken)} takes for {len(self.chunks)} chunks")
        set_(self, "spoken", tuple(as_clip(clip, f"spoken[{index}]") for index, clip in enumerate(self.spoken)))
        if self.strict_speakers:
            _check_reference_speakers(self.references, [(f"chunks[{i}]", c) for i, c in enumerate(self.chunks)])

    @classmethod
    def from_text(cls, text: str, references: Sequence[Reference] = (), max_bytes: int = CHUNK_BYTES, **kwargs):
        """Chunk a whole text as spec §4 and stream it chunk by chunk."""
        return cls(chunks=chunk_lines(parse_text(text), max_bytes), references=references, **kwargs)

    def turn_parts(self, index: int) -> list[str | Special]:
        parts = lines_parts(self.chunks[index]) + [Special(INTERLEAVE)]
        if index + 1 < len(self.chunks):
            parts += lines_parts(self.chunks[index + 1])
        return parts

    def layout(self, context: LayoutContext) -> list[Segment]:
        segments = system_segments(self.references, context)
        for index, clip in enumerate(self.spoken):
            segments += user_segments(self.turn_parts(index))
            segments += [_VOICE_START, Frames(context.codes_of(clip, f"spoken[{index}]", False), True), _SUPERVISED_TURN_END]
        if len(self.spoken) < len(self.chunks):
            segments += user_segments(self.turn_parts(len(self.spoken)))
            segments.append(_VOICE_START)
        return segments


Request = Union[Script, Infill, StreamingScript]


# ---- long text -----------------------------------------------------------------------------------------

_SENTENCE_ENDS = frozenset(".!?;。！？；…")
_CLAUSE_MARKS = frozenset(",:，：、")
_CLOSERS = frozenset("\"'”’」』)）")


def _is_cjk(char: str) -> bool:
    code = ord(char)
    return (
        0x3040 <= code <= 0x30FF  # kana
        or 0x3400 <= code <= 0x4DBF
        or 0x4E00 <= code <= 0x9FFF
        or 0xF900 <= code <= 0xFAFF
        or 0x20000 <= code <= 0x2FA1F
    )


def _protected_spans(text: str) -> list[tuple[int, int]]:
    """Point tags and outermost scoped-tag spans: never cut inside them."""
    spans = [match.span() for match in _POINT_TAG.finditer(text)]
    stack: list[int] = []
    for match in _SCOPED_TAG.finditer(text):
        if not match.group(1):
            stack.append(match.start())
        elif stack:
            start = stack.pop()
            if not stack:
                spans.append((start, match.end()))
    return spans


def _cut_levels(text: str) -> dict[int, int]:
    """Cut positions (a cut at i splits text[:i] | text[i:]) -> level: 0 sentence end, 1 clause
    mark, 2 white space, 3 between two CJK characters. Never inside a protected span, and never at
    a period between two digits (3.14)."""
    inside = np.zeros(len(text) + 1, dtype=bool)
    for start, end in _protected_spans(text):
        inside[start + 1 : end] = True
    levels: dict[int, int] = {}

    def offer(position: int, level: int) -> None:
        if 0 < position < len(text) and not inside[position]:
            levels[position] = min(level, levels.get(position, level))

    for index, char in enumerate(text):
        if char in _SENTENCE_ENDS or char in _CLAUSE_MARKS:
            if char == "." and 0 < index < len(text) - 1 and text[index - 1].isdigit() and text[index + 1].isdigit():
                continue
            after = index + 1
            while after < len(text) and (text[after] in _CLOSERS or text[after] in _SENTENCE_ENDS):
                after += 1
            offer(after, 0 if char in _SENTENCE_ENDS else 1)
        elif char in WHITE_SPACE:
            offer(index, 2)
        elif index and _is_cjk(char) and _is_cjk(text[index - 1]):
            offer(index, 3)
    return levels


def split_line_text(text: str, max_bytes: int, location: str = "text") -> list[str]:
    """Pieces of at most `max_bytes` UTF-8 bytes, cut at the furthest sentence end that fits, else
    the furthest clause mark, else white space, else between CJK characters; never inside a tag.
    Text with no cut point within `max_bytes` raises a ValueError naming `location`."""
    offsets = np.cumsum([0] + [len(char.encode("utf-8")) for char in text])  # byte offset of each char
    levels = _cut_levels(text)
    pieces: list[str] = []
    start = 0
    while offsets[-1] - offsets[start] > max_bytes:
        limit = int(np.searchsorted(offsets, offsets[start] + max_bytes, side="right")) - 1
        candidates = [(level, position) for position, level in levels.items() if start < position <= limit]
        if not candidates:
            snippet = text[start : start + 40]
            raise ValueError(
                f"{location}: no cut point within {max_bytes} bytes (a sentence end, clause mark or space "
                f"outside tags) from {snippet!r}...; add punctuation or spaces, or shorten the tag span"
            )
        best = min(level for level, _ in candidates)
        cut = max(position for level, position in candidates if level == best)
        piece = strip_white_space(text[start:cut])
        if piece:
            pieces.append(piece)
        start = cut
    last = strip_white_space(text[start:])
    if last:
        pieces.append(last)
    return pieces


def chunk_lines(
    lines: Sequence[Line], max_bytes: int = CHUNK_BYTES, max_speakers: int = CHUNK_SPEAKERS
) -> list[tuple[Line, ...]]:
    """Group lines into chunks of about `max_bytes` bytes of text and at most `max_speakers` speakers.

    A line longer than `max_bytes` is split (`split_line_text`); every piece keeps the line's
    speaker, style, note and language. Bytes count the line text only (speaker tokens and
    decorations excluded). Line breaks already became spaces when the lines were checked."""
    if max_bytes < 1 or max_speakers < 1:
        raise ValueError(f"max_bytes and max_speakers must be positive; got {max_bytes}, {max_speakers}")
    pieces: list[Line] = []
    for index, line in enumerate(lines):
        for text in split_line_text(line.text, max_bytes, f"lines[{index}]"):
            pieces.append(Line(text, line.speaker, line.style, line.note, line.language))
    chunks: list[list[Line]] = []
    speakers: set[int] = set()
    size = 0
    for piece in pieces:
        piece_bytes = len(piece.text.encode("utf-8"))
        new_speaker = piece.speaker not in speakers
        if chunks and chunks[-1] and ((new_speaker and len(speakers) >= max_speakers) or size + piece_bytes > max_bytes):
            chunks.append([])
            speakers, size = set(), 0
        if not chunks:
            chunks.append([])
        chunks[-1].append(piece)
        speakers.add(piece.speaker)
        size += piece_bytes
    return [tuple(chunk) for chunk in chunks]


# ---- layout -> rows ---------------------------------------------------------------------------------------


@dataclass
class PromptRows:
    """One prompt's rows.

    input_ids: [rows] main token per row (`<|semantic:c0|>` on audio rows).
    audio_codes: [rows, num_codebooks] (zeros on text rows).
    supervised: [rows] bool, True where the row is the model's own output (labels keep it).
    """

    input_ids: torch.Tensor
    audio_codes: torch.Tensor
    supervised: torch.Tensor

    @property
    def labels(self) -> torch.Tensor:
        return torch.where(self.supervised, self.input_ids, torch.full_like(self.input_ids, IGNORE_INDEX))

    def __len__(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class TokenIds:
    """The ids of every token a layout writes, read from (and checked against) a tokenizer."""

    special: dict[str, int]
    semantic_start: int
    codebook_size: int
    pad: int

    @classmethod
    def from_tokenizer(cls, tokenizer, codebook_size: int = CODEBOOK_SIZE) -> TokenIds:
        vocab = tokenizer.get_vocab()
        required = [IM_START, IM_END, VOICE, *(speaker_token(s) for s in range(NUM_SPEAKERS))]
        optional = [TEXT, INTERLEAVE, AUDIO_SEPARATOR]
        missing = [token for token in required if token not in vocab]
        if missing:
            raise ValueError(f"the tokenizer lacks Drama 3 special tokens: {missing[:5]}")
        first, last = semantic_token(0), semantic_token(codebook_size - 1)
        if first not in vocab or last not in vocab or vocab[last] - vocab[first] != codebook_size - 1:
            raise ValueError(
                f"the tokenizer needs a contiguous band {first} .. {last} of {codebook_size} ids"
            )
        special = {token: vocab[token] for token in required + optional if token in vocab}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else special[IM_END]
        return cls(special=special, semantic_start=vocab[first], codebook_size=codebook_size, pad=pad)

    def id_of(self, token: str) -> int:
        if token not in self.special:
            raise ValueError(
                f"this layout needs {token}, which the tokenizer does not have (it is a token of the "
                f"layouts designed from the paper; see docs/prompt_layouts.md)"
            )
        return self.special[token]

    def is_semantic(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids >= self.semantic_start) & (ids < self.semantic_start + self.codebook_size)


def encode_text(tokenizer, text: str) -> list[int]:
    """Ids of plain text; special-token spellings in it stay plain text (never special tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    before = getattr(backend, "encode_special_tokens", None)
    ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    if before is not None:
        # transformers leaves the flag set on the shared backend; put it back for other users.
        backend.encode_special_tokens = before
    return ids


def encode_layout(segments: Sequence[Segment], tokenizer, ids: TokenIds, num_codebooks: int) -> PromptRows:
    """Rows of a layout: each literal tokenized on its own, audio as `[semantic_start + c0, c0..]` rows."""
    main: list[torch.Tensor] = []
    codes: list[torch.Tensor] = []
    supervised: list[torch.Tensor] = []
    for segment in segments:
        if isinstance(segment, Frames):
            frames = segment.codes.shape[1]
            main.append(segment.codes[0] + ids.semantic_start)
            codes.append(segment.codes.T)
            supervised.append(torch.full((frames,), segment.supervised))
            continue
        token_ids: list[int] = []
        flags: list[bool] = []
        text = ""
        for part in [*segment.parts, None]:
            if isinstance(part, str):
                text += part
                continue
            if text:
                pieces = encode_text(tokenizer, text)
                token_ids += pieces
                flags += [False] * len(pieces)
                text = ""
            if isinstance(part, Special):
                token_ids.append(ids.id_of(part.token))
                flags.append(part.supervised)
        main.append(torch.tensor(token_ids, dtype=torch.long))
        codes.append(torch.zeros(len(token_ids), num_codebooks, dtype=torch.long))
        supervised.append(torch.tensor(flags, dtype=torch.bool))
    return PromptRows(torch.cat(main), torch.cat(codes), torch.cat(supervised))


# ---- rows -> script (parsing back) --------------------------------------------------------------------------


@dataclass
class Message:
    """One ChatML message parsed from rows: role and content items (text, special token, codes)."""

    role: str
    items: list[str | Special | torch.Tensor] = field(default_factory=list)
    closed: bool = False


def _is_special(item: object, token: str) -> bool:
    return isinstance(item, Special) and item.token == token


def rows_to_messages(input_ids: torch.Tensor, audio_codes: torch.Tensor, tokenizer, ids: TokenIds) -> list[Message]:
    """Split rows into messages. Runs of text ids decode to strings, runs of audio rows to codes
    `[num_codebooks, frames]`, other special ids to `Special`."""
    names = {value: token for token, value in ids.special.items()}
    items: list[str | Special | torch.Tensor] = []
    index, total = 0, input_ids.shape[0]
    while index < total:
        token = int(input_ids[index])
        end = index + 1
        if ids.semantic_start <= token < ids.semantic_start + ids.codebook_size:
            while end < total and bool(ids.is_semantic(input_ids[end])):
                end += 1
            items.append(audio_codes[index:end].T.clone())
        elif token in names:
            items.append(Special(names[token]))
        else:
            while end < total and int(input_ids[end]) not in names and not bool(ids.is_semantic(input_ids[end])):
                end += 1
            items.append(tokenizer.decode(input_ids[index:end].tolist()))
        index = end
    messages: list[Message] = []
    for item in items:
        if _is_special(item, IM_START):
            messages.append(Message(role=""))
        elif not messages:
            raise ValueError("rows must start with <|im_start|>")
        elif _is_special(item, IM_END):
            messages[-1].closed = True
        elif messages[-1].closed:
            if not (isinstance(item, str) and item == "\n"):
                raise ValueError(f"unexpected {item!r} between messages")
        elif not messages[-1].role and not messages[-1].items and isinstance(item, str):
            role, _, rest = item.partition("\n")
            messages[-1].role = role
            if rest:
                messages[-1].items.append(rest)
        else:
            messages[-1].items.append(item)
    return messages


def _parse_lines(items: Sequence[str | Special | torch.Tensor], separator: str | None) -> list[list[Line]]:
    """User-turn items -> groups of lines; groups split at `separator` special tokens."""
    groups: list[list[Line]] = [[]]
    speaker = None
    for item in items:
        if isinstance(item, Special) and item.token.startswith("<|speaker:"):
            speaker = int(item.token[len("<|speaker:") : -2])
        elif separator is not None and _is_special(item, separator):
            groups.append([])
        elif isinstance(item, str) and speaker is not None:
            groups[-1].append(Line(item[1:] if item.startswith(" ") else item, speaker))
            speaker = None
        else:
            raise ValueError(f"unexpected {item!r} in a user turn")
    for group in groups:
        for position, line in enumerate(group):
            if line.text.endswith("\n"):
                group[position] = Line(line.text[:-1], line.speaker)
    return groups


_REFERENCE_HEAD = re.compile(r"\n\n\[Reference (\d+)\]\nText: ")


def parse_system(message: Message) -> list[Reference]:
    items = list(message.items)
    if not items or not isinstance(items[0], str):
        raise ValueError("the system turn has no instruction")
    head = items.pop(0)
    if head == TTS_INSTRUCTION:
        if items:
            raise ValueError("a system turn without references has extra content")
        return []
    if not head.startswith(REFERENCE_INSTRUCTION):
        raise ValueError(f"unknown system instruction {head!r}")
    items.insert(0, head[len(REFERENCE_INSTRUCTION) :])
    references = []
    while items:
        header, speaker, tail, codes = items[:4]
        del items[:4]
        if not (isinstance(header, str) and _REFERENCE_HEAD.fullmatch(header)):
            raise ValueError(f"bad reference header {header!r}")
        if not (isinstance(tail, str) and tail.startswith(" ") and tail.endswith("\nSpeech: ")):
            raise ValueError(f"bad reference transcript {tail!r}")
        references.append(
            Reference(tail[1 : -len("\nSpeech: ")], codes, int(speaker.token[len("<|speaker:") : -2]))
        )
    return references


def _specials(items: Sequence[str | Special | torch.Tensor]) -> set[str]:
    return {item.token for item in items if isinstance(item, Special)}


def _turn_pairs(turns: Sequence[Message]) -> list[tuple[Message, Message]]:
    """(user, assistant) pairs; every assistant turn starts with <|voice|>."""
    pairs = []
    for position in range(0, len(turns), 2):
        user = turns[position]
        assistant = turns[position + 1] if position + 1 < len(turns) else None
        if user.role != "user" or assistant is None or assistant.role != "assistant":
            raise ValueError("turns must alternate user, assistant")
        if not assistant.items or not _is_special(assistant.items[0], VOICE):
            raise ValueError("an assistant turn must start with <|voice|>")
        pairs.append((user, assistant))
    if not pairs:
        raise ValueError("rows must hold a user turn and the assistant's voice turn")
    return pairs


def _take_codes(assistant: Message) -> torch.Tensor:
    """The audio of a closed assistant turn `<|voice|> frames <|im_end|>`."""
    if not assistant.closed or len(assistant.items) != 2 or not isinstance(assistant.items[1], torch.Tensor):
        raise ValueError("an earlier assistant turn must be <|voice|>, its frames, <|im_end|>")
    return assistant.items[1]


def parse_rows(
    input_ids: torch.Tensor,
    audio_codes: torch.Tensor,
    tokenizer,
    ids: TokenIds,
    supervised: torch.Tensor | None = None,
) -> Request:
    """Rows of any layout this module writes -> the request they encode.

    The layout is read from the rows: `<|interleave|>` in the user turns is the streaming layout
    (`StreamingScript`), `<|audio_separator|>` in the last user turn the line-by-line one
    (`LineByLineScript`), `<|audio_separator|>` only in the assistant turn infilling (`Infill`, given
    as prefix/suffix audio however the window was first given), anything else the published one
    (`Script`). Rows that end with a closed assistant turn give a request with its target.

    A line-by-line script of a single line writes the rows of a `Script` and parses back as one.
    Streaming rows hold the chunks up to the look-ahead of the open turn, so later chunks are not
    in them. Infilling training rows hold the kept prefix and the target middle as one run of
    frames: `supervised` [rows] (labels != -100) tells them apart.

    Padding must be removed first. Used by round-trip tests and to inspect training data."""
    messages = rows_to_messages(input_ids, audio_codes, tokenizer, ids)
    if not messages or messages[0].role != "system":
        raise ValueError("rows must start with a system turn")
    references = parse_system(messages[0])
    pairs = _turn_pairs(messages[1:])
    if any(INTERLEAVE in _specials(user.items) for user, _ in pairs):
        return _parse_streaming(pairs, references)
    user, assistant = pairs[-1]
    history = [Take(_parse_lines(u.items, None)[0], _take_codes(a)) for u, a in pairs[:-1]]
    if AUDIO_SEPARATOR in _specials(user.items):
        lines = [group[0] for group in _parse_lines(user.items, AUDIO_SEPARATOR)]
        target = [item for item in assistant.items[1:] if isinstance(item, torch.Tensor)] or None
        return LineByLineScript(lines=lines, references=references, history=history, target=target, strict_speakers=False)
    if AUDIO_SEPARATOR in _specials(assistant.items):
        if history:
            raise ValueError("infilling rows have no history turns")
        semantic = ids.is_semantic(input_ids)
        middle_frames = None if supervised is None else int((supervised.bool() & semantic).sum())
        return _parse_infill(user, assistant, references, middle_frames)
    lines = _parse_lines(user.items, None)[0]
    audio = [item for item in assistant.items[1:] if isinstance(item, torch.Tensor)]
    target = audio[0] if assistant.closed and audio else None
    return Script(lines=lines, references=references, history=history, target=target, strict_speakers=False)


def _parse_infill(user: Message, assistant: Message, references, middle_frames: int | None) -> Infill:
    """`<|voice|> [suffix] <|audio_separator|> [prefix] ([middle] <|im_end|>)` -> an Infill."""
    items = assistant.items[1:]
    cut = next(index for index, item in enumerate(items) if _is_special(item, AUDIO_SEPARATOR))
    before, after = items[:cut], items[cut + 1 :]
    if len(before) > 1 or len(after) > 1 or not all(isinstance(item, torch.Tensor) for item in before + after):
        raise ValueError("an infilling turn is <|voice|>, suffix frames, <|audio_separator|>, prefix frames")
    suffix = before[0] if before else None
    kept = after[0] if after else None
    target = None
    if assistant.closed:
        if middle_frames is None:
            raise ValueError(
                "infilling rows with a target hold the kept prefix and the middle as one run of frames; "
                "give their labels (supervised rows) to tell them apart"
            )
        if kept is None or not 0 < middle_frames <= kept.shape[1]:
            raise ValueError(f"the labels supervise {middle_frames} frames; the turn's last run has {0 if kept is None else kept.shape[1]}")
        kept, target = kept[:, : kept.shape[1] - middle_frames], kept[:, kept.shape[1] - middle_frames :]
    prefix = kept if kept is not None and kept.shape[1] else None
    lines = _parse_lines(user.items, None)[0]
    return Infill(lines, prefix=prefix, suffix=suffix, references=references, target=target, strict_speakers=False)


def _parse_streaming(pairs: Sequence[tuple[Message, Message]], references) -> StreamingScript:
    """Turns `<chunk k> <|interleave|> [<chunk k+1>]` answered by chunk k's audio -> a StreamingScript."""
    chunks: list[list[Line]] = []
    spoken: list[torch.Tensor] = []
    look_ahead: list[Line] | None = None
    for index, (user, assistant) in enumerate(pairs):
        groups = _parse_lines(user.items, INTERLEAVE)
        if len(groups) != 2 or not groups[0]:
            raise ValueError(f"streaming turn {index}: expected <chunk> <|interleave|> [<next chunk>]")
        if look_ahead is not None and groups[0] != look_ahead:
            raise ValueError(f"streaming turn {index}: its chunk is not the previous turn's look-ahead")
        current, look_ahead = groups
        chunks.append(current)
        if index + 1 < len(pairs) or assistant.closed:
            spoken.append(_take_codes(assistant))
        elif len(assistant.items) != 1:
            raise ValueError("the open streaming turn must end with <|voice|>")
    if look_ahead:
        if len(spoken) == len(chunks):
            raise ValueError("the last streaming turn was spoken but looks ahead to a chunk no turn speaks")
        chunks.append(look_ahead)
    return StreamingScript(chunks=chunks, references=references, spoken=spoken, strict_speakers=False)
