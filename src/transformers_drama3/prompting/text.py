"""The vocabulary of the "reference-bracket-v1" layout and the rules for caller text.

The published rule (spec §4; both public implementations agree) takes caller text *as given*:
the user turn is the text itself, with `<|speaker:0|> ` put in front only when no speaker tag
leads it (after white space); a reference transcript is written after "Text: " with its own
leading tag moved in front of any leading white space. Nothing else is added, removed or
collapsed. This module holds those two rules, the checks that refuse what the published rule
refuses, and the few text helpers the rest of the package shares (white space, CJK).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

# The template version and the codebook counts have one source: the configuration.
from ..configuration_drama3 import NUM_CODEBOOKS, SEMANTIC_CODEBOOK_SIZE, SPEECH_TEMPLATE_VERSION  # noqa: F401

TEMPLATE_VERSION = SPEECH_TEMPLATE_VERSION
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VOICE = "<|voice|>"
TEXT = "<|text|>"
INTERLEAVE = "<|interleave|>"
AUDIO_SEPARATOR = "<|audio_separator|>"
NUM_SPEAKERS = 16
MAX_SPEAKER = NUM_SPEAKERS - 1
CODEBOOK_SIZE = SEMANTIC_CODEBOOK_SIZE
TTS_INSTRUCTION = "convert the provided text to speech"
REFERENCE_INSTRUCTION = "convert the provided text to speech reference to the following:"
IGNORE_INDEX = -100

def speaker_token(speaker: int) -> str:
    return f"<|speaker:{speaker}|>"


def semantic_token(code: int) -> str:
    return f"<|semantic:{code}|>"


# Unicode White_Space. str.strip() would also strip the separators U+001C..U+001F.
WHITE_SPACE = "\t\n\v\f\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
LINE_BREAKS = "\n\r\v\f\x85\u2028\u2029"
_LINE_BREAK_RUN = re.compile(f"[{re.escape(WHITE_SPACE)}]*[{re.escape(LINE_BREAKS)}][{re.escape(WHITE_SPACE)}]*")
# Written only by the layout: caller text holding one of these would inject structure or audio rows.
# "<|semantic:" is a prefix on purpose: a half-written semantic token is refused too.
STRUCTURAL_TOKENS = (IM_START, IM_END, VOICE, TEXT, INTERLEAVE, "<|semantic:")
SPEAKER_TAG = re.compile(r"<\|speaker:([0-9]+)\|>")
_SPEAKER_MARKER = re.compile(r"<\|speaker")
# Anything else spelled like a special token (<|audio_separator|>, reserved tokens): the published
# code would turn it into a special id; the project refuses it.
_SPECIAL_LIKE = re.compile(r"<\|.*?\|>", re.S)
SCOPED_TAG = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9_-]*)>")
POINT_TAG = re.compile(r"\[[^\[\]]*\]")


def strip_white_space(text: str) -> str:
    return text.strip(WHITE_SPACE)


def flatten_line_breaks(text: str) -> str:
    """Each white-space run holding a line break becomes one space; the ends are stripped.

    Used only where text is split (long-form chunks, scene turns, the line view of a script):
    a request that is spoken whole keeps its line breaks."""
    return strip_white_space(_LINE_BREAK_RUN.sub(" ", text))


def is_cjk(character: str) -> bool:
    """Kana, CJK ideographs (extensions and compatibility included) and Hangul syllables: the
    scripts written without spaces between words (Hangul counts by syllable for durations)."""
    code = ord(character)
    return (
        0x3040 <= code <= 0x30FF  # kana
        or 0x3400 <= code <= 0x4DBF  # extension A
        or 0x4E00 <= code <= 0x9FFF
        or 0xAC00 <= code <= 0xD7AF  # Hangul syllables
        or 0xF900 <= code <= 0xFAFF
        or 0x20000 <= code <= 0x2FA1F
    )


# ---- checks -----------------------------------------------------------------------------------------


def check_speaker(speaker: Any, location: str) -> int:
    if isinstance(speaker, bool) or not isinstance(speaker, (int, np.integer)):
        raise ValueError(f"{location}: speaker must be an int in 0..{MAX_SPEAKER}; got {speaker!r}")
    if not 0 <= int(speaker) <= MAX_SPEAKER:
        raise ValueError(
            f"{location}: speaker {int(speaker)} is out of range; the tokenizer has speakers 0..{MAX_SPEAKER}"
        )
    return int(speaker)


def check_no_special_tokens(text: str, location: str) -> None:
    """Refuse text that spells (or starts to spell) a special token: only the layout writes them."""
    for token in STRUCTURAL_TOKENS:
        if token in text:
            raise ValueError(
                f"{location}: {token!r} is spelled like a special token; structural tokens are written "
                f"by the processor, never taken from caller text"
            )
    marker = _SPEAKER_MARKER.search(text)
    if marker is not None:
        raise ValueError(
            f"{location}: {text[marker.start() : marker.start() + 16]!r}... is spelled like a special token "
            f"(a speaker tag); give speakers with Line(speaker=...) or a <|speaker:N|> tag in raw text"
        )
    match = _SPECIAL_LIKE.search(text)
    if match is not None:
        raise ValueError(
            f"{location}: {match.group(0)!r} is spelled like a special token; structural tokens "
            f"(<|im_start|>, <|semantic:N|>, <|audio_separator|>, ...) are written by the processor, never "
            f"taken from caller text"
        )


def speaker_tag_at(text: str, start: int, location: str) -> re.Match:
    """The speaker tag starting at `start`, which must be `<|speaker:N|>`, N in 0..15, no leading zero."""
    tag = SPEAKER_TAG.match(text, start)
    digits = tag.group(1) if tag else ""
    if not digits or digits != str(int(digits)) or int(digits) > MAX_SPEAKER:
        raise ValueError(
            f"{location}: {text[start : start + 16]!r}... is not a speaker tag; write <|speaker:0|> .. "
            f"<|speaker:{MAX_SPEAKER}|> without leading zeros"
        )
    return tag


def split_speaker_tags(text: str, location: str) -> list[str | int]:
    """Raw text -> its pieces in order: strings, and the speaker of each tag (an int).

    Every `<|speaker` must start a valid tag; the pieces between tags must spell no special token."""
    pieces: list[str | int] = []
    start = 0
    for marker in _SPEAKER_MARKER.finditer(text):
        if marker.start() < start:
            continue
        tag = speaker_tag_at(text, marker.start(), location)
        pieces.append(text[start : tag.start()])
        pieces.append(int(tag.group(1)))
        start = tag.end()
    pieces.append(text[start:])
    for piece in pieces:
        if isinstance(piece, str):
            check_no_special_tokens(piece, location)
    return [piece for piece in pieces if piece != ""]


def check_tags(text: str, location: str) -> None:
    """Scoped tags must nest and close; point tags must close and not nest."""
    stack: list[str] = []
    for match in SCOPED_TAG.finditer(text):
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


def check_caller_text(text: Any, location: str) -> str:
    """Validate raw caller text (speaker tags allowed) and return it unchanged.

    Refused as the published rule refuses: white space only, structural tokens (a `<|semantic:`
    prefix included), `<|speaker` that does not start `<|speaker:0|>`..`<|speaker:15|>`. Refused
    beyond it (see docs/prompt_layouts.md): other special-token spellings, text that is nothing but
    speaker tags, and unbalanced tags in a speaker's text."""
    if not isinstance(text, str):
        raise ValueError(f"{location}: text must be a str; got {type(text).__name__}")
    pieces = split_speaker_tags(text, location)
    words = [piece for piece in pieces if isinstance(piece, str)]
    if not strip_white_space("".join(words)):
        raise ValueError(f"{location}: text is empty")
    for piece in words:
        check_tags(piece, location)
    return text


def leading_speaker(text: str) -> int | None:
    """The speaker of the tag that leads `text` after white space, or None."""
    tag = SPEAKER_TAG.match(text, len(text) - len(text.lstrip(WHITE_SPACE)))
    return None if tag is None else int(tag.group(1))


# ---- the two published text rules -----------------------------------------------------------------------


def with_speaker_tag(text: str, speaker: int = 0) -> str:
    """The user turn of `text`: as given when a speaker tag leads it (after white space), else
    `<|speaker:{speaker}|> ` + text."""
    if leading_speaker(text) is not None:
        return text
    return f"{speaker_token(speaker)} {text}"


def reference_transcript(text: str, speaker: int = 0) -> str:
    """A transcript as written after "Text: ": tagged as the user turn is, then the leading tag
    moved in front of the leading white space (the tag must follow "Text: " directly)."""
    tagged = with_speaker_tag(text, speaker)
    body = tagged.lstrip(WHITE_SPACE)
    tag = SPEAKER_TAG.match(body)
    return tag.group(0) + tagged[: len(tagged) - len(body)] + body[tag.end() :]


def with_instruction(turn: str, instruction: str) -> str:
    """A user turn with "[instruction] " after its leading speaker tag and the space after it
    (the project's revision convention)."""
    start = len(turn) - len(turn.lstrip(WHITE_SPACE))
    tag = SPEAKER_TAG.match(turn, start)
    at = tag.end() + (1 if turn[tag.end() : tag.end() + 1] == " " else 0)
    return f"{turn[:at]}[{instruction}] {turn[at:]}"
