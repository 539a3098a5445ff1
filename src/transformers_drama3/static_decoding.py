"""The static decode step: preallocated caches, fixed shapes, one graph per frame.

The eager decode loop (`generation_drama3.decode_from`) is the reference: its caches grow by a
`torch.cat` per row, and it skips the tower when no item makes a frame. On a GPU each of the
thousands of small ops of a step is a kernel launch, so a step is bound by launches; a step whose
shapes never change and whose control flow never reads a tensor can be compiled into one graph
(`torch.compile(fullgraph=True)`), which CUDA graphs then replay in one launch.

What makes a step static:

- **Caches of a fixed size.** The backbone's attention layers and every tower layer keep their
  keys and values in tensors of `max_length` rows (transformers' `StaticLayer`), written in place
  at the row's slot; the Gated DeltaNet layers' conv and recurrent states have a fixed shape
  already and are updated in place. `Drama3StaticCache.from_filled` takes them over from the
  dynamic cache a prefill filled (the prefill runs once per request, eagerly, as before).
- **Masks instead of lengths.** A `[batch, max_length]` key mask says which slots hold rows; a
  step marks the slot of the row it feeds. Positions are a tensor, one per item.
- **Every branch taken.** The tower always runs (the eager loop skips it only on the last step,
  when every item drew eos), and what an item that makes no frame drew is masked to zero codes.
- **Random numbers drawn outside.** Seeded requests draw from one `torch.Generator` per item, which
  a graph cannot hold; the sampler draws a step's numbers before the step, in the order the eager
  step would draw them (`Drama3Sampler.step_noise`), and takes back the ones an item that made no
  frame would not have drawn (`Drama3Sampler.rewind`). So the static step draws the same samples.

`static_step` is that one step: the main token, the tower's codes 1..9, and the next row through
the backbone, in tensors in and tensors out. It is the function `torch.compile` takes
(`compiled_step`); uncompiled it is the static path's own eager reference.

Place among the modules: below the decode loop (`generation_drama3` imports this module, never the
reverse); it drives the model through the same methods the eager loop does (`speech_logits`,
`sample_acoustic_codes`, `embed_rows`, the backbone), and the sampler through `main_token` /
`codebook` with the step's noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import CompileConfig
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin, StaticLayer

MIN_STATIC_LENGTH = 256
"""The smallest cache a static request gets; lengths round up to powers of two from here, so one
compiled step serves every request of the same batch size and length class."""

CACHE_IMPLEMENTATIONS = ("dynamic", "static")


def static_length(rows: int) -> int:
    """Cache rows for a request that may feed `rows` rows: the next power of two >= `rows`
    (at least `MIN_STATIC_LENGTH`)."""
    return max(MIN_STATIC_LENGTH, 1 << max(0, math.ceil(math.log2(max(rows, 1)))))


def check_cache_implementation(name: str | None) -> None:
    if name is not None and name not in CACHE_IMPLEMENTATIONS:
        raise ValueError(
            f"cache_implementation={name!r}; Drama 3 decodes with one of {list(CACHE_IMPLEMENTATIONS)} "
            f"(None: dynamic)"
        )


# ----------------------------------------------------------------------------- the cache


@dataclass
class Drama3StaticCache:
    """Preallocated decode state: the backbone's hybrid cache (static attention layers, the Gated
    DeltaNet layers' fixed-size states) and one static key/value layer per tower layer, each of
    `max_length` rows; row r of the prompt and of the decoded frames lives in slot r."""

    backbone: Cache
    tower: Cache
    max_length: int

    @classmethod
    def from_filled(cls, cache, max_length: int) -> Drama3StaticCache:
        """Take over a filled `Drama3Cache` (what `prefill` leaves): its keys and values are copied
        into slots 0.., its recurrent layers are kept as they are (they are static already).
        `max_length` must hold every row the request may feed."""
        filled = cache.backbone.get_seq_length()
        if filled >= max_length:
            raise ValueError(f"max_length={max_length}: the prompt already fills {filled} rows")
        return cls(_static_layers(cache.backbone, max_length), _static_layers(cache.tower, max_length), max_length)


def _static_layers(dynamic: Cache, max_length: int) -> Cache:
    layers = []
    for layer in dynamic.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layers.append(layer)  # conv + recurrent states: fixed shapes, updated in place
            continue
        static = StaticLayer(max_cache_len=max_length)
        static.lazy_initialization(layer.keys, layer.values)
        rows = layer.keys.shape[-2]
        static.keys[:, :, :rows].copy_(layer.keys)
        static.values[:, :, :rows].copy_(layer.values)
        static.cumulative_length.fill_(rows)
        layers.append(static)
    return Cache(layers=layers)


# ----------------------------------------------------------------------------- the step


@dataclass
class StaticDecodeState:
    """Where a static decode run stands between steps; every field is a tensor of fixed shape.

    hidden [batch, 1, dim], ids [batch, 1], codes [batch, 1, num_codebooks]: the open row (fed,
    its next row not drawn yet); key_mask bool [batch, max_length]: the slots holding rows, the
    open row's included; position [batch, 1]: the open row's position (padding skipped); slot:
    0-d, where the next row goes; active [batch]: still speaking; produced [batch]: frames made;
    budgets [batch]; separators_left [batch] line boundaries each item may still draw, or None."""

    hidden: torch.Tensor
    ids: torch.Tensor
    codes: torch.Tensor
    key_mask: torch.Tensor
    position: torch.Tensor
    slot: torch.Tensor
    active: torch.Tensor
    produced: torch.Tensor
    budgets: torch.Tensor
    separators_left: torch.Tensor | None

    @classmethod
    def opened(cls, hidden, ids, codes, attention_mask, max_length, budgets, separators_left) -> StaticDecodeState:
        """The state after a prefill of rows with `attention_mask` [batch, rows] (left padding)."""
        batch, rows = attention_mask.shape
        device = attention_mask.device
        key_mask = torch.zeros(batch, max_length, dtype=torch.bool, device=device)
        key_mask[:, :rows] = attention_mask.bool()
        position = (attention_mask.long().sum(dim=-1, keepdim=True) - 1).clamp(min=0)
        return cls(
            hidden, ids, codes, key_mask, position, torch.tensor(rows, device=device),
            torch.ones(batch, dtype=torch.bool, device=device), torch.zeros(batch, dtype=torch.long, device=device),
            budgets.to(device), None if separators_left is None else separators_left.to(device).clone(),
        )


@dataclass
class StepOutput:
    """What `static_step` produced: main_ids [batch] the drawn main token; frames [batch,
    num_codebooks] (zeros where no frame was made); speaking [batch] this is one of the item's
    frames; ended [batch]; eos [batch] ended with eos; boundary [batch] drew `<|audio_separator|>`."""

    main_ids: torch.Tensor
    frames: torch.Tensor
    speaking: torch.Tensor
    ended: torch.Tensor
    eos: torch.Tensor
    boundary: torch.Tensor


def restricted_main_logits(model, hidden: torch.Tensor, separator_id: int | None, separators_left: torch.Tensor | None) -> torch.Tensor:
    """Main logits `[batch, 1, codebook_size + 1 (+ 1)]`: the semantic band and eos, then
    `<|audio_separator|>` (-inf for an item with no boundary left) when `separator_id` is given."""
    logits = model.speech_logits(hidden)
    if separator_id is None:
        return logits
    row = model.get_output_embeddings().weight[separator_id : separator_id + 1]
    separator = torch.nn.functional.linear(hidden, row).to(logits.dtype)  # [batch, 1, 1]
    separator = separator.masked_fill((separators_left <= 0)[:, None, None], float("-inf"))
    return torch.cat((logits, separator), dim=-1)


def static_step(model, cache: Drama3StaticCache, sampler, state: StaticDecodeState, noise, separator_id: int | None):
    """One decode step on fixed shapes: draw the main token of the open row, the tower's codes of
    the next frame, and feed that row through the backbone into slot `state.slot`.

    `noise`: the step's numbers (`Drama3Sampler.step_noise`; None when greedy). Returns
    (StepOutput, the next StaticDecodeState). No branch reads a tensor: an item that drew eos or a
    line boundary, or ended before, goes through the same ops as one that speaks, its codes masked.
    """
    config = model.config
    logits = restricted_main_logits(model, state.hidden, separator_id, state.separators_left)
    main_ids = sampler.main_token(logits, noise, state.active)  # [batch, 1]
    eos = main_ids[:, 0] == config.eos_token_id
    boundary = torch.zeros_like(eos) if separator_id is None else state.active & (main_ids[:, 0] == separator_id)
    speaking = state.active & ~eos & ~boundary
    semantic = (main_ids - config.semantic_start_token_id).clamp(0, config.codebook_size - 1)

    def sample(head_logits, codebook_index):
        return sampler.codebook(head_logits, codebook_index, speaking, noise)

    frames = model.sample_acoustic_codes(
        state.hidden, state.ids, state.codes, semantic, (~boundary)[:, None], state.position,
        state.key_mask[:, None, None, :], cache.tower, sample,
    )
    frames = frames.masked_fill(~speaking[:, None, None], 0)
    produced = state.produced + speaking.long()
    ended = state.active & (eos | (produced >= state.budgets))
    left = None if state.separators_left is None else state.separators_left - boundary.long()
    slots = torch.arange(cache.max_length, device=state.key_mask.device)
    key_mask = state.key_mask | (slots == state.slot)[None]
    position = state.position + 1
    hidden = model.backbone(
        inputs_embeds=model.embed_rows(main_ids, frames),
        attention_mask={"full_attention": key_mask[:, None, None, :], "linear_attention": None},
        position_ids=position,
        cache=cache.backbone,
        use_cache=True,
    ).last_hidden_state
    output = StepOutput(main_ids[:, 0], frames[:, 0], speaking, ended, eos & ended, boundary)
    following = StaticDecodeState(
        hidden, main_ids, frames, key_mask, position, state.slot + 1, state.active & ~ended, produced,
        state.budgets, left,
    )
    return output, following


# ----------------------------------------------------------------------------- compiling it

_COMPILED: dict[tuple, object] = {}


def compile_options(config: CompileConfig) -> dict:
    """`torch.compile` keyword arguments of a transformers `CompileConfig`."""
    return {
        "fullgraph": config.fullgraph,
        "dynamic": config.dynamic,
        "backend": config.backend,
        "mode": config.mode,
        "options": config.options,
    }


def default_compile_config() -> CompileConfig:
    """One graph per step (`fullgraph=True`, no dynamic shapes); CUDA graphs on a GPU."""
    return CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode="reduce-overhead")


def compiled_step(config: CompileConfig | None):
    """`static_step` compiled with `config` (None: uncompiled), built once per set of options;
    torch recompiles it for a new model, batch size or cache length class."""
    if config is None:
        return static_step
    options = compile_options(config)
    if options["mode"] is not None and options["options"] is not None:
        options.pop("mode")  # torch.compile takes one of the two
    key = tuple(sorted((name, repr(value)) for name, value in options.items()))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(static_step, **options)
    return _COMPILED[key]
