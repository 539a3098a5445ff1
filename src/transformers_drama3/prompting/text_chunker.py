"""Text that arrives in pieces (an LLM's tokens, a live caption, a typist) cut into streaming chunks.

`TextStreamChunker` takes the pieces one at a time and gives back the chunks
`StreamingScript.from_text(whole text)` makes (`chunking.chunk_lines` of its line view), each one as
soon as no later text can change it, so the chunks never depend on how the text was cut into
pieces. Pieces are joined as given (an LLM's token strings carry their own spaces).

When is a chunk final? The text is read only up to its *settled* end: outside every point tag
`[...]` and scoped span `<x>...</x>`, and before anything that may still become a tag or a special
token (`<`, `</wh`, `<|speak`, `<|...` without its `|>`). In that text, a line closed by a later
speaker tag is final; in the open (last) line every piece but the last is final, because
`split_line_text` cut it while more than `max_bytes` followed, from cut points that later text
cannot move. Chunks are groups of consecutive pieces (`chunk_lines`), so chunk k is final once the
piece after its last one is final. Errors in the text (a spelled special token, a bad speaker tag,
an unclosed tag at the end) are the batch API's errors, raised as soon as the text that holds them
is settled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .chunking import CHUNK_BYTES, CHUNK_SPEAKERS, chunk_lines
from .script import Line, parse_text
from .text import SCOPED_TAG, split_speaker_tags, strip_white_space

# What may still become a tag or a special token when more text comes: "<", "</", "<name", "</name"
# without their ">", and "<|" without its "|>".
_OPEN_SCOPED_TAG = re.compile(r"</?(?:[A-Za-z][A-Za-z0-9_-]*)?\Z")


@dataclass(frozen=True)
class TextChunk:
    """A final chunk of streamed text.

    index: its place among the chunks (0, 1, ...); lines: its lines (the structured-line view, as
    `chunk_lines` gives them); piece: the index of the text piece whose arrival made it final
    (for a chunk made final by the end of the text, the last piece)."""

    index: int
    lines: tuple[Line, ...]
    piece: int


def settled_length(text: str) -> int:
    """Characters of `text` that later text cannot read differently: the longest prefix that ends
    outside every point tag and scoped span and before anything that may still become a tag."""
    end = len(text)
    special = text.rfind("<|")
    if special >= 0 and text.find("|>", special + 2) < 0:
        end = special
    partial = _OPEN_SCOPED_TAG.search(text, 0, end)
    if partial is not None:
        end = partial.start()
    settled, depth, open_tags, index = 0, 0, 0, 0
    tags = {match.start(): match for match in SCOPED_TAG.finditer(text, 0, end)}
    while index < end:
        match = tags.get(index)
        if match is not None:
            open_tags = open_tags - 1 if match.group(1) else open_tags + 1
            index = match.end()
        else:
            depth += {"[": 1, "]": -1}.get(text[index], 0)
            index += 1
        if depth <= 0 and open_tags <= 0:
            settled = index
    return settled


class TextStreamChunker:
    """Text pieces in, final streaming chunks out (see the module docstring).

    Args:
        max_bytes, max_speakers: the chunk limits (`chunk_lines`; default the published ~300 bytes
            and 3 speakers). Smaller chunks start speaking sooner: chunk k is final only once the
            text has reached about one chunk past it.
        location: names the text in errors ("text"); a bad piece is named `location[i]`.
    """

    def __init__(self, max_bytes: int = CHUNK_BYTES, max_speakers: int = CHUNK_SPEAKERS, location: str = "text"):
        if max_bytes < 1 or max_speakers < 1:
            raise ValueError(f"max_bytes and max_speakers must be positive; got {max_bytes}, {max_speakers}")
        self.max_bytes, self.max_speakers, self.location = max_bytes, max_speakers, location
        self.text = ""
        self.pieces = 0
        self.ended = False
        self.chunks: list[TextChunk] = []
        self._checked_length = 0
        self._open_tail_bytes = 0

    def feed(self, piece: Any) -> list[TextChunk]:
        """Add one piece of text; returns the chunks it made final (often none)."""
        if self.ended:
            raise ValueError(f"{self.location}: the text has ended; no piece can follow")
        if not isinstance(piece, str):
            raise ValueError(f"{self.location}[{self.pieces}]: a text piece must be a str; got {type(piece).__name__}")
        self.text += piece
        self.pieces += 1
        return self._new_chunks()

    def finish(self) -> list[TextChunk]:
        """The end of the text: returns the chunks still to come. Text that is empty, or ends inside
        a tag, is refused here as the batch API refuses it."""
        if self.ended:
            return []
        self.ended = True
        chunks = self._new_chunks()
        if not self.chunks:
            parse_text(self.text, self.location)  # raises: the text holds nothing to speak
        return chunks

    def _new_chunks(self) -> list[TextChunk]:
        settled = self.text if self.ended else self.text[: settled_length(self.text)]
        if not self.ended and not self._may_have_new_chunk(settled):
            return []
        pieces = split_speaker_tags(settled, self.location)
        if not strip_white_space("".join(piece for piece in pieces if isinstance(piece, str))):
            if self.ended:
                parse_text(settled, self.location)  # raises "text is empty"
            return []
        lines = parse_text(settled, self.location)
        chunks = chunk_lines(lines, self.max_bytes, self.max_speakers)
        open_line = not self.ended and isinstance(pieces[-1], str) and bool(strip_white_space(pieces[-1]))
        final_pieces = sum(len(chunk) for chunk in chunks) - (1 if open_line else 0)
        self._remember(settled, lines[-1].text if open_line else "", chunks[-1][-1].text if open_line else "")
        made = []
        passed = sum(len(chunk.lines) for chunk in self.chunks)
        for chunk in chunks[len(self.chunks) :]:
            passed += len(chunk)
            if not self.ended and passed >= final_pieces:
                break
            made.append(TextChunk(len(self.chunks) + len(made), chunk, self.pieces - 1))
        self.chunks += made
        return made

    def _remember(self, settled: str, open_line: str, tail: str) -> None:
        """What `_may_have_new_chunk` needs: how far the text was read, and an upper bound on the
        bytes of the open line after its last cut: its last piece (`tail`, a suffix of the line's
        text `open_line`), the white space before it (a cut lies in or at the start of that run)
        and the white space the line view stripped at the end of the settled text."""
        self._checked_length = len(settled)
        before = open_line[: len(open_line) - len(tail)]
        gap = len(before) - len(before.rstrip())
        trailing = len(settled) - len(settled.rstrip())
        run = open_line[len(before) - gap :] + settled[len(settled) - trailing :]
        self._open_tail_bytes = len(run.encode("utf-8"))

    def _may_have_new_chunk(self, settled: str) -> bool:
        """False when the settled text cannot have made a piece final since it was last read: no
        speaker tag came (which closes a line), and the open line cannot yet hold more than
        `max_bytes` after its last cut. This keeps a long stream from re-reading its text at every
        piece."""
        if len(settled) <= self._checked_length:
            return False
        grown = settled[self._checked_length :]
        if "<|" in settled[max(0, self._checked_length - 1) :]:
            return True
        return self._open_tail_bytes + len(grown.encode("utf-8")) > self.max_bytes
