"""Guards (paper §7, §9): frame budgets from the text, anomaly detection, regenerate-on-anomaly."""

import math

import pytest
import torch

from generation_helpers import EOS, SEMANTIC_START, left_pad, prompt, script_main_tokens, tiny_model
from transformers_drama3.decoding.budget import MAX_FRAMES, SILENCE_RMS, detect_anomalies, expected_seconds_of_text, expected_seconds_of_tokens, frame_budgets, target_text_tokens

FRAME_RATE = 44100 / 2048


def test_budget_is_two_and_a_half_times_the_expected_duration():
    assert frame_budgets(torch.tensor([10.0]), FRAME_RATE).tolist() == [math.ceil(25 * FRAME_RATE)]


def test_budget_never_exceeds_4096_frames_nor_max_new_tokens():
    assert frame_budgets(torch.tensor([1000.0]), FRAME_RATE).tolist() == [MAX_FRAMES]
    assert frame_budgets(torch.tensor([10.0]), FRAME_RATE, max_new_tokens=100).tolist() == [100]


def test_expected_duration_of_text_counts_words_and_cjk_characters():
    assert expected_seconds_of_text("one two three four five") == pytest.approx(2.0)
    assert expected_seconds_of_text("今天天气很好我们去公园散步") == pytest.approx(13 / 4.5)
    assert expected_seconds_of_text("hi") == 1.0  # never under a second


def test_expected_duration_of_a_prompt_reads_the_turn_to_speak():
    ids, _ = prompt(seed=0, text_rows=20, tail_rows=9)  # ... <|im_end|> <|im_start|> 9 tokens <|im_end|> <|im_start|>
    tokens = target_text_tokens(ids[None], torch.ones(1, ids.shape[0]), EOS, lambda t: t >= SEMANTIC_START)
    assert tokens.tolist() == [10]
    assert expected_seconds_of_tokens(tokens).tolist() == [pytest.approx(10 / 3.0)]


def test_generate_budgets_each_item_from_its_own_text():
    model = tiny_model(seed=0)
    script_main_tokens(model, [[SEMANTIC_START + 1] * 10_000] * 2)  # never says eos
    short, long = prompt(seed=0, tail_rows=1), prompt(seed=1, tail_rows=12)
    out = model.generate(*left_pad([short, long]), do_sample=False, return_dict_in_generate=True)
    expected = frame_budgets(expected_seconds_of_tokens(torch.tensor([2, 13])), model.config.frame_rate)
    assert out.budgets.tolist() == expected.tolist()
    assert out.lengths.tolist() == expected.tolist()
    assert out.finish_reasons == ["length", "length"]
    assert out.anomalies == [["runaway"], ["runaway"]]


def test_budgets_follow_the_speaking_rate_in_the_generation_config():
    model = tiny_model(seed=0)
    script_main_tokens(model, [[SEMANTIC_START + 1] * 10_000] * 2)  # never says eos
    short, long = prompt(seed=0, tail_rows=1), prompt(seed=1, tail_rows=12)
    model.generation_config.text_tokens_per_second = 6.0  # a tokenizer that spends 2x Qwen's tokens a second
    out = model.generate(*left_pad([short, long]), do_sample=False, return_dict_in_generate=True)
    expected = frame_budgets(expected_seconds_of_tokens(torch.tensor([2, 13]), 6.0), model.config.frame_rate)
    assert out.budgets.tolist() == expected.tolist()
    assert expected_seconds_of_tokens(torch.tensor([13]), 6.0).item() == pytest.approx(13 / 6.0)
    for bad in (0, -1.0, float("nan"), "fast", True):
        model.generation_config.text_tokens_per_second = bad
        with pytest.raises(ValueError, match="text_tokens_per_second"):
            model.generate(*left_pad([short]), do_sample=False, max_new_tokens=2)


def test_runaway_needs_the_guard_budget_not_a_smaller_max_new_tokens():
    assert detect_anomalies(50, "length", expected_frames=100, budget=250) == []
    assert detect_anomalies(250, "length", expected_frames=100, budget=250) == ["runaway"]


def test_too_short_take():
    assert detect_anomalies(20, "eos", expected_frames=100, budget=250) == ["too_short"]
    assert detect_anomalies(0, "eos", expected_frames=1, budget=3) == ["too_short"]
    assert detect_anomalies(30, "eos", expected_frames=100, budget=250) == []


def test_overlong_take_only_where_the_model_sets_a_factor():
    assert detect_anomalies(300, "eos", expected_frames=100, budget=250) == []  # off by default
    assert detect_anomalies(151, "eos", expected_frames=100, budget=250, overlong=1.5) == ["overlong"]
    assert detect_anomalies(150, "eos", expected_frames=100, budget=250, overlong=1.5) == []
    assert detect_anomalies(250, "length", expected_frames=100, budget=250, overlong=1.5) == ["runaway"]


def test_regenerate_on_anomaly_replaces_an_overlong_take_when_the_model_sets_a_factor():
    ids, codes = prompt(seed=3)
    expected = 2.0  # seconds: ~43 frames at the tiny config's 21.5 frames/s
    loop = [[SEMANTIC_START + 3] * 80]  # ends by itself after ~1.9x the expected duration
    plain = script_main_tokens(tiny_model(seed=0), loop).generate(
        ids[None], codes[None], expected_seconds=expected, return_dict_in_generate=True)
    assert plain.finish_reasons == ["eos"] and plain.anomalies == [[]]
    model = script_main_tokens(tiny_model(seed=0), [[SEMANTIC_START + 3] * 80 + [EOS] + [SEMANTIC_START + 4] * 30])
    model.generation_config.overlong_factor = 1.5
    out = model.generate(ids[None], codes[None], expected_seconds=expected, regenerate_on_anomaly=1,
                         return_dict_in_generate=True)
    assert out.regenerations[0]["anomalies"] == ["overlong"] and out.regenerations[0]["kept"]
    assert int(out.lengths[0]) < 1.5 * float(out.expected_frames[0]) and out.anomalies == [[]]
    for bad in (1.0, 0, float("inf"), "long", True):
        model.generation_config.overlong_factor = bad
        with pytest.raises(ValueError, match="overlong_factor"):
            model.generate(ids[None], codes[None], max_new_tokens=2)


def test_silent_and_long_silence_takes():
    rate = 1000
    noise = torch.randn(5 * rate, generator=torch.Generator().manual_seed(0)) * 0.1
    silent = torch.full((5 * rate,), SILENCE_RMS / 10)
    gap = torch.cat((noise[:rate], torch.zeros(4 * rate), noise[:rate]))
    assert detect_anomalies(100, "eos", 100, 250, silent, rate) == ["silent"]
    assert detect_anomalies(100, "eos", 100, 250, gap, rate) == ["long_silence"]
    assert detect_anomalies(100, "eos", 100, 250, noise, rate) == []


def test_regenerate_on_anomaly_replaces_a_too_short_take_and_reports_it():
    model = tiny_model(seed=0)
    # first run: eos at once (too short); the retry continues the script: 8 frames, then eos
    script_main_tokens(model, [[EOS] + [SEMANTIC_START + 3] * 8])
    out = model.generate(*prompt(1), seed=0, expected_seconds=0.5, regenerate_on_anomaly=2, return_dict_in_generate=True)
    assert out.lengths.tolist() == [8]
    assert out.anomalies == [[]]
    assert out.regenerations == [
        {"item": 0, "attempt": 1, "anomalies": ["too_short"], "new_anomalies": [], "kept": True}
    ]


def test_regeneration_is_off_by_default():
    model = tiny_model(seed=0)
    script_main_tokens(model, [[EOS] + [SEMANTIC_START + 3] * 8])
    out = model.generate(*prompt(1), seed=0, expected_seconds=0.5, return_dict_in_generate=True)
    assert out.lengths.tolist() == [0] and out.anomalies == [["too_short"]] and out.regenerations == []
