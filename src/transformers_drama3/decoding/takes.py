"""What a decode run gives back: `Drama3GenerationOutput` (the takes, their lengths, reasons and
guard findings) and `split_lines` (one take cut at its line boundaries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput


@dataclass
class Drama3GenerationOutput(ModelOutput):
    """What `generate(..., return_dict_in_generate=True)` returns.

    Args:
        audio_codes: [batch, frames, num_codebooks] the takes, 0 after each item's length.
        sequences: the same tensor under the name `GenerationMixin` users (and the text-to-audio
            pipeline, which decodes it with the processor) read.
        lengths: [batch] frames of each take.
        audio: per item a waveform [samples] (when a codec was given).
        finish_reasons: per item "eos" or "length" (budget or max_new_tokens used up).
        budgets: [batch] frames each take was allowed.
        expected_frames: [batch] the expected duration of each take, in frames.
        anomalies: per item the guard findings (see `detect_anomalies`).
        regenerations: one record per regenerated item and attempt: {"item", "attempt",
            "anomalies" (before), "new_anomalies", "kept"}.
        ras_replacements: [batch] main tokens RAS replaced.
        clicks_dropped: per item whether a `<|semantic:0|>` frame before eos was dropped.
        time_to_first_audio: seconds from the call to the first streamed chunk (with a streamer).
        line_boundaries: per item, the frame index where each new line starts (one per
            `<|audio_separator|>` drawn, line-by-line prompts only): item b's line k is
            `audio_codes[b, bounds[k - 1]:bounds[k]]` with bounds = [0, *line_boundaries[b],
            lengths[b]] (see `split_lines`).
    """

    audio_codes: torch.LongTensor | None = None
    sequences: torch.LongTensor | None = None
    lengths: torch.LongTensor | None = None
    audio: list[torch.Tensor] | None = None
    finish_reasons: list[str] | None = None
    budgets: torch.LongTensor | None = None
    expected_frames: torch.Tensor | None = None
    anomalies: list[list[str]] | None = None
    regenerations: list[dict] | None = None
    ras_replacements: torch.LongTensor | None = None
    clicks_dropped: list[bool] | None = None
    time_to_first_audio: float | None = None
    line_boundaries: list[list[int]] | None = None


def split_lines(take: torch.Tensor, line_boundaries: Sequence[int]) -> list[torch.Tensor]:
    """One take's frames [frames, ...] -> one piece per line, cut at its line boundaries."""
    bounds = [0, *line_boundaries, take.shape[0]]
    return [take[start:end] for start, end in zip(bounds[:-1], bounds[1:])]
