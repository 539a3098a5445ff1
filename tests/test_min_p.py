"""min-p sampling (`min_p`): after temperature, top-k and top-p, a draw drops the candidates less
likely than `min_p` times the likeliest one. Its distribution against a plain filter written here,
its draws, and the option through every door: generate(), the HTTP body, the text stream's start
message, the CLI, the demo and the serving engine (which gives a min-p request the codes generate()
gives it; the compiled step is tested with it in tests/test_serving_engine.py)."""

import pytest
import torch

from generation_helpers import prompt
from model_helpers import tiny_model
from transformers_drama3.cli import _check_say_arguments
from transformers_drama3.runtime.command_line import build_parser
from transformers_drama3.decoding.counter_noise import MAIN_STREAM, exponentials, seed_keys
from transformers_drama3.decoding.options import SamplingSettings
from transformers_drama3.decoding.request import resolve_settings
from transformers_drama3.decoding.sampler import capped_distribution, distribution, filtered_draw
from transformers_drama3.kernels.fused_step import filtered_probabilities

SETTINGS = [
    SamplingSettings(temperature=0.8, top_p=1.0, min_p=0.1),
    SamplingSettings(temperature=1.3, top_p=0.9, top_k=20, min_p=0.3),
    SamplingSettings(temperature=1.0, top_p=0.95, min_p=1.0),
]


def plain_min_p(logits: torch.Tensor, settings: SamplingSettings, top_k, keep_crossing: bool) -> torch.Tensor:
    """The reference: top-k / top-p as without min-p, then every candidate whose softmax probability
    at the temperature is below min_p times the row's largest dropped, renormalised."""
    before = filtered_probabilities(logits, settings.temperature, top_k, settings.top_p, keep_crossing)
    softmax = torch.softmax(logits.float() / settings.temperature, dim=-1)
    kept = before * (softmax >= settings.min_p * softmax.amax(dim=-1, keepdim=True))
    return kept / kept.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda settings: f"min_p={settings.min_p}")
@pytest.mark.parametrize("keep_crossing", [True, False], ids=["main token", "codebook head"])
def test_the_distribution_keeps_what_a_plain_min_p_filter_keeps(settings, keep_crossing):
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 3
    expected = plain_min_p(logits, settings, settings.top_k, keep_crossing)
    found = distribution(logits, settings, settings.top_k, keep_crossing)
    assert torch.equal(found > 0, expected > 0)
    torch.testing.assert_close(found, expected, rtol=1e-6, atol=1e-7)
    assert bool(((found > 0).sum(-1) < (filtered_probabilities(logits, settings.temperature, settings.top_k,
                                                                settings.top_p, keep_crossing) > 0).sum(-1)).any())
    capped = capped_distribution(logits, settings, 30, keep_crossing)  # the codebook heads' and RAS' sort of 30
    torch.testing.assert_close(capped, plain_min_p(logits, settings, 30, keep_crossing), rtol=1e-6, atol=1e-7)


def test_draws_come_only_from_the_kept_candidates_and_reach_each_of_them():
    logits = (torch.randn(1, 32, generator=torch.Generator().manual_seed(1)) * 2).expand(4000, -1)
    noise = exponentials(seed_keys(list(range(4000))), torch.zeros(4000, dtype=torch.long), MAIN_STREAM, 32)
    drawn = {}
    for settings in (SamplingSettings(top_p=1.0, min_p=0.2), SamplingSettings(top_p=1.0)):
        drawn[settings.min_p] = set(filtered_draw(logits, settings, None, True, noise).tolist())
        kept = set(torch.nonzero(distribution(logits[:1], settings, None, True)[0]).flatten().tolist())
        assert drawn[settings.min_p] <= kept
    assert drawn[0.2] == kept_with_min_p(logits[0], 0.2)  # each kept one is at least 1/5 as likely as the likeliest
    assert drawn[0.2] < drawn[0.0]


def kept_with_min_p(logits: torch.Tensor, min_p: float) -> set:
    softmax = torch.softmax(logits, dim=-1)
    return set(torch.nonzero(softmax >= min_p * softmax.max()).flatten().tolist())


def test_min_p_0_is_off_and_one_past_its_range_is_refused():
    assert SamplingSettings() == SamplingSettings(min_p=0.0)
    with pytest.raises(ValueError, match=r"^min_p=1.5; expected a finite number in \[0, 1\] \(0: off\)"):
        SamplingSettings(min_p=1.5)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@torch.no_grad()
def test_generate_with_min_p_1_draws_the_likeliest_candidate_as_greedy_does(model):
    """min_p 1 keeps only the likeliest candidate of each draw: with RAS off, a sampled take is the
    greedy take, whatever the seed; a min_p of 0.05 does not pin it."""
    ids, codes = prompt(3)
    common = dict(max_new_tokens=12, return_dict_in_generate=True, repetition_aware=False)
    greedy = model.generate(ids[None], codes[None], do_sample=False, **common).audio_codes
    for seed in (1, 2):
        assert torch.equal(model.generate(ids[None], codes[None], seed=seed, temperature=1.5, min_p=1.0, **common).audio_codes,
                           greedy)
    loose = model.generate(ids[None], codes[None], seed=1, temperature=1.5, min_p=0.05, **common).audio_codes
    assert not torch.equal(loose, greedy)


def test_every_door_gives_min_p_to_the_decodes_settings(tmp_path):
    """HTTP body, text stream start message, `say --min-p`, the demo's field: each door's options
    resolve (as the service, generate() and stream_text resolve them) to settings with that min_p."""
    gradio = pytest.importorskip("gradio")  # noqa: F841
    from transformers_drama3.serving.director import Director
    from transformers_drama3.serving.protocol import Limits, parse_speech, parse_stream_start

    limits = Limits()
    given = {
        "http": parse_speech({"input": "Hi.", "min_p": 0.25}, limits, lambda voice: False).options,
        "stream": parse_stream_start({"type": "start", "min_p": 0.25}, limits, lambda voice: False, 1000).options,
        "cli": _check_say_arguments(build_parser().parse_args(["say", "Hi.", "-o", str(tmp_path / "x.wav"), "--min-p", "0.25"])),
    }
    director = Director.__new__(Director)
    director.limits = limits
    given["demo"] = director.settings("model default", min_p=0.25).options
    for door, options in given.items():
        assert options == {"min_p": 0.25}, door
        assert resolve_settings(None, None, None, options)[0] == SamplingSettings(min_p=0.25), door
