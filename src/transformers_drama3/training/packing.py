"""Packing several examples into one row, with document masking.

`PackingCollator` lays examples end to end into rows of at most `max_rows` positions and marks
each position with its document (`document_ids`, 1-based, 0 = padding) and its position inside the
document (`position_ids`, restarting at 0). The stage-3 recipe trains on such rows with document
masking: each example sees only itself, in the backbone and in the tower.
`Drama3ForSpeechGeneration.forward(document_ids=...)` does that masking (see its docstring and
docs/training.md, "Packing"), so a packed batch goes to the model as it is, with `Trainer` or
`Drama3Trainer`.

`unpack` turns a packed batch back into one padded row per document, which is exact by
construction: the reference the packed forward is tested against, and what `Drama3Trainer` does
for a flash-attention backbone, which takes no block-diagonal mask.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..prompting import IGNORE_INDEX
from .collators import RowCollator

PACKED_KEYS = ("input_ids", "audio_codes", "labels", "document_ids", "position_ids")


def pack_greedy(lengths: Sequence[int], max_rows: int) -> list[list[int]]:
    """First-fit-decreasing bins of example indices whose lengths sum to at most `max_rows`."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        if length > max_rows:
            raise ValueError(f"example {index} has {length} rows; more than max_rows={max_rows} (cut it first)")
        for slot, free in enumerate(room):
            if length <= free:
                bins[slot].append(index)
                room[slot] -= length
                break
        else:
            bins.append([index])
            room.append(max_rows - length)
    return [sorted(members) for members in bins]


class PackingCollator:
    """Wraps a `RowCollator`: builds each example's rows, packs them, returns a packed batch.

    Output: `input_ids`, `audio_codes`, `labels`, `attention_mask` [rows, max_rows] plus
    `document_ids` and `position_ids`; `row_weights` when the inner collator makes them.
    """

    def __init__(self, collator: RowCollator, max_rows: int):
        self.collator = collator
        self.max_rows = max_rows

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        built = [self.collator.example_rows(example, position) for position, example in enumerate(examples)]
        bins = pack_greedy([len(rows) for rows, _ in built], self.max_rows)
        count, width = len(bins), self.max_rows
        pad_id = self.collator.processor.token_ids.pad
        num_codebooks = built[0][0].audio_codes.shape[1]
        batch = {
            "input_ids": torch.full((count, width), pad_id, dtype=torch.long),
            "audio_codes": torch.zeros(count, width, num_codebooks, dtype=torch.long),
            "labels": torch.full((count, width), IGNORE_INDEX, dtype=torch.long),
            "attention_mask": torch.zeros(count, width, dtype=torch.long),
            "document_ids": torch.zeros(count, width, dtype=torch.long),
            "position_ids": torch.zeros(count, width, dtype=torch.long),
        }
        weighted = any(weights is not None for _, weights in built)
        if weighted:
            batch["row_weights"] = torch.zeros(count, width)
        document = 0
        for row, members in enumerate(bins):
            start = 0
            for index in members:
                rows, weights = built[index]
                span = slice(start, start + len(rows))
                document += 1
                batch["input_ids"][row, span] = rows.input_ids
                batch["audio_codes"][row, span] = rows.audio_codes
                batch["labels"][row, span] = rows.labels
                batch["attention_mask"][row, span] = 1
                batch["document_ids"][row, span] = document
                batch["position_ids"][row, span] = torch.arange(len(rows))
                if weighted:
                    batch["row_weights"][row, span] = 1.0 if weights is None else weights
                start += len(rows)
        return batch


def is_packed(batch: dict) -> bool:
    return "document_ids" in batch


def unpack(batch: dict, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A packed batch -> one right-padded row per document (exact document masking).

    Returns `input_ids`, `audio_codes`, `labels`, `attention_mask` [documents, longest] and
    `row_weights` when the packed batch has them, documents in id order. Right padding (with
    `pad_id`, masked) never changes the rows before it: every layer is causal."""
    document_ids = batch["document_ids"]
    documents = [d for d in document_ids.unique().tolist() if d != 0]
    places = [(document_ids == d).nonzero() for d in documents]  # [(row, position)] each
    longest = max(len(place) for place in places)
    out = {
        "input_ids": batch["input_ids"].new_full((len(documents), longest), pad_id),
        "audio_codes": batch["audio_codes"].new_zeros(len(documents), longest, batch["audio_codes"].shape[-1]),
        "labels": batch["labels"].new_full((len(documents), longest), IGNORE_INDEX),
        "attention_mask": batch["attention_mask"].new_zeros(len(documents), longest),
    }
    if "row_weights" in batch:
        out["row_weights"] = batch["row_weights"].new_zeros(len(documents), longest)
    for item, place in enumerate(places):
        rows, positions = place[:, 0], place[:, 1]
        span = slice(0, len(place))
        out["input_ids"][item, span] = batch["input_ids"][rows, positions]
        out["audio_codes"][item, span] = batch["audio_codes"][rows, positions]
        out["labels"][item, span] = batch["labels"][rows, positions]
        out["attention_mask"][item, span] = 1
        if "row_weights" in batch:
            out["row_weights"][item, span] = batch["row_weights"][rows, positions]
    return out
