"""Long text cut into chunks (spec §4): the one place a request's text is normalised.

A request that fits one chunk is spoken as given. A longer one is cut here into chunks of about
`CHUNK_BYTES` UTF-8 bytes of text and at most `CHUNK_SPEAKERS` speakers: from the script's line
view (line breaks already spaces, ends stripped), cut at sentence ends, then clause marks, then
white space, then between CJK characters, never inside a tag; each chunk is then written by the
structured-line convention (`<|speaker:N|> text` per line, joined by "\n"), as the public long-form
code writes its chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from .text import POINT_TAG, SCOPED_TAG, WHITE_SPACE, is_cjk, strip_white_space

if TYPE_CHECKING:
    from .script import Line

# Long text (spec §4): about this many UTF-8 bytes of text per chunk, at most this many speakers.
CHUNK_BYTES = 300
CHUNK_SPEAKERS = 3

_SENTENCE_ENDS = frozenset(".!?;。！？；…")
_CLAUSE_MARKS = frozenset(",:，：、")
_CLOSERS = frozenset("\"'”’」』)）")



def _protected_spans(text: str) -> list[tuple[int, int]]:
    """Point tags and outermost scoped-tag spans: never cut inside them."""
    spans = [match.span() for match in POINT_TAG.finditer(text)]
    stack: list[int] = []
    for match in SCOPED_TAG.finditer(text):
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
        elif index and is_cjk(char) and is_cjk(text[index - 1]):
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
    decorations excluded). Line breaks already became spaces in the line view (`parse_text`):
    this is where a request is split, so this is where its text is normalised."""
    if max_bytes < 1 or max_speakers < 1:
        raise ValueError(f"max_bytes and max_speakers must be positive; got {max_bytes}, {max_speakers}")
    pieces: list[Line] = []
    for index, line in enumerate(lines):
        for text in split_line_text(line.text, max_bytes, f"lines[{index}]"):
            pieces.append(replace(line, text=text))
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
