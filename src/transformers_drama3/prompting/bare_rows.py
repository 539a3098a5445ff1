"""The layout read back from bare token ids: the one fallback for rows given without metadata.

The processor returns its rows with the layout's metadata (`speak_span`: the rows of the text of
the turn to speak; `boundaries_left`: the line boundaries still to draw), and every consumer reads
that. Rows that come without it (raw tensors handed to `generate()`, a serving job built from ids)
are read here, and only here, from the published layout's `<|im_end|>` tokens:

    ... <|im_end|>\\n <|im_start|>user\\n lines <|im_end|>\\n <|im_start|>assistant\\n<|voice|> ...

the turn to speak lies between the last two `<|im_end|>` (the whole prompt when there are fewer),
and the system turn (instructions and references, shared by every request of a voice) ends at the
first.
"""

from __future__ import annotations

import torch


def _turn_ends(ids: torch.Tensor, real: torch.Tensor, im_end_id: int) -> list[int]:
    return ((ids == im_end_id) & real).nonzero().flatten().tolist()


def turn_spans(input_ids: torch.Tensor, attention_mask: torch.Tensor, im_end_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the turn to speak of each prompt [batch, rows], as `speak_span` says them:
    (spans [batch, 2] start/stop, found [batch] whether the prompt had two `<|im_end|>`; where it had
    not, the span is every row)."""
    spans, found = [], []
    for ids, real in zip(input_ids, attention_mask.bool()):
        ends = _turn_ends(ids, real, im_end_id)
        found.append(len(ends) >= 2)
        spans.append((ends[-2] + 1, ends[-1]) if len(ends) >= 2 else (0, ids.shape[0]))
    return torch.tensor(spans, dtype=torch.long).reshape(-1, 2), torch.tensor(found, dtype=torch.bool)


def boundaries_left_of_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, im_end_id: int,
                            separator_id: int) -> torch.Tensor:
    """Line boundaries each prompt still has to speak, `[batch]`, as `boundaries_left` says them.

    A line-by-line prompt separates its k lines with k - 1 separators in the last user turn; its
    voice turn (after the last `<|im_end|>`) already holds one separator per line it continues
    from. Other layouts give 0: the published one has no separator, infilling has one only in the
    voice turn."""
    spans, found = turn_spans(input_ids, attention_mask, im_end_id)
    separators = (input_ids == separator_id) & attention_mask.bool()
    counts = []
    for item, ((start, stop), has_turn) in enumerate(zip(spans.tolist(), found.tolist())):
        between = int(separators[item, start:stop].sum())
        after = int(separators[item, stop + 1 :].sum())
        counts.append(max(0, between - after) if has_turn else 0)
    return torch.tensor(counts, dtype=torch.long, device=input_ids.device)


def system_turn_rows(input_ids: torch.Tensor, im_end_id: int) -> int:
    """Rows of the system turn of one prompt [1, rows], up to its first `<|im_end|>` (the prefix every
    request of a voice shares); 0 when the prompt has no turn after it or it is under 2 rows."""
    ends = _turn_ends(input_ids[0], torch.ones_like(input_ids[0], dtype=torch.bool), im_end_id)
    if len(ends) < 2:  # a prompt without a turn after the system turn has nothing to share
        return 0
    return ends[0] if ends[0] >= 2 else 0


def spoken_frames(rows: torch.Tensor, semantic_start: int, codebook_size: int, eos_id: int, pad_id: int,
                  separator_id: int | None = None) -> torch.Tensor:
    """The frames of the voice turn a prompt's rows end in: one item's rows [rows, 1 + num_codebooks]
    (`[main_id, c0..c9]`, as generate() returns them in `sequences`) -> codes [frames, num_codebooks].

    generate() continues a prompt with frames, `<|audio_separator|>`s, then eos and padding; so the
    voice turn is read from the end: past the padding and eos (`pad_id`, `eos_id`), back over the
    semantic rows and separators, up to the first other row (`<|voice|>` in the published layout).
    Its semantic rows are the frames (frames the prompt's voice turn already held included); a
    `<|semantic:0|>` frame right before eos is left out, as generate() leaves it out of its takes
    (it decodes to a click)."""
    ids = rows[:, 0]
    semantic = (ids >= semantic_start) & (ids < semantic_start + codebook_size)
    voice = semantic if separator_id is None else semantic | (ids == separator_id)
    end = ids.shape[0]
    while end > 0 and int(ids[end - 1]) in (pad_id, eos_id):
        end -= 1
    start = end
    while start > 0 and bool(voice[start - 1]):
        start -= 1
    ended_by_eos = end < ids.shape[0] and int(ids[end]) == eos_id
    if ended_by_eos and end > start and bool(semantic[end - 1]) and int(rows[end - 1, 1]) == 0:
        end -= 1  # the click frame
    return rows[start:end][semantic[start:end]][:, 1:]
