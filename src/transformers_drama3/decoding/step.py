"""THE decode step: one frame for every item of a batch, on fixed shapes.

    draw   main token  <- lm_head restricted to the semantic band + eos (+ `<|audio_separator|>`
                          while an item has line boundaries left), drawn by the sampler (RAS)
           codes 1..9  <- the tower over the open row, each code drawn before the next layer
    feed   next row    <- [main, c0..c9] through the backbone, into the cache's next column

`draw` and `feed` are the whole step; the text stream runs them one after the other
(`DecodeRun.steps()`), `generate()`, `stream()`, GRPO and the serving engine as one function,
`step` (`DecodeRun.steps_ahead()`, `Drama3Engine`); eagerly or compiled by
`torch.compile(fullgraph=True)` (one graph each, which CUDA graphs replay). No branch reads a tensor: an item that drew eos or a line boundary, or ended before, goes
through the same ops as one that speaks, its codes masked to zero. `DecodeRun.steps()` feeds a
row only while some item is still speaking, so a run leaves its cache as the growing cache of the
reference loop left it: the open row is the last row fed (`steps_ahead()` feeds the last step's row
too, past the end, and its run is not continued).

Random numbers are computed inside the step from each item's key and step count
(`counter_noise`; `draw` moves the count on): a seeded item draws the same numbers whatever else
is in the batch, eagerly or compiled, and a compiled step's draws are in its graph.

Phoneme alignment (`alignment.AlignmentMasks`) restricts the main token and the phoneme
codebooks and follows every drawn phoneme code, in masks and gathers on fixed shapes: a compiled
step holds it in its graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .alignment import draw_within
from .state import DecodeCache, DecodeState


@dataclass
class StepOutput:
    """What `draw` produced: main_ids [batch] the drawn main token; frames [batch, num_codebooks]
    (zeros where no frame was made); speaking [batch]: this is one of the item's frames; ended
    [batch]: the item ended at this step (eos, or its budget is used up); eos [batch]: ended with
    eos; boundary [batch]: drew `<|audio_separator|>` (no frame)."""

    main_ids: torch.Tensor
    frames: torch.Tensor
    speaking: torch.Tensor
    ended: torch.Tensor
    eos: torch.Tensor
    boundary: torch.Tensor


def restricted_main_logits(model, hidden: torch.Tensor, separator_id: int | None, separators_left: torch.Tensor) -> torch.Tensor:
    """Main logits `[batch, 1, codebook_size + 1 (+ 1)]`: the semantic band and eos, then
    `<|audio_separator|>` (-inf for an item with no boundary left) when `separator_id` is given."""
    logits = model.speech_logits(hidden)
    if separator_id is None:
        return logits
    row = model.get_output_embeddings().weight[separator_id : separator_id + 1]
    separator = torch.nn.functional.linear(hidden, row).to(logits.dtype)  # [batch, 1, 1]
    separator = separator.masked_fill((separators_left <= 0)[:, None, None], float("-inf"))
    return torch.cat((logits, separator), dim=-1)


def draw(model, cache: DecodeCache, sampler, state: DecodeState, separator_id: int | None):
    """Draw the next frame of every item from the open row: the main token, then the tower's codes
    (the tower takes the open row into its cache). Returns (StepOutput, the state with the
    counters moved on: produced, active, separators left; the open row is still the old one)."""
    config = model.config
    aligner = state.alignment
    logits = restricted_main_logits(model, state.hidden, separator_id, state.separators_left)
    if aligner is not None:
        logits = aligner.main_logits(logits)
    main_ids = sampler.main_token(logits, state.active)  # [batch, 1]
    eos = main_ids[:, 0] == config.eos_token_id
    boundary = state.active & (main_ids[:, 0] == separator_id) if separator_id is not None else torch.zeros_like(eos)
    speaking = state.active & ~eos & ~boundary
    semantic = (main_ids - config.semantic_start_token_id).clamp(0, config.codebook_size - 1)
    if aligner is not None:
        aligner.observe(semantic[:, 0], speaking)

    def sample(head_logits, codebook_index):
        return draw_within(
            aligner, lambda head: sampler.codebook(head, codebook_index), head_logits, codebook_index, speaking
        )

    tower = cache.tower_part
    frames = model.sample_acoustic_codes(
        state.hidden, state.ids, state.codes, semantic, (~boundary)[:, None], state.position,
        state.key_mask[:, None, None, : tower.window], cache.tower, sample,
    )
    tower.next_column.add_(1)
    sampler.advance()
    frames = frames.masked_fill(~speaking[:, None, None], 0)
    produced = state.produced + speaking.long()
    ended = state.active & (eos | (produced >= state.budgets))
    output = StepOutput(main_ids[:, 0], frames[:, 0], speaking, ended, eos & ended, boundary)
    counted = replace(
        state, active=state.active & ~ended, produced=produced, separators_left=state.separators_left - boundary.long()
    )
    return output, counted


def feed(model, cache: DecodeCache, state: DecodeState, main_ids: torch.Tensor, frames: torch.Tensor) -> DecodeState:
    """Feed one new row per item, main_ids [batch] / frames [batch, num_codebooks], through the
    backbone into the cache's next column: the one backbone decode row. Returns the state whose
    open row it is."""
    backbone = cache.backbone_part
    columns = torch.arange(cache.capacity, device=state.key_mask.device)
    key_mask = state.key_mask | (columns[None, :] == backbone.next_column[:, None])
    position = state.position + 1
    ids, codes = main_ids[:, None], frames[:, None]
    hidden = model.backbone(
        inputs_embeds=model.embed_rows(ids, codes),
        attention_mask={"full_attention": key_mask[:, None, None, : backbone.window], "linear_attention": None},
        position_ids=position,
        cache=cache.backbone,
        use_cache=True,
    ).last_hidden_state
    backbone.next_column.add_(1)
    return replace(state, hidden=hidden, ids=ids, codes=codes, key_mask=key_mask, position=position)


def step(model, cache: DecodeCache, sampler, state: DecodeState, separator_id: int | None):
    """`draw`, then `feed` of the row it drew, in one function: one graph for `torch.compile`, one
    CUDA graph to replay. It feeds the row without asking whether any item still speaks, so a
    run stepped by it holds a row past its end (`DecodeRun.steps_ahead`: runs that are not
    continued). Returns (StepOutput, the state whose open row is the row just fed)."""
    output, counted = draw(model, cache, sampler, state, separator_id)
    return output, feed(model, cache, counted, output.main_ids, output.frames)
