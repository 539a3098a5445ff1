"""A decode request resolved once per call: sampling, frame budgets, line separators, the phoneme
alignment and how the step runs (eager or compiled), and the sampler of a run.

`generate()`, `stream()` and the evaluation read their arguments into a `DecodeRequest` here; the
serving engine resolves each job the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import CompileConfig, GenerationConfig

from ..offload import OffloadedExperts
from ..prompting.bare_rows import boundaries_left_of_rows
from .alignment import AlignmentTracker
from .budget import expected_seconds_of_tokens, frame_budgets, overlong_factor, speak_span_tokens, target_text_tokens, text_tokens_per_second
from .loop import LineSeparators, check_cache_implementation, default_compile_config
from .sampler import Drama3Sampler, SamplingSettings, item_keys, prompt_window


@dataclass
class DecodeRequest:
    """Everything one run of the decode loop needs, resolved once per call."""

    settings: SamplingSettings
    budgets: torch.Tensor
    guard_budgets: torch.Tensor
    expected_frames: torch.Tensor
    separators: LineSeparators | None = None
    decoding: DecodeOptions = field(default_factory=lambda: DecodeOptions())
    alignment: AlignmentTracker | None = None

    def select(self, index: torch.Tensor) -> DecodeRequest:
        """The request of the items `index` (a long tensor)."""
        separators = self.separators
        if separators is not None:
            separators = LineSeparators(separators.token_id, separators.left[index.to(separators.left.device)])
        index = index.cpu()
        alignment = None if self.alignment is None else self.alignment.select(index.tolist())
        return DecodeRequest(
            self.settings, self.budgets[index], self.guard_budgets[index], self.expected_frames[index], separators,
            self.decoding, alignment,
        )


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


def make_sampler(model, request: DecodeRequest, input_ids, attention_mask, seed, sampler_class=Drama3Sampler) -> Drama3Sampler:
    """The sampler of one run (a `sampler_class`); with line separators the separator is the last
    candidate, and only the items that may draw it have a number for it."""
    device = input_ids.device
    candidates = model.speech_token_ids(device)
    codebook_size = candidates.shape[0] - 1
    widths = None
    if request.separators is not None:
        candidates = torch.cat((candidates, torch.tensor([request.separators.token_id], device=device)))
        widths = codebook_size + 1 + (request.separators.left > 0).long()
    return sampler_class(
        request.settings, candidates, prompt_window(input_ids, attention_mask),
        item_keys(seed, input_ids.shape[0], device), codebook_size, widths,
    )


def resolve_request(
    model, settings, input_ids, attention_mask, max_new_tokens, expected_seconds, separator_id=None, layout=None
) -> DecodeRequest:
    """`layout`: the processor's `speak_span` / `boundaries_left` when the rows came with them."""
    config = model.config
    layout = layout or {}
    overlong_factor(model)  # a bad value is refused before any work, not after the takes
    if expected_seconds is None and layout.get("speak_span") is not None:
        seconds = expected_seconds_of_tokens(
            speak_span_tokens(torch.as_tensor(layout["speak_span"])), text_tokens_per_second(model)
        )
    elif expected_seconds is None:
        tokens = target_text_tokens(input_ids.cpu(), attention_mask.cpu(), config.eos_token_id, model.is_semantic)
        seconds = expected_seconds_of_tokens(tokens, text_tokens_per_second(model))
    else:
        seconds = torch.as_tensor(expected_seconds, dtype=torch.float32).flatten().cpu()
        if seconds.numel() == 1:
            seconds = seconds.expand(input_ids.shape[0])
        if seconds.numel() != input_ids.shape[0] or not bool((seconds > 0).all() and seconds.isfinite().all()):
            raise ValueError(f"expected_seconds={expected_seconds!r}; expected one positive value or one per item")
    frame_rate = config.frame_rate
    return DecodeRequest(
        settings=settings,
        budgets=frame_budgets(seconds, frame_rate, max_new_tokens),
        guard_budgets=frame_budgets(seconds, frame_rate),
        expected_frames=seconds * frame_rate,
        separators=line_separators(model, input_ids, attention_mask, separator_id, layout.get("boundaries_left")),
    )


def has_offloaded_experts(model) -> bool:
    """Whether `offload_experts` moved `model`'s routed experts to CPU RAM (its step then runs eagerly)."""
    return any(isinstance(module, OffloadedExperts) for module in model.modules())
