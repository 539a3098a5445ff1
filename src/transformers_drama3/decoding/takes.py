"""What `generate()` gives back: `Drama3GenerationOutput` (GenerationMixin's output with the takes,
their lengths, reasons and guard findings beside it) and `split_lines` (one take cut at its line
boundaries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.generation import GenerateDecoderOnlyOutput


@dataclass
class Drama3GenerationOutput(GenerateDecoderOnlyOutput):
    """What `generate(..., return_dict_in_generate=True)` returns: transformers'
    `GenerateDecoderOnlyOutput`, whose rows are Drama 3's rows, and the takes beside them.

    A row is what the backbone reads at one position: `[main_id, c0, ..., c9]` (a text row: its token
    id and zero codes; an audio row: `<|semantic:c0|>` and the frame's codes). `sequences[..., 0]`
    and `sequences[..., 1:]` are a forward's `input_ids` and `audio_codes`.

    Args:
        sequences: [batch * num_return_sequences, prompt_rows + steps, 1 + num_codebooks] the prompt
            rows as given (left padding included), then one row per decode step: a frame as drawn,
            a drawn `<|audio_separator|>` or eos (zero codes), or, once the item has ended,
            `pad_token_id` (zero codes).
        scores: with `output_scores`, per step [batch, vocab_size] (float32): the main token's
            logits as the step's sampler draws from them: the speech head's logits at every id the
            step may draw (the semantic band, eos, `<|audio_separator|>` while a line boundary is
            left, within the phoneme alignment where the generation config aligns), after the
            sampling warpers (temperature, top-k, top-p; none for greedy); -inf at every other id.
            A main token that repetition-aware sampling replaced came from its second draw
            (temperature 1.0, top-p 0.95, top-k 30; `ras_replacements` counts them).
        logits: with `output_logits`, per step [batch, vocab_size] (float32): the same logits
            before the warpers. The speech step computes the head only at the ids a frame's main
            token may be; every other id (the text vocabulary) is -inf.
        hidden_states: with `output_hidden_states`, per step the backbone's hidden states (the
            embeddings and one per layer, as `Qwen3_5MoeTextModel` returns them): step 0's
            [batch, prompt_rows, hidden] (the prefill), later steps' [batch, 1, hidden].
        attentions, cache: None (`output_attentions` is refused; the decode cache is the run's own:
            it holds rows fed past the end of the run and cannot continue it).
        codebook_scores, codebook_logits: with `output_scores` / `output_logits`, per step
            [batch, num_codebooks - 1, codebook_size] (float32): the tower heads' logits for codes
            1..9 of the step's frame, after / before the codebook sampling warpers.
        audio_codes: [batch, frames, num_codebooks] the takes, 0 after each item's length: the
            frames of the new rows, without line separators and without a `<|semantic:0|>` frame
            right before eos (it decodes to a click).
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

    codebook_scores: tuple[torch.Tensor, ...] | None = None
    codebook_logits: tuple[torch.Tensor, ...] | None = None
    audio_codes: torch.LongTensor | None = None
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
