"""The one resolver: prompt rows + their layout + a request's options -> a `DecodeRequest`.

    options = resolve_options(model, preset, generation_config, keyword_arguments)   # checked, merged
    request = resolve_request(model, input_ids, attention_mask, options, layout)     # one item per row
    sampler = make_sampler(model, request)                                           # the one constructor

A `DecodeRequest` holds what each item of a decode run needs, resolved once: its sampling settings
and seed, its RAS window, frame budgets and expected duration, the line boundaries it has left,
its phoneme alignment and how the step runs (eager or compiled). `generate()`, `stream()`,
`stream_text()`, GRPO's rollouts and the serving engine (one request per slot of its pool) all
resolve their requests here; the options are the schema's (`decoding.options`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import CompileConfig, GenerationConfig

from ..layers.offloaded_experts import OffloadedExperts
from ..prompting.bare_rows import boundaries_left_of_rows
from .alignment import AlignmentMasks, PhonemeAlignment, turn_token_ids
from .budget import (
    BUDGET_FACTOR, MAX_FRAMES, expected_seconds_of_tokens, frame_budgets, overlong_factor, speak_span_tokens, target_text_tokens,
    text_tokens_per_second,
)
from .loop import LineSeparators, check_cache_implementation, default_compile_config
from .options import OPTIONS, PRESETS, SAMPLING_NAMES, SERVING_DEFAULTS, SamplingSettings, check_options
from .sampler import Drama3Sampler, item_keys, item_seeds, prompt_window


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class RequestOptions:
    """A request's options, read from their sources and checked (`decoding.options`): what the
    resolver turns into a `DecodeRequest`.

    Args:
        settings: how its tokens are drawn (one for every item, or one per item).
        seed: item b draws with `seed + b` (an int), or each item with its own (one per item); None:
            random keys.
        max_new_tokens: the frame cap of every item (None: the budget alone).
        expected_seconds: the take's expected duration, one value or one per item (None: from the
            text of the turn to speak).
        budget_factor: a take's budget is this many times its expected duration (2.5, the paper's).
    """

    settings: SamplingSettings | Sequence[SamplingSettings] = SERVING_DEFAULTS
    seed: int | Sequence[int] | None = None
    max_new_tokens: int | None = None
    expected_seconds: float | Sequence[float] | torch.Tensor | None = None
    budget_factor: float = BUDGET_FACTOR

    def __post_init__(self):
        check_options({"max_new_tokens": self.max_new_tokens})
        seeds = [self.seed] if self.seed is None or isinstance(self.seed, int) else list(self.seed)
        for seed in seeds:
            OPTIONS["seed"].check(seed)


def drama3_generation_config(config, **overrides) -> GenerationConfig:
    """A `GenerationConfig` holding the published serving defaults for a model with `config`.

    `max_new_tokens` is the hard cap of 4096 frames; each request is further capped by its own
    budget (see `frame_budgets`)."""
    values = dict(
        do_sample=SERVING_DEFAULTS.do_sample,
        temperature=SERVING_DEFAULTS.temperature,
        top_p=SERVING_DEFAULTS.top_p,
        max_new_tokens=MAX_FRAMES,
        eos_token_id=config.eos_token_id,
    )
    values.update(overrides)
    return GenerationConfig(**values)


def resolve_settings(
    model_config: GenerationConfig | None,
    preset: str | SamplingSettings | None,
    generation_config: GenerationConfig | None,
    overrides: dict,
) -> tuple[SamplingSettings, int | None, bool]:
    """Sampling settings, max_new_tokens and return_dict_in_generate of one call.

    Later sources win: the serving defaults, the model's generation config, the preset, the
    `generation_config` argument, then keyword arguments. Unset (None) values never override.
    Every value is checked by the option schema (`check_options`).
    """
    if isinstance(preset, str) or preset is not None and not isinstance(preset, SamplingSettings):
        OPTIONS["preset"].check(preset)
        preset = PRESETS[preset]
    settings = SERVING_DEFAULTS
    values: dict = {}
    sources = [model_config, preset, generation_config, overrides]
    for source in sources:
        if source is None:
            continue
        if isinstance(source, SamplingSettings):
            settings = source  # the preset's sampling settings replace those read so far
            values = {key: value for key, value in values.items() if key not in SAMPLING_NAMES}
            continue
        items = source if isinstance(source, dict) else source.to_dict()
        values.update({key: value for key, value in items.items() if value is not None})
    changes = {key: values[key] for key in SAMPLING_NAMES if key in values}
    check_options({**changes, "max_new_tokens": values.get("max_new_tokens")})
    if "top_k" in changes and changes["top_k"] == 0:
        changes["top_k"] = None
    settings = replace(settings, **changes)
    if settings.do_sample and settings.temperature <= 0:
        settings = replace(settings, do_sample=False)
    return settings, values.get("max_new_tokens"), bool(values.get("return_dict_in_generate", False))


# ----------------------------------------------------------------------------- the request


@dataclass
class DecodeRequest:
    """What each item of a decode run needs, resolved once. Per item: `settings` (a tuple),
    `seeds` (a tuple, or None: random keys), `window` [batch, RAS_WINDOW] the prompt's last main
    tokens, `budgets` / `guard_budgets` [batch] frames (the latter without `max_new_tokens`, for
    the guards), `expected_frames` [batch], the line boundaries left (`separators`) and the phoneme
    alignment; for the run: `decoding` (eager or compiled)."""

    settings: tuple[SamplingSettings, ...]
    seeds: tuple[int, ...] | None
    window: torch.Tensor
    budgets: torch.Tensor
    guard_budgets: torch.Tensor
    expected_frames: torch.Tensor
    separators: LineSeparators | None = None
    decoding: DecodeOptions = field(default_factory=lambda: DecodeOptions())
    alignment: AlignmentMasks | None = None

    @property
    def batch(self) -> int:
        return len(self.settings)

    def select(self, index: torch.Tensor) -> DecodeRequest:
        """The request of the items `index` (a long tensor)."""
        separators = self.separators
        if separators is not None:
            separators = LineSeparators(separators.token_id, separators.left[index.to(separators.left.device)])
        items = index.cpu().tolist()
        alignment = None if self.alignment is None else self.alignment.select(items)
        return DecodeRequest(
            tuple(self.settings[item] for item in items), None if self.seeds is None else tuple(self.seeds[item] for item in items),
            self.window[index.to(self.window.device)], self.budgets[index.cpu()], self.guard_budgets[index.cpu()],
            self.expected_frames[index.cpu()], separators, self.decoding, alignment,
        )

    def reseeded(self, seed: int | Sequence[int] | None) -> DecodeRequest:
        """The same request drawing with other seeds (an int: item b draws with `seed + b`)."""
        return replace(self, seeds=_item_seeds(seed, self.batch))

    def with_separator_candidate(self, token_id: int) -> DecodeRequest:
        """The request with `<|audio_separator|>` among its candidates even where no item may draw it
        (the serving engine's pool: every item's sampler has the same candidates)."""
        if self.separators is not None:
            return self
        return replace(self, separators=LineSeparators(token_id, torch.zeros(self.batch, dtype=torch.long,
                                                                            device=self.window.device)))


@dataclass(frozen=True)
class DecodeOptions:
    """How the decode run goes: `static` (`cache_implementation="static"`) asks for a cache of a
    fixed length class, compiled with `compile_config` (None: the step runs eagerly);
    `prefill_graphs`: the prompt is left-padded to its length bucket and prefilled by a compiled
    prefill too (`DecodeRun.prefilled`)."""

    static: bool = False
    compile_config: CompileConfig | None = None
    prefill_graphs: bool = False


PREFILL_GRAPHS_KEY = "prefill_graphs"
"""The generate() / generation-config option that compiles the prefill per length bucket."""


def resolve_decoding(model, generation_config: GenerationConfig | None, overrides: dict) -> DecodeOptions:
    """The decode options of a call, read as transformers reads them: `cache_implementation`
    ("static" or "dynamic"), `compile_config` and `disable_compile`, from the model's generation
    config, then the call's, then keyword arguments. A static cache is compiled when a
    `compile_config` is given, or by default on CUDA (`default_compile_config`: one graph per step
    with CUDA graphs, torch's automatic dynamic shapes), unless `disable_compile` or the model's
    experts are offloaded."""
    values: dict = {}
    for source in (getattr(model, "generation_config", None), generation_config, overrides):
        if source is None:
            continue
        for name in ("cache_implementation", "compile_config", "disable_compile", PREFILL_GRAPHS_KEY):
            value = source.get(name) if isinstance(source, dict) else getattr(source, name, None)
            if value is not None:
                values[name] = value
    implementation = values.get("cache_implementation")
    check_cache_implementation(implementation)
    prefill_graphs = values.get(PREFILL_GRAPHS_KEY, False)
    if not isinstance(prefill_graphs, bool):
        raise ValueError(f"{PREFILL_GRAPHS_KEY}={prefill_graphs!r}; expected True or False")
    if implementation != "static":
        if prefill_graphs:
            raise ValueError(f"{PREFILL_GRAPHS_KEY}=True needs cache_implementation=\"static\" (a compiled run)")
        return DecodeOptions()
    compile_config = values.get("compile_config")
    if compile_config is not None and not isinstance(compile_config, CompileConfig):
        raise ValueError(f"compile_config={compile_config!r}; expected a transformers CompileConfig")
    if values.get("disable_compile"):
        if prefill_graphs:
            raise ValueError(f"{PREFILL_GRAPHS_KEY}=True needs a compiled run; disable_compile=True keeps it eager")
        return DecodeOptions(static=True)
    if compile_config is None and model.device.type == "cuda" and not has_offloaded_experts(model):
        compile_config = default_compile_config()  # offloaded experts copy in what a step chose: eager only
    if prefill_graphs and compile_config is None:
        raise ValueError(f"{PREFILL_GRAPHS_KEY}=True needs a compiled run: give a compile_config (the default on CUDA)")
    return DecodeOptions(static=True, compile_config=compile_config, prefill_graphs=prefill_graphs)


def resolve_separator_id(model, generation_config: GenerationConfig | None, explicit: int | None) -> int | None:
    """The id of `<|audio_separator|>`: the argument, else `audio_separator_token_id` of the call's
    generation config, of the model's generation config, or of the model's config; else None."""
    if explicit is not None:
        return int(explicit)
    for source in (generation_config, getattr(model, "generation_config", None), model.config):
        value = getattr(source, "audio_separator_token_id", None)
        if value is not None:
            return int(value)
    return None


def line_separators(
    model, input_ids, attention_mask, separator_id: int | None, boundaries_left: torch.Tensor | None = None
) -> LineSeparators | None:
    """The separator rule of a batch: None unless some prompt is a line-by-line prompt.

    `boundaries_left` [batch] is what the processor's layout says; rows given without it are read
    by `prompting.bare_rows.boundaries_left_of_rows`."""
    if separator_id is None:
        return None
    vocabulary = model.get_output_embeddings().weight.shape[0]
    config = model.config
    if not 0 <= separator_id < vocabulary or separator_id == config.eos_token_id or bool(model.is_semantic(torch.tensor(separator_id))):
        raise ValueError(
            f"audio_separator_token_id={separator_id} is not a text token of this model (vocabulary "
            f"{vocabulary}, eos {config.eos_token_id}, semantic band {config.semantic_start_token_id}.."
            f"{config.semantic_end_token_id})"
        )
    if boundaries_left is not None:
        left = torch.as_tensor(boundaries_left, dtype=torch.long).flatten().to(input_ids.device)
    else:
        left = boundaries_left_of_rows(input_ids, attention_mask, config.eos_token_id, separator_id)
    return LineSeparators(separator_id, left) if bool(left.any()) else None


def resolve_request(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, options: RequestOptions, layout: dict | None = None,
    separator_id: int | None = None, alignment: PhonemeAlignment | None = None, decoding: DecodeOptions | None = None,
) -> DecodeRequest:
    """The request of each prompt: input_ids / attention_mask [batch, rows] (left padding) with
    `options`. `layout`: the processor's `speak_span` [batch, 2] / `boundaries_left` [batch] when
    the rows came with them (the expected duration is read from `speak_span`, the line boundaries
    from `boundaries_left`; rows without them are read by `prompting.bare_rows`). `separator_id`:
    the id of `<|audio_separator|>` (None: no item speaks line by line); `alignment`: the phoneme
    alignment to follow (None: none); `decoding`: eager (default) or compiled."""
    config = model.config
    layout = dict(layout or {})
    if layout.get("speak_span") is not None:
        layout["speak_span"] = torch.as_tensor(layout["speak_span"]).reshape(-1, 2)  # (start, stop) of one prompt too
    batch = input_ids.shape[0]
    overlong_factor(model)  # a bad value is refused before any work, not after the takes
    seconds = _expected_seconds(model, input_ids, attention_mask, options.expected_seconds, layout.get("speak_span"))
    settings = options.settings
    settings = (settings,) * batch if isinstance(settings, SamplingSettings) else tuple(settings)
    if len(settings) != batch:
        raise ValueError(f"settings has {len(settings)} values for a batch of {batch}")
    frame_rate = config.frame_rate
    expected_frames = seconds * frame_rate
    aligned = None
    if alignment is not None:
        rows = turn_token_ids(input_ids.cpu(), attention_mask.cpu(), config.eos_token_id, layout.get("speak_span"))
        aligned = AlignmentMasks(alignment, rows, config.codebook_size, expected_frames.tolist(), input_ids.device)
    return DecodeRequest(
        settings=settings,
        seeds=_item_seeds(options.seed, batch),
        window=prompt_window(input_ids, attention_mask),
        budgets=frame_budgets(seconds, frame_rate, options.max_new_tokens, options.budget_factor),
        guard_budgets=frame_budgets(seconds, frame_rate, budget_factor=options.budget_factor),
        expected_frames=expected_frames,
        separators=line_separators(model, input_ids, attention_mask, separator_id, layout.get("boundaries_left")),
        decoding=decoding or DecodeOptions(),
        alignment=aligned,
    )


def _expected_seconds(model, input_ids, attention_mask, expected_seconds, speak_span) -> torch.Tensor:
    """Each prompt's expected duration [batch] (float32, host): as given, else from the text of its
    turn to speak (`speak_span`, else the rows' own reading)."""
    batch = input_ids.shape[0]
    if expected_seconds is None and speak_span is not None:
        tokens = speak_span_tokens(speak_span)
        return expected_seconds_of_tokens(tokens, text_tokens_per_second(model))
    if expected_seconds is None:
        tokens = target_text_tokens(input_ids.cpu(), attention_mask.cpu(), model.config.eos_token_id, model.is_semantic)
        return expected_seconds_of_tokens(tokens, text_tokens_per_second(model))
    seconds = torch.as_tensor(expected_seconds, dtype=torch.float32).flatten().cpu()
    if seconds.numel() == 1:
        seconds = seconds.expand(batch)
    if seconds.numel() != batch or not bool((seconds > 0).all() and seconds.isfinite().all()):
        raise ValueError(f"expected_seconds={expected_seconds!r}; expected one positive value or one per item")
    return seconds


def _item_seeds(seed, batch: int) -> tuple[int, ...] | None:
    if seed is None:
        return None
    seeds = item_seeds(seed, batch)
    if len(seeds) != batch:
        raise ValueError(f"seed has {len(seeds)} values for a batch of {batch}; expected one per item or an int")
    return tuple(int(value) for value in seeds)


def make_sampler(model, request: DecodeRequest, sampler_class=Drama3Sampler) -> Drama3Sampler:
    """The sampler of a request's items (a `sampler_class`), the one way one is made: each item with
    its settings, RAS window and key (from its seed; random keys without seeds, drawn now from
    torch's global generator). With line separators the separator is the last candidate, and only
    the items that may draw it have a number for it."""
    device = request.window.device
    candidates = model.speech_token_ids(device)
    codebook_size = candidates.shape[0] - 1
    widths = None
    if request.separators is not None:
        candidates = torch.cat((candidates, torch.tensor([request.separators.token_id], device=device)))
        widths = codebook_size + 1 + (request.separators.left.to(device) > 0).long()
    keys = item_keys(None if request.seeds is None else list(request.seeds), request.batch, device)
    return sampler_class(request.settings, candidates, request.window, keys, codebook_size, widths)


def has_offloaded_experts(model) -> bool:
    """Whether `offload_experts` moved `model`'s routed experts to CPU RAM (its step then runs eagerly)."""
    return any(isinstance(module, OffloadedExperts) for module in model.modules())
