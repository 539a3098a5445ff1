"""generate(): greedy decode equals a cache-free reference; batches equal single prompts; stop and
click-frame handling; seeds; settings resolution."""

import pytest
import torch

from generation_helpers import (
    NUM_CODEBOOKS, SEMANTIC_START, left_pad, prompt, reference_greedy, script_main_tokens, tiny_model,
)
from transformers import GenerationConfig
from transformers_drama3.decoding.request import resolve_settings
from transformers_drama3.decoding.sampler import PAPER_EVALUATION, SERVING_DEFAULTS
from transformers_drama3.generation_drama3 import Drama3GenerationOutput


@pytest.fixture(scope="module")
def model(random_tiny_model):
    return random_tiny_model


def test_greedy_generate_equals_full_forward_reference(model):
    ids, codes = prompt(seed=1)
    expected, _ = reference_greedy(model, ids, codes, max_frames=4)
    out = model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=4, return_dict_in_generate=True)
    assert isinstance(out, Drama3GenerationOutput)
    length = int(out.lengths[0])
    assert torch.equal(out.audio_codes[0, :length], expected[:length])
    assert length == expected.shape[0] or out.clicks_dropped[0]


def test_greedy_left_padded_batch_equals_each_prompt_alone(model):
    prompts = [prompt(seed=2, text_rows=3), prompt(seed=3, text_rows=9, audio_rows=6), prompt(seed=4)]
    batch = model.generate(*left_pad(prompts), do_sample=False, max_new_tokens=5, return_dict_in_generate=True)
    for item, (ids, codes) in enumerate(prompts):
        alone = model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=5, return_dict_in_generate=True)
        assert int(batch.lengths[item]) == int(alone.lengths[0])
        assert torch.equal(batch.audio_codes[item, : int(alone.lengths[0])], alone.audio_codes[0])


def test_sampled_left_padded_batch_equals_each_prompt_alone_with_same_seed(model):
    prompts = [prompt(seed=5, text_rows=2), prompt(seed=6, text_rows=8)]
    batch = model.generate(*left_pad(prompts), seed=[11, 12], max_new_tokens=6, return_dict_in_generate=True)
    for item, (ids, codes) in enumerate(prompts):
        alone = model.generate(ids[None], codes[None], seed=11 + item, max_new_tokens=6, return_dict_in_generate=True)
        assert torch.equal(batch.audio_codes[item, : int(batch.lengths[item])], alone.audio_codes[0])


def test_int_seed_gives_item_b_the_seed_plus_b(model):
    prompts = [prompt(seed=5), prompt(seed=6)]
    batch = model.generate(*left_pad(prompts), seed=20, max_new_tokens=4)
    alone = model.generate(prompts[1][0][None], prompts[1][1][None], seed=21, max_new_tokens=4)
    assert torch.equal(batch[1, : alone.shape[1]], alone[0])


def test_seed_reproduces_a_sampled_take(model):
    ids, codes = prompt(seed=7)
    first = model.generate(ids[None], codes[None], seed=3, max_new_tokens=8, temperature=1.5, top_p=1.0)
    second = model.generate(ids[None], codes[None], seed=3, max_new_tokens=8, temperature=1.5, top_p=1.0)
    other = model.generate(ids[None], codes[None], seed=4, max_new_tokens=8, temperature=1.5, top_p=1.0)
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_without_seed_the_global_generator_decides(model):
    ids, codes = prompt(seed=7)
    torch.manual_seed(9)
    first = model.generate(ids[None], codes[None], max_new_tokens=5, temperature=1.5, top_p=1.0)
    torch.manual_seed(9)
    second = model.generate(ids[None], codes[None], max_new_tokens=5, temperature=1.5, top_p=1.0)
    assert torch.equal(first, second)


def test_each_item_stops_on_its_own_eos_and_the_eos_frame_is_dropped():
    model = tiny_model(seed=0)
    script_main_tokens(model, [[SEMANTIC_START + 5, SEMANTIC_START + 6], [SEMANTIC_START + 7] * 4])
    out = model.generate(*left_pad([prompt(1), prompt(2)]), seed=0, max_new_tokens=10, return_dict_in_generate=True)
    assert out.lengths.tolist() == [2, 4]
    assert out.finish_reasons == ["eos", "eos"]
    assert out.audio_codes.shape == (2, 4, NUM_CODEBOOKS)
    assert out.audio_codes[0, :, 0].tolist() == [5, 6, 0, 0]
    assert out.audio_codes[1, :, 0].tolist() == [7, 7, 7, 7]
    assert torch.equal(out.audio_codes[0, 2:], torch.zeros(2, NUM_CODEBOOKS, dtype=torch.long))


def test_a_semantic_zero_frame_right_before_eos_is_dropped():
    model = tiny_model(seed=0)
    script_main_tokens(model, [[SEMANTIC_START + 5, SEMANTIC_START, SEMANTIC_START + 3, SEMANTIC_START]])
    out = model.generate(*prompt(1), max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    assert out.audio_codes[0, :, 0].tolist() == [5, 0, 3]  # only the last <|semantic:0|>, before eos, goes
    assert out.clicks_dropped == [True]


def test_a_semantic_zero_frame_that_hits_the_budget_is_kept():
    model = tiny_model(seed=0)
    script_main_tokens(model, [[SEMANTIC_START + 5, SEMANTIC_START, SEMANTIC_START + 1]])
    out = model.generate(*prompt(1), max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    assert out.audio_codes[0, :, 0].tolist() == [5, 0]
    assert out.finish_reasons == ["length"]


def test_max_new_tokens_counts_frames(model):
    out = model.generate(*prompt(1), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert out.lengths.tolist()[0] <= 3
    assert int(out.budgets[0]) == 3


def test_prompt_as_processor_style_mapping(model):
    ids, codes = prompt(seed=1)
    inputs = {"input_ids": ids[None], "audio_codes": codes[None], "attention_mask": torch.ones(1, ids.shape[0])}
    direct = model.generate(ids[None], codes[None], do_sample=False, max_new_tokens=3)
    assert torch.equal(model.generate(**inputs, do_sample=False, max_new_tokens=3), direct)


def test_right_padding_is_refused(model):
    ids, codes = prompt(seed=1)
    mask = torch.ones(1, ids.shape[0], dtype=torch.long)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="pad prompts on the left"):
        model.generate(ids[None], codes[None], mask, max_new_tokens=2)


def test_unknown_argument_is_refused(model):
    with pytest.raises(ValueError, match="temprature"):
        model.generate(*prompt(1), temprature=0.3)


def test_generation_parameters_are_tolerated(model):
    out = model.generate(*prompt(1), max_new_tokens=2, pad_token_id=0, num_beams=1, return_dict_in_generate=True)
    assert out.audio_codes.shape[-1] == NUM_CODEBOOKS


def test_settings_defaults_are_the_published_serving_defaults():
    settings, max_new_tokens, return_dict = resolve_settings(GenerationConfig(), None, None, {})
    assert settings == SERVING_DEFAULTS
    assert (settings.temperature, settings.top_p, settings.top_k, settings.codebook_top_k) == (1.0, 0.9, None, 30)
    assert max_new_tokens is None and return_dict is False


def test_settings_precedence_preset_then_config_then_kwargs():
    settings, _, _ = resolve_settings(GenerationConfig(temperature=0.5), "paper-eval", None, {})
    assert settings == PAPER_EVALUATION
    settings, _, _ = resolve_settings(None, "paper-eval", GenerationConfig(top_p=0.8), {"temperature": 0.9})
    assert (settings.temperature, settings.top_p, settings.top_k) == (0.9, 0.8, 30)
    settings, _, _ = resolve_settings(GenerationConfig(temperature=0.5), None, None, {})
    assert settings.temperature == 0.5


def test_a_preset_keeps_the_frame_cap_of_the_model_generation_config():
    _, max_new_tokens, _ = resolve_settings(GenerationConfig(max_new_tokens=300, temperature=0.5), "paper-eval", None, {})
    assert max_new_tokens == 300


def test_a_codec_at_another_frame_rate_is_refused_before_any_work():
    from types import SimpleNamespace

    from generation_helpers import prompt
    from model_helpers import tiny_model

    model = tiny_model()
    input_ids, audio_codes = prompt(0)
    other = SimpleNamespace(frame_rate=model.config.frame_rate / 2)
    with pytest.raises(ValueError, match=r"codec: .* frames/s, but the model's config says"):
        model.generate(input_ids[None], audio_codes[None], codec=other, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"codec: .* frames/s"):
        next(model.stream(input_ids[None], audio_codes[None], codec=other, max_new_tokens=2))


def test_repetition_aware_sampling_can_be_turned_off_by_the_generation_config_or_a_keyword(model):
    from dataclasses import replace

    ids, codes = prompt(seed=5)
    ways_off = {
        "keyword": dict(repetition_aware=False),
        "generation_config": dict(generation_config=GenerationConfig(repetition_aware=False)),
        "preset": dict(preset=replace(SERVING_DEFAULTS, repetition_aware=False)),
    }
    for way in [None, *ways_off]:
        scripted = script_main_tokens(tiny_model(), [[SEMANTIC_START + 5] * 6])  # repeats its window: RAS redraws
        out = scripted.generate(ids[None], codes[None], seed=3, return_dict_in_generate=True, **ways_off.get(way, {}))
        assert (int(out.ras_replacements[0]) > 0) == (way is None), way
    run = dict(seed=3, max_new_tokens=24, return_dict_in_generate=True)
    hot = replace(SERVING_DEFAULTS, temperature=1.5, repetition_aware=False)
    off = model.generate(ids[None], codes[None], repetition_aware=False, temperature=1.5, **run)
    for other in (model.generate(ids[None], codes[None], temperature=1.5, **ways_off["generation_config"], **run),
                  model.generate(ids[None], codes[None], preset=hot, **run)):
        assert torch.equal(other.audio_codes, off.audio_codes)


def test_repetition_aware_is_read_from_the_model_config_and_overridden_by_later_sources():
    settings, _, _ = resolve_settings(GenerationConfig(temperature=0.5, repetition_aware=False), None, None, {})
    assert (settings.temperature, settings.repetition_aware) == (0.5, False)
    settings, _, _ = resolve_settings(GenerationConfig(repetition_aware=False), None, None, {"repetition_aware": True})
    assert settings.repetition_aware is True
    settings, _, _ = resolve_settings(GenerationConfig(repetition_aware=False), "paper-eval", None, {})
    assert settings == PAPER_EVALUATION  # a preset replaces every sampling value of the model's config
    with pytest.raises(ValueError, match="repetition_aware='no'"):
        resolve_settings(None, None, None, {"repetition_aware": "no"})
