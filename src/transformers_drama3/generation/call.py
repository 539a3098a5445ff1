"""One `generate()` / `stream()` call, read once: its arguments checked (`generation.arguments`), the
prompt shaped (`prepare_prompt`, `position_ids`, `inputs_embeds`, `num_return_sequences`), what it
returns (`OutputOptions`) and its decode request (`decoding.request`).

`num_return_sequences=N` speaks each prompt N times: the batch is the prompts, each repeated N
times in a row (prompt p's takes are items p*N .. p*N + N - 1), and every item draws with its own
key, so take i of prompt p is what a run of that prompt alone gives with that item's seed
(`seed + p*N + i` for an int seed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..decoding.alignment import resolve_alignment
from ..decoding.options import GENERATE, options_for
from ..decoding.request import (
    PREFILL_GRAPHS_KEY, DecodeRequest, RequestOptions, resolve_decoding, resolve_request, resolve_separator_id,
    resolve_settings,
)
from .arguments import (
    ARGUMENTS, GENERATION_FIELDS, check_argument, check_eos, check_field, check_generation_config, check_outputs_returned,
)

OWN_ARGUMENTS = (
    "seed", "preset", "codec", "expected_seconds", "regenerate_on_anomaly", "audio_separator_token_id", "threads",
    "speak_span", "boundaries_left", "position_ids", "inputs_embeds",
)
"""generate()'s own keyword arguments (beside the prompt and GenerationConfig fields)."""
DRAMA3_FIELDS = frozenset(
    {option.name for option in options_for(GENERATE)} - GENERATION_FIELDS - set(OWN_ARGUMENTS) | {PREFILL_GRAPHS_KEY}
)
"""Generation-config options of Drama 3's own (the option schema's that transformers' GenerationConfig
does not have, such as `repetition_aware`), read by the decode request."""


# ----------------------------------------------------------------------------- the prompt


def prepare_prompt(model, input_ids, audio_codes, attention_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check and shape a prompt: input_ids [batch, rows] (or [rows]), audio_codes [batch, rows,
    num_codebooks] (zeros when None), attention_mask [batch, rows] (ones when None, left padding only)."""
    if input_ids is None:
        raise ValueError("generate() needs input_ids: the prompt rows (processor output or [batch, rows] ids)")
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
        audio_codes = None if audio_codes is None else torch.as_tensor(audio_codes)[None]
        attention_mask = None if attention_mask is None else torch.as_tensor(attention_mask)[None]
    if input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}; expected integer [batch, rows]")
    batch, rows = input_ids.shape
    if rows < 2:
        raise ValueError(f"input_ids has {rows} row(s); a prompt needs at least 2")
    _check_range(input_ids, "input_ids", model.config.text_config.vocab_size, "the text vocabulary")
    codebooks = model.config.num_codebooks
    if audio_codes is None:
        audio_codes = input_ids.new_zeros(batch, rows, codebooks)
    audio_codes = torch.as_tensor(audio_codes)
    if tuple(audio_codes.shape) != (batch, rows, codebooks):
        raise ValueError(
            f"audio_codes has shape {tuple(audio_codes.shape)}; expected [batch, rows, num_codebooks] = "
            f"{(batch, rows, codebooks)} to match input_ids"
        )
    _check_range(audio_codes, "audio_codes", model.config.codebook_size, "the codebook size")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = torch.as_tensor(attention_mask)
    if tuple(attention_mask.shape) != (batch, rows):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(batch, rows)}")
    if not bool(attention_mask[:, -1].bool().all()):
        raise ValueError("attention_mask: the last row of every prompt must be real; pad prompts on the left")
    real_rows = attention_mask.bool().sum(dim=1)
    if bool((real_rows < 2).any()):
        item = int((real_rows < 2).nonzero()[0])
        raise ValueError(f"attention_mask: prompt {item} has {int(real_rows[item])} real row(s); a prompt needs at least 2")
    device = model.device
    return input_ids.long().to(device), audio_codes.long().to(device), attention_mask.long().to(device)


def _check_range(values: torch.Tensor, name: str, size: int, what: str) -> None:
    """Ids index embedding tables: refuse what would be clamped or raise a bare IndexError."""
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {values.dtype}; expected integer ids")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= size):
        raise ValueError(
            f"{name} holds values in [{int(values.min())}, {int(values.max())}]; expected [0, {size}) ({what})"
        )


def check_position_ids(position_ids, attention_mask: torch.Tensor) -> None:
    """position_ids [batch, rows] (or [rows]) are taken where they are the positions generate()
    gives the prompt rows: each real row's count of real rows before it (left padding skipped), as
    forward's default; padding rows may hold anything. Other positions are refused: the decode
    steps continue from the prompt's last real row, counted so."""
    if position_ids is None:
        return
    position_ids = torch.as_tensor(position_ids)
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if tuple(position_ids.shape) != tuple(attention_mask.shape) or position_ids.is_floating_point():
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)} and dtype {position_ids.dtype}; expected integer "
            f"{tuple(attention_mask.shape)}, as input_ids"
        )
    real = attention_mask.bool().cpu()
    expected = (real.long().cumsum(-1) - 1).clamp(min=0)
    differs = (position_ids.cpu().long() != expected) & real
    if bool(differs.any()):
        item, row = (int(index) for index in differs.nonzero()[0])
        raise ValueError(
            f"position_ids[{item}, {row}] = {int(position_ids[item, row])}; generate() places each real prompt row at "
            f"its count of real rows before it ({int(expected[item, row])} here, left padding skipped), and the decode "
            "steps continue from there: other positions are not supported"
        )


def check_inputs_embeds(model, inputs_embeds, input_ids: torch.Tensor) -> torch.Tensor | None:
    """inputs_embeds [batch, rows, hidden] (or [rows, hidden]) for the prompt rows `input_ids`
    [batch, rows], on the model's device in the embedding table's dtype; None stays None."""
    if inputs_embeds is None:
        return None
    inputs_embeds = torch.as_tensor(inputs_embeds)
    if inputs_embeds.dim() == 2:
        inputs_embeds = inputs_embeds[None]
    expected = (*input_ids.shape, model.config.text_config.hidden_size)
    if tuple(inputs_embeds.shape) != expected or not inputs_embeds.is_floating_point():
        raise ValueError(
            f"inputs_embeds has shape {tuple(inputs_embeds.shape)} and dtype {inputs_embeds.dtype}; expected floating "
            f"[batch, rows, hidden_size] = {expected}, one vector per prompt row"
        )
    table = model.get_input_embeddings().weight
    return inputs_embeds.to(device=table.device, dtype=table.dtype)


def repeat_items(value, times: int):
    """A per-item tensor repeated `times` in a row along its first dimension (None stays None)."""
    if value is None or times == 1:
        return value
    return torch.as_tensor(value).repeat_interleave(times, dim=0)


# ----------------------------------------------------------------------------- what the call returns


@dataclass(frozen=True)
class OutputOptions:
    """What a generate() call returns: the dict (`return_dict_in_generate`) with the per-step
    outputs asked for, and how many takes of each prompt (`num_return_sequences`)."""

    return_dict: bool = False
    scores: bool = False
    logits: bool = False
    hidden_states: bool = False
    num_return_sequences: int = 1

    @property
    def per_step(self) -> bool:
        return self.scores or self.logits or self.hidden_states


_OUTPUT_FIELDS = {
    "return_dict_in_generate": "return_dict", "output_scores": "scores", "output_logits": "logits",
    "output_hidden_states": "hidden_states", "num_return_sequences": "num_return_sequences",
}


def resolve_outputs(sources: list) -> OutputOptions:
    """The output options of a call from its sources (the model's generation config, the call's,
    keyword arguments; later ones win, None never overrides)."""
    values: dict = {}
    for source in sources:
        if source is None:
            continue
        items = source if isinstance(source, dict) else source.to_dict()
        values.update({_OUTPUT_FIELDS[key]: value for key, value in items.items() if key in _OUTPUT_FIELDS and value is not None})
    for name in ("return_dict", "scores", "logits", "hidden_states"):
        if name in values and not isinstance(values[name], bool):
            field = next(key for key, value in _OUTPUT_FIELDS.items() if value == name)
            raise ValueError(f"{field}={values[name]!r}; expected True or False")
    count = values.get("num_return_sequences", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"num_return_sequences={count!r}; expected a positive number of takes per prompt")
    options = OutputOptions(**values)
    if options.per_step and not options.return_dict:
        asked = [field for field, name in _OUTPUT_FIELDS.items() if name in ("scores", "logits", "hidden_states")
                 and values.get(name)]
        raise ValueError(f"{', '.join(f'{field}=True' for field in asked)} needs return_dict_in_generate=True: only "
                         "the dict output carries per-step outputs")
    return options


def resolve_pad_id(model, sources: list) -> int:
    """The id that fills `sequences` after an item has ended: `pad_token_id` of the call, its
    generation config or the model's, else the model config's, else eos (as transformers pads)."""
    value = None
    for source in sources:
        if source is None:
            continue
        found = source.get("pad_token_id") if isinstance(source, dict) else getattr(source, "pad_token_id", None)
        if found is not None:
            value = found
    config = model.config
    for fallback in (getattr(config, "pad_token_id", None), getattr(config.text_config, "pad_token_id", None), config.eos_token_id):
        if value is None:
            value = fallback
    vocabulary = model.get_output_embeddings().weight.shape[0]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocabulary:
        raise ValueError(f"pad_token_id={value!r}; expected a token id in [0, {vocabulary})")
    return value


# ----------------------------------------------------------------------------- the arguments


def split_kwargs(kwargs: dict, caller: str = "generate()", returns_outputs: bool = False) -> dict:
    """The generation parameters among a call's keyword arguments, each checked
    (`generation.arguments`): GenerationMixin's own arguments are refused unless they ask for
    nothing (and left out of the result), fields that would not work are refused by name, and any
    other name is an error (it would be ignored). `returns_outputs`: whether the caller returns
    generate()'s output (else the output fields are refused too)."""
    unknown = sorted(name for name in kwargs if name not in ARGUMENTS and name not in GENERATION_FIELDS
                     and name not in DRAMA3_FIELDS)
    if unknown:
        raise ValueError(
            f"{caller} got unknown arguments {unknown}; it takes the prompt (input_ids, audio_codes, "
            f"attention_mask), GenerationConfig fields and {list(OWN_ARGUMENTS)}"
        )
    for name in sorted(kwargs):
        if name in ARGUMENTS:
            check_argument(name, kwargs[name])
        elif name in GENERATION_FIELDS:
            check_field(name, kwargs[name])
    if not returns_outputs:
        check_outputs_returned(kwargs, caller)
    return {name: value for name, value in kwargs.items() if name not in ARGUMENTS}


def check_sources(model, generation_config, overrides: dict, caller: str, returns_outputs: bool) -> None:
    """The generation configs a call reads (the model's, then the call's), checked as `split_kwargs`
    checks its keywords; eos_token_id in any of them must be the model's."""
    model_config = getattr(model, "generation_config", None)
    check_generation_config(model_config, "the model's generation_config.")
    check_generation_config(generation_config, "generation_config.")
    if not returns_outputs and generation_config is not None:
        check_outputs_returned(generation_config.to_dict(), caller)
    for where, source in (("the model's generation_config.", model_config), ("generation_config.", generation_config),
                          ("", overrides)):
        if source is not None:
            value = source.get("eos_token_id") if isinstance(source, dict) else getattr(source, "eos_token_id", None)
            check_eos(value, model.config.eos_token_id, where)


def check_seed_count(seed, batch: int, takes: int) -> None:
    """A list of seeds names one per returned take (every prompt's `num_return_sequences` takes)."""
    if seed is None or isinstance(seed, int):
        return
    seeds = list(seed)
    if len(seeds) != batch:
        raise ValueError(
            f"seed has {len(seeds)} values; expected an int or one per take: {batch // takes} prompt(s) x "
            f"num_return_sequences {takes} = {batch}"
        )


# ----------------------------------------------------------------------------- the call


@dataclass
class GenerationCall:
    """One generate() or stream() call, checked and resolved: the prompt (input_ids, audio_codes,
    attention_mask; each prompt repeated `outputs.num_return_sequences` times), `inputs_embeds`
    for it (or None), its request, what it returns and the id that pads `sequences`."""

    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    request: DecodeRequest
    outputs: OutputOptions
    pad_id: int
    inputs_embeds: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.prompt[0].shape[0]

    def select(self, index: torch.Tensor) -> GenerationCall:
        """The call of the items `index` (a long tensor): a regeneration's."""
        device = self.prompt[0].device
        prompt = tuple(part[index.to(device)] for part in self.prompt)
        embeds = None if self.inputs_embeds is None else self.inputs_embeds[index.to(self.inputs_embeds.device)]
        return replace(self, prompt=prompt, request=self.request.select(index), inputs_embeds=embeds)

    def reseeded(self, seed) -> GenerationCall:
        """The same call drawing with other seeds (a regeneration's attempt)."""
        return replace(self, request=self.request.reseeded(seed))


def set_up_call(
    model, input_ids, audio_codes, attention_mask, generation_config, seed, preset, expected_seconds,
    audio_separator_token_id, layout: dict, kwargs: dict, streaming: str | None, caller: str = "generate()",
    position_ids=None, inputs_embeds=None,
) -> GenerationCall:
    """Read the arguments of a call in one place: the options (checked), the prompt, and the
    request the resolver makes of them (`decoding.request.resolve_request`: sampling, seeds, frame
    budgets, line separators, alignment; `layout`: the processor's `speak_span` /
    `boundaries_left`). `streaming` names what streams ("streamer", "stream()"), or None:
    streaming needs a batch of 1 take. Only generate() (`caller`) returns outputs."""
    returns_outputs = caller == "generate()"
    overrides = split_kwargs(kwargs, caller, returns_outputs)
    check_sources(model, generation_config, overrides, caller, returns_outputs)
    model_config = getattr(model, "generation_config", None)
    outputs = resolve_outputs([model_config, generation_config, overrides]) if returns_outputs else OutputOptions()
    settings, max_new_tokens, _ = resolve_settings(model_config, preset, generation_config, overrides)
    if input_ids is None and inputs_embeds is not None:
        raise ValueError("inputs_embeds needs input_ids (and audio_codes) too: the tower, repetition-aware sampling "
                         "and the frame budget read the prompt rows")
    prompt = prepare_prompt(model, input_ids, audio_codes, attention_mask)
    check_position_ids(position_ids, prompt[2])
    inputs_embeds = check_inputs_embeds(model, inputs_embeds, prompt[0])
    prompts, times = prompt[0].shape[0], outputs.num_return_sequences
    prompt = tuple(repeat_items(part, times) for part in prompt)
    inputs_embeds = repeat_items(inputs_embeds, times)
    layout = {name: repeat_items(value, times) for name, value in layout.items()}
    if expected_seconds is not None and times > 1:
        seconds = torch.as_tensor(expected_seconds, dtype=torch.float32).flatten()
        if seconds.numel() == prompts:
            expected_seconds = seconds.repeat_interleave(times)
    if streaming is not None and prompt[0].shape[0] != 1:
        raise ValueError(f"{streaming}: streaming needs a batch of 1 prompt and 1 take; got {prompt[0].shape[0]}")
    check_seed_count(seed, prompt[0].shape[0], times)
    separator_id = resolve_separator_id(model, generation_config, audio_separator_token_id)
    options = RequestOptions(settings, seed, max_new_tokens, expected_seconds)
    request = resolve_request(
        model, prompt[0], prompt[2], options, layout, separator_id, resolve_alignment(model, [generation_config, overrides]),
        resolve_decoding(model, generation_config, overrides),
    )
    if inputs_embeds is not None and request.decoding.prefill_graphs:
        raise ValueError("inputs_embeds cannot go through the compiled prefill (prefill_graphs=True), which pads the "
                         "prompt to its length bucket")
    if outputs.hidden_states and request.decoding.compile_config is not None:
        raise ValueError("output_hidden_states=True needs the eager decode step (a compiled step keeps its hidden states "
                         "inside its graph): add disable_compile=True, or leave cache_implementation='static' out")
    pad_id = resolve_pad_id(model, [model_config, generation_config, overrides])
    return GenerationCall(prompt, request, outputs, pad_id, inputs_embeds)
