"""The one resolver (`decoding.request`): prompt rows + layout + options -> a `DecodeRequest` per
item, and the one way a sampler is made of requests (`make_sampler`). A batch made of requests
resolved one by one draws, item by item, what each draws alone; the serving engine's slot is the
request `generate()` resolves for the same prompt, its layout included."""

import pytest
import torch

from generation_helpers import prompt, tiny_model
from transformers_drama3.decoding.options import SamplingSettings
from transformers_drama3.decoding.request import RequestOptions, make_sampler, resolve_request
from transformers_drama3.serving.engine import Drama3Engine, SpeechJob


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def one_request(model, prompt_seed: int, settings: SamplingSettings, seed: int):
    ids, _ = prompt(prompt_seed, text_rows=4 + prompt_seed)
    ids = ids[None]
    return resolve_request(model, ids, torch.ones_like(ids), RequestOptions(settings, seed, 30))


SETTINGS = [SamplingSettings(temperature=1.3, top_p=1.0), SamplingSettings(top_k=7), SamplingSettings(do_sample=False)]


@torch.no_grad()
def test_a_sampler_joined_from_one_item_requests_draws_what_each_draws_alone(model):
    requests = [one_request(model, index, settings, seed=10 + index) for index, settings in enumerate(SETTINGS)]
    alone = [make_sampler(model, request) for request in requests]
    batch = alone[0].joined(alone[1]).joined(alone[2]).padded(2)
    candidates = alone[0].candidate_ids.shape[0]
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):  # a few steps: counters and RAS windows move on per item
        logits = torch.randn(len(batch.row_settings), 1, candidates, generator=generator) * 3
        heads = torch.randn(len(batch.row_settings), 1, model.config.codebook_size, generator=generator) * 3
        drawn = batch.main_token(logits)
        codes = batch.codebook(heads, 1)
        batch.advance()
        for item, sampler in enumerate(alone):
            assert torch.equal(drawn[item], sampler.main_token(logits[item : item + 1])[0])
            assert torch.equal(codes[item], sampler.codebook(heads[item : item + 1], 1)[0])
            sampler.advance()
    kept = batch.select([2, 0])  # two items leave: the others keep their windows, keys and counters
    for mine, theirs in ((0, 2), (1, 0)):
        assert torch.equal(kept.window[mine], alone[theirs].window[0])
        assert torch.equal(kept.steps[mine], alone[theirs].steps[0])
        assert kept.row_settings[mine] == SETTINGS[theirs]


def test_a_request_holds_each_items_settings_seed_window_and_budget(model):
    ids = torch.stack([prompt(1)[0], prompt(2)[0]])
    request = resolve_request(model, ids, torch.ones_like(ids), RequestOptions(SETTINGS[1], 7, 5, [1.0, 2.0]))
    assert request.settings == (SETTINGS[1], SETTINGS[1]) and request.seeds == (7, 8)
    assert torch.equal(request.window[:, -3:], ids[:, -3:])
    assert request.budgets.tolist() == [5, 5] and request.guard_budgets[1] > request.guard_budgets[0]
    single = request.select(torch.tensor([1]))
    assert single.seeds == (8,) and single.budgets.tolist() == [5]


def test_options_one_past_a_limit_are_refused_before_any_work():
    with pytest.raises(ValueError, match="^max_new_tokens=0"):
        RequestOptions(max_new_tokens=0)
    with pytest.raises(ValueError, match="^seed=-1"):
        RequestOptions(seed=[3, -1])


@torch.no_grad()
def test_the_engine_reads_a_jobs_speak_span_as_generate_reads_the_processors(speech_bundle):
    """A job made of the processor's rows carries their `speak_span`: the engine's budget, expected
    duration and take are generate()'s for those rows with their layout, not the ones it would read
    from the bare rows."""
    model, processor = speech_bundle
    rows = processor("Good morning, and welcome to the river town.")
    settings = SamplingSettings(temperature=1.2, top_p=1.0)
    engine = Drama3Engine(model, max_batch=2)
    job = SpeechJob(rows["input_ids"], rows["audio_codes"], settings, seed=5, max_new_tokens=40,
                    speak_span=rows["speak_span"])
    handle = engine.submit(job)
    while not engine.idle:
        engine.step()
    done = handle.result(timeout=1)
    out = model.generate(**rows, seed=5, max_new_tokens=40, temperature=1.2, top_p=1.0, return_dict_in_generate=True)
    assert done.expected_frames == pytest.approx(float(out.expected_frames[0]))
    assert done.budget == int(out.budgets[0])
    assert torch.equal(done.codes, out.audio_codes[0, : int(out.lengths[0])])
    bare = SpeechJob(rows["input_ids"], rows["audio_codes"], settings, seed=5, max_new_tokens=40)
    bare_handle = engine.submit(bare)
    while not engine.idle:
        engine.step()
    assert bare_handle.result(timeout=1).expected_frames != done.expected_frames  # the span is what was read
