"""The script model: what should be spoken, and the layout each kind of request writes.

A *script* says what should be spoken: lines bound to speakers 0-15, voice references (a
transcript and its audio, several per speaker allowed), earlier takes kept in context for a
revision, inline tags. Each request type builds its layout (`layout.py`) with `layout(context)`;
audio reaches it through `LayoutContext.codes_of`, which returns codes `[num_codebooks, frames]`.

Text as given. Raw text (a str, speaker tags allowed) and reference transcripts go into the
published layout exactly as the caller wrote them (line breaks, white space and tag spacing
kept); `lines` is only a *view* of it (speakers and line texts, line breaks as spaces) for
checks, chunking and scenes. Structured `Line`s are written by the project's convention,
`<|speaker:N|> body` per line joined by "\n", and that text is then taken as given. Text is
normalised only where a request is split (`chunking.py`, `speaker_turns`).

`Script` is the published layout. Layouts designed from the paper (no public code has them; see
docs/prompt_layouts.md): `LineByLineScript` (lines and audio segments separated by
`<|audio_separator|>`; also the multi-character scene layout), `Infill` (speech infilling) and
`StreamingScript` (streaming text input, each turn = current chunk + one look-ahead chunk).

Text conventions designed here (the paper names the features, no public code spells them):
a style prefix is written "(style) ", a director's note "[note] ", a revision instruction
"[instruction] " after the first speaker tag, a language tag wraps the line in
`<language>...</language>`. Point tags `[laughs]` and scoped tags `<whisper>...</whisper>` are
written by the user in the text.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch

from .chunking import CHUNK_BYTES, CHUNK_SPEAKERS, chunk_lines
from .clips import AudioLike, as_clip
from .layout import (
    SUPERVISED_TURN_END,
    VOICE_START,
    Frames,
    LayoutContext,
    Literal,
    Segment,
    Special,
    lines_parts,
    render_lines,
    system_segments,
    take_segments,
    text_parts,
    user_segments,
)
from .text import (
    AUDIO_SEPARATOR,
    INTERLEAVE,
    SPEAKER_TAG,
    WHITE_SPACE,
    check_caller_text,
    check_no_special_tokens,
    check_speaker,
    check_tags,
    flatten_line_breaks,
    leading_speaker,
    speaker_token,
    split_speaker_tags,
    strip_white_space,
    with_instruction,
    with_speaker_tag,
)

# References longer than this are refused: they crowd the context and the paper's data never has them.
MAX_REFERENCE_SECONDS = 60.0
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def check_free_text(text: Any, location: str) -> str:
    """Validate the text of a structured `Line` field and return it with line breaks flattened and
    the ends stripped: structured lines are joined by "\n", so a break inside one would read as a
    line boundary. (Raw text is never flattened: see `parse_text`.)"""
    if not isinstance(text, str):
        raise ValueError(f"{location}: text must be a str; got {type(text).__name__}")
    check_no_special_tokens(text, location)
    flat = flatten_line_breaks(text)
    if not flat:
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
    """Raw text with optional `<|speaker:N|>` tags -> its line view.

    The text is checked as the published rule checks it (`text.check_caller_text`). Text before the
    first tag belongs to `default_speaker`; turns of white space only are dropped; each line's text
    has its line breaks as spaces and its ends stripped. The view is for checks, chunking and
    scenes: a request made from raw text still speaks the text as given."""
    check_caller_text(text, location)
    lines = []
    speaker = default_speaker
    for piece in split_speaker_tags(text, location):
        if isinstance(piece, int):
            speaker = piece
        elif strip_white_space(piece):
            lines.append(Line(piece, speaker).checked(f"{location} (turn {len(lines)})"))
    return tuple(lines)


def turn_source(lines: Any, location: str) -> str | None:
    """Raw text given for a turn, checked and unchanged; None for structured lines."""
    return check_caller_text(lines, location) if isinstance(lines, str) else None


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
    speaker: int | None = None
    sampling_rate: int | None = None

    def checked(self, location: str) -> Reference:
        """The reference with its speaker resolved: the transcript's leading `<|speaker:N|>` tag
        when it has one (then `speaker`, if given, must agree), else `speaker`, else 0. The
        transcript is kept as given (`text.reference_transcript` writes it)."""
        transcript = check_caller_text(self.transcript, f"{location}.transcript")
        tagged = leading_speaker(transcript)
        speaker = self.speaker
        if tagged is not None and speaker is not None and check_speaker(speaker, f"{location}.speaker") != tagged:
            raise ValueError(
                f"{location}: the transcript is tagged <|speaker:{tagged}|> but speaker={speaker}; give one of them"
            )
        speaker = tagged if tagged is not None else (0 if speaker is None else speaker)
        return Reference(
            transcript=transcript,
            audio=as_clip(self.audio, f"{location}.audio", self.sampling_rate),
            speaker=check_speaker(speaker, f"{location}.speaker"),
        )

    def renumbered(self, speaker: int) -> Reference:
        """The same reference for another speaker (a checked reference): a leading tag of the
        transcript is rewritten, the rest kept."""
        transcript = self.transcript
        start = len(transcript) - len(transcript.lstrip(WHITE_SPACE))
        tag = SPEAKER_TAG.match(transcript, start)
        if tag is not None:
            transcript = transcript[:start] + speaker_token(speaker) + transcript[tag.end() :]
        return Reference(transcript, self.audio, speaker)


@dataclass(frozen=True)
class Take:
    """An earlier turn kept in context: the lines that were asked for and the audio that came back."""

    lines: str | Line | Sequence[Line | str]
    audio: AudioLike
    sampling_rate: int | None = None
    # the raw text of the take's turn as given (None: structured lines); set when checked
    text: str | None = field(default=None, init=False, repr=False)

    def checked(self, location: str) -> Take:
        text = turn_source(self.lines, f"{location}.lines") if isinstance(self.lines, str) else self.text
        take = Take(lines=as_lines(self.lines, f"{location}.lines"), audio=as_clip(self.audio, f"{location}.audio", self.sampling_rate))
        object.__setattr__(take, "text", text)
        return take

    def turn_parts(self) -> list[str | Special]:
        """The take's user turn: its raw text as given, or its lines by the convention."""
        return turn_parts(self.text, self.lines)


def turn_text(text: str | None, lines: Sequence[Line], instruction: str | None = None) -> str:
    """A user turn as raw text: raw text as given (tagged `<|speaker:0|> ` when no tag leads it), or
    structured lines by the convention; an instruction goes after the first speaker tag."""
    turn = with_speaker_tag(text) if text is not None else render_lines(lines)
    if instruction:
        turn = with_instruction(turn, instruction)
    return turn


def turn_parts(text: str | None, lines: Sequence[Line], instruction: str | None = None) -> list[str | Special]:
    """A user turn (`turn_text`) as layout parts, each speaker tag its special token."""
    return text_parts(turn_text(text, lines, instruction))


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


def _set_text_and_lines(request) -> None:
    """A request's `text` (the raw text as given, when `lines` is a str) and its line view."""
    if isinstance(request.lines, str):
        object.__setattr__(request, "text", turn_source(request.lines, "lines"))
    object.__setattr__(request, "lines", as_lines(request.lines, "lines"))


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
        lines: raw text (with optional `<|speaker:N|>` tags), spoken as given; or a `Line`, or a
            list of lines/strings, written `<|speaker:N|> body` per line joined by "\\n" (a
            multi-speaker dialogue). `lines` then holds the line view; `text` the raw text.
        references: voice references; several per speaker allowed; rendered in order, 1-based.
        history: earlier takes kept in context (multi-turn revision, or the long-text chunk history).
        instruction: a relative instruction for a revision, e.g. "softer than the previous take",
            rendered "[instruction] " after the first speaker tag.
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
    # the raw text as given when `lines` was a str (None: structured lines); `lines` is its view
    text: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        _checked_common(self)
        _set_text_and_lines(self)
        set_ = object.__setattr__
        set_(self, "history", tuple(as_take(take, f"history[{index}]") for index, take in enumerate(self.history)))
        set_(self, "instruction", _check_annotation(self.instruction, "instruction", "[]"))
        if self.target is not None:
            set_(self, "target", self._checked_target(self.target))
        if self.strict_speakers:
            groups = [("lines", self.lines)] + [(f"history[{i}].lines", t.lines) for i, t in enumerate(self.history)]
            _check_reference_speakers(self.references, groups)

    def _checked_target(self, target: Any) -> Any:
        return as_clip(target, "target")

    def source(self) -> str | tuple[Line, ...]:
        """What the lines were given as: the raw text, or the structured lines."""
        return self.text if self.text is not None else self.lines

    def history_segments(self, context: LayoutContext) -> list[Segment]:
        segments = system_segments(self.references, context)
        for index, take in enumerate(self.history):
            codes = context.codes_of(take.audio, f"history[{index}].audio", False)
            segments += take_segments(take.turn_parts(), codes, False)
        return segments

    def layout(self, context: LayoutContext) -> list[Segment]:
        segments = self.history_segments(context)
        segments += user_segments(turn_parts(self.text, self.lines, self.instruction), speak=True)
        segments.append(VOICE_START)
        if self.target is not None:
            segments += [Frames(context.codes_of(self.target, "target", False), supervised=True), SUPERVISED_TURN_END]
        return segments

    def chunks(self, max_bytes: int = CHUNK_BYTES, max_speakers: int = CHUNK_SPEAKERS) -> list[Script]:
        """Long text as a list of scripts, one per chunk (spec §4), same references and instruction.

        Generate them in order; give chunk k the history `long_text_history(takes)` of the takes
        made so far (the first chunk's take and the previous one's). A target cannot be chunked.
        A script that fits one chunk is returned as it is (its text as given); a longer one is cut
        from its line view (`chunking.py`)."""
        if self.target is not None:
            raise ValueError("target: a script with a target cannot be chunked; align the audio per chunk yourself")
        chunks = chunk_lines(self.lines, max_bytes, max_speakers)
        if len(chunks) == 1:
            return [self]
        return [
            Script(
                lines=chunk,
                references=self.references,
                history=self.history,
                instruction=self.instruction,
                strict_speakers=self.strict_speakers,
            )
            for chunk in chunks
        ]

    def with_history(self, history: Sequence[Take]) -> Script:
        return type(self)(
            self.source(), self.references, tuple(history), self.instruction, self.target, self.strict_speakers
        )


def revision(script: Script, take_audio: AudioLike, instruction: str) -> Script:
    """The request that revises a take of `script` (multi-turn revision): the script's history,
    then the take (its user turn as it was asked, instruction included, and `take_audio`) kept in
    context, then the same lines again with the relative `instruction` ("slower, more tired").
    Revising the result revises the newest take, with every earlier one still in context."""
    asked = Take(turn_text(script.text, script.lines, script.instruction), take_audio)
    return Script(
        script.source(), script.references, (*script.history, asked), instruction, strict_speakers=script.strict_speakers
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
    directions unchanged), and the script's instruction. This splits the request, so the lines come
    from the script's line view (line breaks as spaces, see `parse_text`), written by the
    structured-line convention. Returns (the script's speaker, request)
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
    runs = [(speaker, tuple(run)) for speaker, run in itertools.groupby(script.lines, key=lambda line: line.speaker)]
    if len(runs) == 1 and runs[0][0] == 0:
        # one turn of speaker 0: nothing to split or renumber, so the script is spoken as given
        return [(0, Script(script.source(), script.references, instruction=script.instruction))]
    turns = []
    for speaker, run in runs:
        own = [reference for reference in script.references if reference.speaker == speaker]
        references = tuple(reference.renumbered(0) for reference in own)
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
        # the lines are separated by the layout, so they are written from the line view
        segments = self.history_segments(context)
        segments += user_segments(lines_parts(self.lines, Special(AUDIO_SEPARATOR), self.instruction), speak=True)
        segments.append(VOICE_START)
        target = self.target or ()
        for index, clip in enumerate(target):
            segments.append(Frames(context.codes_of(clip, f"target[{index}]", False), supervised=True))
            if index + 1 < len(self.lines):
                segments.append(Literal((Special(AUDIO_SEPARATOR, supervised=True),)))
        if len(target) == len(self.lines):
            segments.append(SUPERVISED_TURN_END)
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
    # the raw transcript as given when `lines` was a str (None: structured lines)
    text: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        _checked_common(self)
        _set_text_and_lines(self)
        set_ = object.__setattr__
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
        segments += user_segments(turn_parts(self.text, self.lines), speak=True)
        segments.append(VOICE_START)
        if suffix.shape[1]:
            segments.append(Frames(suffix))
        segments.append(Literal((Special(AUDIO_SEPARATOR),)))
        if prefix.shape[1]:
            segments.append(Frames(prefix))
        if self.target is not None:
            segments += [Frames(context.codes_of(self.target, "target", False), supervised=True), SUPERVISED_TURN_END]
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

    def open_turn_segments(self, index: int) -> list[Segment]:
        """The turn that speaks chunk `index`: its user message (chunk + look-ahead), then the
        start of its voice turn; the rows end here until the take is drawn."""
        return [*user_segments(self.turn_parts(index), speak=True), VOICE_START]

    def layout(self, context: LayoutContext) -> list[Segment]:
        segments = system_segments(self.references, context)
        for index, clip in enumerate(self.spoken):
            codes = context.codes_of(clip, f"spoken[{index}]", False)
            segments += take_segments(self.turn_parts(index), codes, supervised=True)
        if len(self.spoken) < len(self.chunks):
            segments += self.open_turn_segments(len(self.spoken))
        return segments


@dataclass(frozen=True)
class StreamingSystemTurn:
    """The system turn of a streaming script (its references): the rows before any text arrives."""

    references: Sequence[Reference] = ()

    def __post_init__(self):
        _checked_common(self)

    def layout(self, context: LayoutContext) -> list[Segment]:
        return system_segments(self.references, context)


@dataclass(frozen=True)
class StreamingTurn:
    """The rows a streaming script gains when turn `index` opens: after the system turn for turn 0,
    after take `index - 1` (then starting with that take's `<|im_end|>`) for the others; then
    `script.open_turn_segments(index)`.

    Rows of `StreamingScript(chunks, references, spoken=takes[:index])` = rows of
    `StreamingSystemTurn(references)`, `StreamingTurn(script, 0)`, then for each k < index take k's
    frames and `StreamingTurn(script, k + 1)`. Speaking text as it arrives extends a cache with these
    rows instead of building the whole prompt again (`generation.live_text`)."""

    script: StreamingScript
    index: int

    def __post_init__(self):
        if not 0 <= self.index < len(self.script.chunks):
            raise ValueError(f"index: no turn {self.index} in a streaming script of {len(self.script.chunks)} chunks")

    def layout(self, context: LayoutContext) -> list[Segment]:
        after_take = [SUPERVISED_TURN_END] if self.index else []
        return [*after_take, *self.script.open_turn_segments(self.index)]


Request = Union[Script, Infill, StreamingScript]

