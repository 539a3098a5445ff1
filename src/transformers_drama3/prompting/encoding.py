"""Layout -> rows: each literal tokenized on its own, audio frames as `[semantic_start + c0, c0..]`.

The rows carry what the layout says about them (`PromptRows.speak_span`, `boundaries_left`), so
generation reads the turn to speak and the line boundaries it must draw from the layout instead of
searching token ids."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from .layout import Frames, Literal, Segment, Special, Spoken
from .phonemes import PhonemeFrontEnd, phoneme_symbol, phoneme_symbols
from .text import (
    AUDIO_SEPARATOR,
    CODEBOOK_SIZE,
    IGNORE_INDEX,
    IM_END,
    IM_START,
    INTERLEAVE,
    NUM_SPEAKERS,
    TEXT,
    VOICE,
    semantic_token,
    speaker_token,
)


@dataclass
class PromptRows:
    """One prompt's rows.

    input_ids: [rows] main token per row (`<|semantic:c0|>` on audio rows).
    audio_codes: [rows, num_codebooks] (zeros on text rows).
    supervised: [rows] bool, True where the row is the model's own output (labels keep it).
    speak_span: (start, stop) rows of the text of the turn the model speaks (the last one marked
        by the layout); (0, 0) for a layout that marks none.
    boundaries_left: line boundaries (`<|audio_separator|>`) the model still has to draw: the
        separators of the turn to speak minus those its voice turn already holds.
    """

    input_ids: torch.Tensor
    audio_codes: torch.Tensor
    supervised: torch.Tensor
    speak_span: tuple[int, int] = (0, 0)
    boundaries_left: int = 0

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
    phonemes: dict[str, int] = field(default_factory=dict)
    """phoneme symbol -> id, for a tokenizer with phoneme tokens (`phonemes.phoneme_token`)."""

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
        phonemes = {symbol: index for token, index in vocab.items() if (symbol := phoneme_symbol(token)) is not None}
        return cls(special=special, semantic_start=vocab[first], codebook_size=codebook_size, pad=pad, phonemes=phonemes)

    def id_of(self, token: str) -> int:
        if token not in self.special:
            raise ValueError(
                f"this layout needs {token}, which the tokenizer does not have (it is a token of the "
                f"layouts designed from the paper; see docs/prompt_layouts.md)"
            )
        return self.special[token]

    @cached_property
    def phoneme_of_id(self) -> dict[int, str]:
        """id -> phoneme symbol: the inverse of `phonemes`, built once (rows parse back run by run)."""
        return {index: symbol for symbol, index in self.phonemes.items()}

    def phoneme_ids(self, phonemes: str) -> list[int]:
        """One id per phoneme symbol (`phonemes.phoneme_symbols`); a symbol the vocabulary lacks is
        spelled by its characters, and a character it lacks is left out, with a warning (a foreign
        word should not stop the model from speaking the rest)."""
        symbols = [
            part for symbol in phoneme_symbols(phonemes)
            for part in ([symbol] if symbol in self.phonemes else list(symbol))
        ]
        unknown = sorted({symbol for symbol in symbols if symbol not in self.phonemes})
        if unknown:
            warnings.warn(f"phoneme symbols {unknown} are not in the tokenizer's vocabulary; left out", stacklevel=3)
        return [self.phonemes[symbol] for symbol in symbols if symbol in self.phonemes]

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


def spoken_ids(text: str, tokenizer, ids: TokenIds, front_end: PhonemeFrontEnd) -> list[int]:
    """Ids of spoken text through a phoneme front end: phonemes one symbol a token, tags as text."""
    token_ids: list[int] = []
    for piece in front_end.pieces(text):
        token_ids += ids.phoneme_ids(piece.content) if piece.phonemes else encode_text(tokenizer, piece.content)
    return token_ids


def _literal_ids(
    literal: Literal, tokenizer, ids: TokenIds, front_end: PhonemeFrontEnd | None = None
) -> tuple[list[int], list[bool]]:
    """A literal's ids and supervision flags: runs of text tokenized on their own, specials by id.

    Without a front end spoken text is text like the rest (the published rows); with one it is
    tokenized on its own, through the front end."""
    token_ids: list[int] = []
    flags: list[bool] = []
    text = ""
    for part in [*literal.parts, None]:
        if isinstance(part, str) or (isinstance(part, Spoken) and front_end is None):
            text += part if isinstance(part, str) else part.text
            continue
        if text:
            pieces = encode_text(tokenizer, text)
            token_ids += pieces
            flags += [False] * len(pieces)
            text = ""
        if isinstance(part, Spoken):
            pieces = spoken_ids(part.text, tokenizer, ids, front_end)
            token_ids += pieces
            flags += [False] * len(pieces)
        elif isinstance(part, Special):
            token_ids.append(ids.id_of(part.token))
            flags.append(part.supervised)
    return token_ids, flags


def _separators(segment: Segment) -> int:
    if isinstance(segment, Frames):
        return 0
    return sum(isinstance(part, Special) and part.token == AUDIO_SEPARATOR for part in segment.parts)


def encode_layout(
    segments: Sequence[Segment], tokenizer, ids: TokenIds, num_codebooks: int, front_end: PhonemeFrontEnd | None = None
) -> PromptRows:
    """Rows of a layout: each literal tokenized on its own, audio as `[semantic_start + c0, c0..]` rows;
    spoken text through `front_end` when the model has one."""
    main: list[torch.Tensor] = []
    codes: list[torch.Tensor] = []
    supervised: list[torch.Tensor] = []
    rows = 0
    speak_span, speak_index = (0, 0), None
    for index, segment in enumerate(segments):
        if isinstance(segment, Frames):
            frames = segment.codes.shape[1]
            main.append(segment.codes[0] + ids.semantic_start)
            codes.append(segment.codes.T)
            supervised.append(torch.full((frames,), segment.supervised))
            rows += frames
            continue
        token_ids, flags = _literal_ids(segment, tokenizer, ids, front_end)
        if segment.speak:
            speak_span, speak_index = (rows, rows + len(token_ids)), index
        main.append(torch.tensor(token_ids, dtype=torch.long))
        codes.append(torch.zeros(len(token_ids), num_codebooks, dtype=torch.long))
        supervised.append(torch.tensor(flags, dtype=torch.bool))
        rows += len(token_ids)
    boundaries_left = 0
    if speak_index is not None:
        drawn = sum(_separators(segment) for segment in segments[speak_index + 1 :])
        boundaries_left = max(0, _separators(segments[speak_index]) - drawn)
    return PromptRows(torch.cat(main), torch.cat(codes), torch.cat(supervised), speak_span, boundaries_left)
