"""Rows -> the request they encode: the inverse of `encoding.encode_layout` for every layout.

Used by round-trip tests and to inspect training data. A published turn parses back to its text
as given, so the request writes the same rows again."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from .encoding import TokenIds
from .layout import Special
from .phonemes import phoneme_literal
from .script import Infill, Line, LineByLineScript, Reference, Request, Script, StreamingScript, Take
from .text import (
    AUDIO_SEPARATOR,
    IM_END,
    IM_START,
    INTERLEAVE,
    REFERENCE_INSTRUCTION,
    SPEAKER_TAG,
    TTS_INSTRUCTION,
    VOICE,
    leading_speaker,
)


@dataclass
class Message:
    """One ChatML message parsed from rows: role and content items (text, special token, codes)."""

    role: str
    items: list[str | Special | torch.Tensor] = field(default_factory=list)
    closed: bool = False


def _is_special(item: object, token: str) -> bool:
    return isinstance(item, Special) and item.token == token


def _decode_text(token_ids: list[int], tokenizer, ids: TokenIds) -> str:
    """A run of text ids as text; runs of phoneme ids (a phoneme front end) as `phoneme_literal`s,
    which that front end reads back to the same ids."""
    symbols = ids.phoneme_of_id
    out, start = [], 0
    while start < len(token_ids):
        phonemes = token_ids[start] in symbols
        end = start + 1
        while end < len(token_ids) and (token_ids[end] in symbols) == phonemes:
            end += 1
        run = token_ids[start:end]
        out.append(phoneme_literal("".join(symbols[i] for i in run)) if phonemes else tokenizer.decode(run))
        start = end
    return "".join(out)


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
            items.append(_decode_text(input_ids[index:end].tolist(), tokenizer, ids))
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


def _turn_text(items: Sequence[str | Special | torch.Tensor]) -> str:
    """A published user turn's items -> its text as given (speaker tags spelled out again)."""
    text = ""
    for item in items:
        if isinstance(item, Special) and item.token.startswith("<|speaker:"):
            text += item.token
        elif isinstance(item, str):
            text += item
        else:
            raise ValueError(f"unexpected {item!r} in a user turn")
    return text


def _reference(transcript: str) -> Reference:
    """A written transcript (it starts with its speaker tag) -> the simplest reference that writes
    it again: an untagged transcript when the tag is followed by one space and no further tag."""
    tag = SPEAKER_TAG.match(transcript)
    if tag is None:
        raise ValueError(f"bad reference transcript {transcript!r}: it must start with a speaker tag")
    rest = transcript[tag.end() :]
    if rest.startswith(" ") and leading_speaker(rest[1:]) is None:
        return Reference(rest[1:], None, int(tag.group(1)))
    return Reference(transcript, None, int(tag.group(1)))


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
        header = items.pop(0)
        if not (isinstance(header, str) and _REFERENCE_HEAD.fullmatch(header)):
            raise ValueError(f"bad reference header {header!r}")
        cut = next((index for index, item in enumerate(items) if isinstance(item, torch.Tensor)), None)
        if cut is None:
            raise ValueError("a reference has no audio frames")
        written, codes = _turn_text(items[:cut]), items[cut]
        del items[: cut + 1]
        if not written.endswith("\nSpeech: "):
            raise ValueError(f"bad reference transcript {written!r}")
        reference = _reference(written[: -len("\nSpeech: ")])
        references.append(replace(reference, audio=codes))
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
    history = [Take(_turn_text(u.items), _take_codes(a)) for u, a in pairs[:-1]]
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
    lines = _turn_text(user.items)
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
    lines = _turn_text(user.items)
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
