"""What `generate()` takes of `GenerationMixin.generate`'s arguments: each one works or is refused.

`GenerationConfig` has some seventy fields and `GenerationMixin.generate` a dozen more arguments; a
speech generator that accepted them and did nothing would let a user believe they ran beam search,
a repetition penalty or a stop string. Here every one is sorted, once:

- works: every field the option schema offers `generate()` (`decoding.options`: `max_new_tokens`
  in frames, `do_sample`, `temperature`, `top_k`, `top_p`, ...), and `cache_implementation`,
  `compile_config`, `disable_compile`, `return_dict_in_generate`, `output_scores`, `output_logits`,
  `output_hidden_states`, `num_return_sequences`, `pad_token_id` (pads `sequences` after an item
  ends), `eos_token_id` (the model's own);
- has no effect in transformers either when a prompt is given: `bos_token_id`,
  `decoder_start_token_id` (metadata of a saved generation config);
- accepted at the value that changes nothing (`num_beams=1`, `repetition_penalty=1.0`,
  `use_cache=True`, ...), refused at any other, with the reason, naming the option and where it was
  set (a keyword, the call's `generation_config`, or the model's own generation config);
- every other field and argument: refused by name.

transformers' fields are sorted below by what they do; a field the option schema defines works,
whatever group it sits in (an option added to the schema starts working here, its group's refusal
no longer applies). The checks run before any work. The Drama 3 options (`repetition_aware`, the
phoneme alignment, `prefill_graphs` and the keyword arguments of `generate()` itself) are read by
their owners.
"""

from __future__ import annotations

from transformers import GenerationConfig

from ..decoding.options import GENERATE, options_for

GENERATION_FIELDS = frozenset(key for key in vars(GenerationConfig()) if not key.startswith("_"))

SCHEMA_FIELDS = frozenset(option.name for option in options_for(GENERATE)) & GENERATION_FIELDS
"""transformers' fields that are options of the schema: each is read and checked as its entry says."""

WORKS = SCHEMA_FIELDS | frozenset({
    "cache_implementation", "compile_config", "disable_compile", "return_dict_in_generate", "output_scores",
    "output_logits", "output_hidden_states", "num_return_sequences", "pad_token_id", "eos_token_id",
})
"""Fields generate() honours (eos_token_id: when it is the model's own, see `check_eos`)."""

OUTPUTS = frozenset({"return_dict_in_generate", "output_scores", "output_logits", "output_hidden_states",
                     "num_return_sequences"})
"""Fields that shape generate()'s return value: refused where nothing returns them (`stream()`)."""

NO_EFFECT = frozenset({"bos_token_id", "decoder_start_token_id", "transformers_version"})
"""Fields transformers itself reads only without a prompt or for encoder-decoder models."""

_BEAMS = (
    "beam search is not available for speech: each step draws one frame (the main token, then nine codes from "
    "the tower) by sampling or argmax (do_sample); draw several takes with num_return_sequences and keep the best"
)
_ASSISTED = (
    "assisted and speculative decoding are not available for speech: a frame's nine codes come from the tower "
    "after its main token, so no draft model or prompt lookup proposes frames"
)
_CONTRASTIVE = "contrastive search and DoLa decoding are not available for speech: frames are drawn by sampling or argmax"
_PROCESSOR = (
    "this logits processor is not available: the speech sampler draws the main token from the semantic band and eos "
    "with temperature, top-k, top-p and repetition-aware sampling (repetition_aware) only"
)
_LENGTH = (
    "a take ends when the model draws eos or its frame budget is used up: bound it with max_new_tokens (frames) "
    "or expected_seconds"
)
_CACHE = (
    "generate() decodes every call on a preallocated cache of its own, cache_implementation='dynamic' (its length) "
    "or 'static' (a power-of-two length class, compiled)"
)

_GROUPS = {
    **dict.fromkeys(("num_beams", "num_beam_groups", "diversity_penalty", "length_penalty", "early_stopping",
                     "constraints", "force_words_ids"), _BEAMS),
    **dict.fromkeys(("is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule",
                     "assistant_confidence_threshold", "prompt_lookup_num_tokens", "max_matching_ngram_size",
                     "assistant_early_exit", "assistant_lookbehind", "target_lookbehind", "assistant_ensemble_weight",
                     "speculation_type", "use_mtp"), _ASSISTED),
    **dict.fromkeys(("penalty_alpha", "dola_layers", "low_memory"), _CONTRASTIVE),
    **dict.fromkeys(("min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
                     "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
                     "bad_words_ids", "sequence_bias", "suppress_tokens", "begin_suppress_tokens",
                     "forced_bos_token_id", "forced_eos_token_id", "renormalize_logits", "remove_invalid_values",
                     "exponential_decay_length_penalty", "token_healing", "guidance_scale", "watermarking_config"),
                    _PROCESSOR),
    **dict.fromkeys(("min_length", "min_new_tokens", "max_time", "stop_strings"), _LENGTH),
    "max_length": "generate() counts frames, not rows: give max_new_tokens (frames) instead",
    **dict.fromkeys(("cache_config", "max_cache_len", "prefill_chunk_size", "continuous_batching_config"), _CACHE),
    "use_cache": "generate() always decodes with its cache (use_cache=False would give the same takes, slower)",
    "output_attentions": (
        "generate() does not return attention weights (its decode step runs the attention kernels, which keep "
        "none); run forward(output_attentions=True) over the returned sequences"
    ),
}
"""transformers' fields by what they do, each with the reason it is refused where the schema does not define it."""

REFUSED = {name: reason for name, reason in _GROUPS.items() if name not in SCHEMA_FIELDS}
"""Why each field that does not work is refused."""

NEUTRAL = {
    "num_beams": (1,), "num_beam_groups": (1,), "diversity_penalty": (0.0,), "length_penalty": (1.0,),
    "early_stopping": (False,), "is_assistant": (False,), "use_mtp": (False,), "low_memory": (False,),
    "penalty_alpha": (0.0,), "typical_p": (1.0,), "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,),
    "repetition_penalty": (1.0,), "encoder_repetition_penalty": (1.0,), "no_repeat_ngram_size": (0,),
    "encoder_no_repeat_ngram_size": (0,), "renormalize_logits": (False,), "remove_invalid_values": (False,),
    "token_healing": (False,), "guidance_scale": (1.0,), "min_length": (0,), "min_new_tokens": (0,),
    "use_cache": (True,), "output_attentions": (False,),
}
"""The values at which a refused field changes nothing (transformers' own defaults): accepted."""

ARGUMENTS = {
    "assistant_model": _ASSISTED,
    "assistant_tokenizer": _ASSISTED,
    "logits_processor": _PROCESSOR,
    "prefix_allowed_tokens_fn": _PROCESSOR,
    "negative_prompt_ids": "classifier-free guidance (negative prompts) is not available: " + _PROCESSOR,
    "negative_prompt_attention_mask": "classifier-free guidance (negative prompts) is not available: " + _PROCESSOR,
    "stopping_criteria": _LENGTH,
    "tokenizer": "stop strings are not available: " + _LENGTH,
    "synced_gpus": "generate() runs on one process; several processes serve with the engine (drama3 serve)",
    "custom_generate": "generate() is Drama 3's own; a custom generation loop cannot replace it",
    "past_key_values": "generate() starts every call from its prompt: " + _CACHE,
    "cache": "generate() starts every call from its prompt: " + _CACHE,
    "use_model_defaults": "generate() always starts from the model's generation config (use_model_defaults=True)",
}
"""`GenerationMixin.generate`'s own arguments (not GenerationConfig fields), and why each is refused."""

_EMPTY_ARGUMENTS = {"logits_processor", "stopping_criteria"}
"""Arguments accepted when empty (None or an empty list: nothing to apply)."""
_FALSE_ARGUMENTS = {"synced_gpus"}
_TRUE_ARGUMENTS = {"use_model_defaults"}


def check_field(name: str, value, where: str = "") -> None:
    """Refuse a GenerationConfig field `name` set to `value` unless generate() honours it (see the
    module docstring). `where` prefixes the name in the message ("generation_config.", ...)."""
    if value is None or name in WORKS or name in NO_EFFECT:
        return
    if any(_same(value, neutral) for neutral in NEUTRAL.get(name, ())):
        return
    reason = REFUSED.get(name, "Drama 3's generate() does not take it")
    raise ValueError(f"{where}{name}={value!r}: {reason}")


def check_generation_config(config, where: str) -> None:
    """`check_field` for every field `config` (a GenerationConfig or a dict) sets; its other
    attributes (Drama 3's own: `repetition_aware`, `scene_mode`, ...) are left to their readers."""
    if config is None:
        return
    values = config if isinstance(config, dict) else config.to_dict()
    for name in sorted(GENERATION_FIELDS & values.keys()):
        check_field(name, values[name], where)


def check_argument(name: str, value) -> None:
    """Refuse one of `GenerationMixin.generate`'s own arguments (`ARGUMENTS`) unless it asks for nothing."""
    if value is None:
        return
    if name in _EMPTY_ARGUMENTS and not len(value):
        return
    if (name in _FALSE_ARGUMENTS and value is False) or (name in _TRUE_ARGUMENTS and value is True):
        return
    raise ValueError(f"{name}={_shown(value)}: {ARGUMENTS[name]}")


def check_eos(value, model_eos: int, where: str = "") -> None:
    """eos_token_id works only as the model's own: the speech head scores no other end."""
    if value is None:
        return
    ids = [value] if isinstance(value, int) else list(value)
    if ids != [model_eos]:
        raise ValueError(
            f"{where}eos_token_id={value!r}: a Drama 3 take ends on <|im_end|> (eos_token_id={model_eos}), the one "
            "end its speech head scores"
        )


def check_outputs_returned(values: dict, caller: str) -> None:
    """Refuse the output fields (`OUTPUTS`) where `caller` returns no generation output."""
    for name in sorted(OUTPUTS & values.keys()):
        value = values[name]
        if value is None or value is False or (name == "num_return_sequences" and value == 1):
            continue
        raise ValueError(f"{name}={value!r}: {caller} yields audio chunks of one take; use generate() for it")


def _same(value, neutral) -> bool:
    """`value == neutral`, where a bool never stands for a number (True is not num_beams=1)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and isinstance(value, (int, float)) and value == neutral


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"
