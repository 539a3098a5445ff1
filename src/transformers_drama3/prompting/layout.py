"""The "reference-bracket-v1" layout as segments: the one place the prompt's structure is written.

A layout is a list of segments, each a literal (text and special tokens, tokenized on its own) or
a run of audio frames. Requests (`script.py`) build their layouts from the pieces here;
`encoding.py` turns a layout into rows and reads the layout's own marks (the turn to speak, the
line boundaries) into metadata on the rows, so nothing downstream re-derives them from token ids.

Published layout (spec §4, both public implementations agree):

    <|im_start|>system\\n
      "convert the provided text to speech"                               (no references)
      "convert the provided text to speech reference to the following:"  (references)
      per reference i (1-based): "\\n\\n[Reference i]\\nText: " transcript "\\nSpeech: " frames
    <|im_end|>\\n
    per history take: <|im_start|>user\\n turn <|im_end|>\\n
                      <|im_start|>assistant\\n<|voice|> frames <|im_end|>\\n
    <|im_start|>user\\n turn <|im_end|>\\n
    <|im_start|>assistant\\n<|voice|>

where a turn is the caller's text as given (`text.with_speaker_tag`) and a transcript is written by
`text.reference_transcript`. Each literal is tokenized on its own: joining the string first would
change ids at the seams.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch

from .text import (
    IM_END,
    IM_START,
    REFERENCE_INSTRUCTION,
    TTS_INSTRUCTION,
    VOICE,
    reference_transcript,
    speaker_token,
    split_speaker_tags,
)

if TYPE_CHECKING:
    from .clips import Clip


@dataclass(frozen=True)
class Special:
    """A special token written by the layout; `supervised` marks it as the model's own output."""

    token: str
    supervised: bool = False


@dataclass(frozen=True)
class Spoken:
    """Caller text that is spoken (turns, lines, reference transcripts), tags and notes included.

    A model with a phoneme text front end reads its words as phonemes (`phonemes.py`); any other
    model reads it as text, joined with the text parts around it, so its rows are the published
    layout's token for token."""

    text: str


@dataclass(frozen=True)
class Literal:
    """Text and special tokens tokenized on their own (adjacent text parts are joined first).

    `speak` marks the text of the turn the model speaks (the rows' `speak_span`)."""

    parts: tuple[str | Spoken | Special, ...]
    speak: bool = False


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


def turn_start(role: str) -> Literal:
    return Literal((Special(IM_START), f"{role}\n"))


TURN_END = Literal((Special(IM_END), "\n"))
SUPERVISED_TURN_END = Literal((Special(IM_END, supervised=True), "\n"))
VOICE_START = Literal((Special(IM_START), "assistant\n", Special(VOICE)))


def text_parts(text: str) -> list[Spoken | Special]:
    """Checked raw text -> its parts, each speaker tag as its special token, the rest spoken as given."""
    return [
        Special(speaker_token(piece)) if isinstance(piece, int) else Spoken(piece)
        for piece in split_speaker_tags(text, "text")
    ]


def part_text(part: str | Spoken | Special) -> str:
    """A part as the text of the published layout: a special token by its spelling."""
    if isinstance(part, Special):
        return part.token
    return part.text if isinstance(part, Spoken) else part


def lines_parts(lines: Sequence, separator: Special | str = "\n", instruction: str | None = None) -> list[str | Spoken | Special]:
    """`<|speaker:N|> body` per `Line`, lines joined by `separator` (the project's convention for
    structured lines)."""
    parts: list[str | Special] = []
    for index, line in enumerate(lines):
        if index:
            parts.append(separator)
        parts += [Special(speaker_token(line.speaker)), Spoken(" " + line.body(instruction if index == 0 else None))]
    return parts


def render_lines(lines: Sequence) -> str:
    """Structured lines as the raw text the published rule then takes as given."""
    return "".join(part_text(part) for part in lines_parts(lines))


def system_segments(references: Sequence, context: LayoutContext) -> list[Segment]:
    """The system turn; `references` are checked `Reference`s (transcript as given, speaker resolved)."""
    segments: list[Segment] = [turn_start("system"), Literal((REFERENCE_INSTRUCTION if references else TTS_INSTRUCTION,))]
    for index, reference in enumerate(references):
        transcript = reference_transcript(reference.transcript, reference.speaker)
        parts = [f"\n\n[Reference {index + 1}]\nText: ", *text_parts(transcript), "\nSpeech: "]
        segments.append(Literal(tuple(parts)))
        segments.append(Frames(context.codes_of(reference.audio, f"references[{index}].audio", True)))
    segments.append(TURN_END)
    return segments


def user_segments(parts: list[str | Spoken | Special], speak: bool = False) -> list[Segment]:
    return [turn_start("user"), Literal(tuple(parts), speak=speak), TURN_END]


def take_segments(parts: list[str | Spoken | Special], codes: torch.Tensor, supervised: bool) -> list[Segment]:
    """A history take (or a spoken streaming turn): its user turn, then its voice turn."""
    end = SUPERVISED_TURN_END if supervised else TURN_END
    return [*user_segments(parts), VOICE_START, Frames(codes, supervised), end]
