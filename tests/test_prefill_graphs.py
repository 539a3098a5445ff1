"""The compiled prefill, one graph per length bucket (`generate(..., prefill_graphs=True)`): the
prompt left-padded to its bucket gives the frames and states of the plain prefill, prompts of one
bucket share a graph, and the graph is capturable (no break, constant, host sync or unmarked
in-place write)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import CompileConfig

from generation_helpers import prompt, tiny_model
from transformers_drama3.decoding.loop import (
    DecodeRun, _prefill_rows, capturable_experts, left_padded, prefill_bucket,
)
from transformers_drama3.decoding.request import RequestOptions, make_sampler, resolve_request
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.decoding.state import DecodeCache
from transformers_drama3.kernels.capture_check import check_capturable
from transformers_drama3.tiny.shipped import reference_voice

EAGER_GRAPHS = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None)
GOLDEN = Path(__file__).parent / "golden" / "drama3_tiny_takes.json"


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def test_buckets_are_powers_of_two_from_sixteen():
    assert [prefill_bucket(rows) for rows in (1, 2, 16, 17, 31, 32, 33, 300, 512, 513)] == [
        16, 16, 16, 32, 32, 32, 64, 512, 512, 1024]


def test_left_padding_keeps_the_rows_and_masks_the_padding():
    ids, codes = prompt(1)
    padded_ids, padded_codes, mask = left_padded(ids[None], codes[None], None, 20)
    missing = 20 - ids.shape[0]
    assert torch.equal(padded_ids[0, missing:], ids) and torch.equal(padded_codes[0, missing:], codes)
    assert mask[0].tolist() == [0] * missing + [1] * ids.shape[0]
    assert left_padded(ids[None], codes[None], None, ids.shape[0])[0] is not None  # already long enough: as given


def opened(model, ids, codes, prefill_graphs, compile_config=EAGER_GRAPHS, seed=3):
    ids, codes, mask = ids[None], codes[None], torch.ones(1, ids.shape[0], dtype=torch.long)
    request = resolve_request(model, ids, mask, RequestOptions(SamplingSettings(top_k=8), seed, 12, expected_seconds=1.0))
    sampler = make_sampler(model, request)
    return DecodeRun.prefilled(model, ids, codes, mask, sampler, request.budgets, compile_config=compile_config,
                               prefill_graphs=prefill_graphs)


@torch.no_grad()
def test_a_bucketed_prefill_leaves_the_states_of_the_plain_prefill(model):
    """The open row's backbone output, the Gated DeltaNet states and the real rows' keys after a
    prefill padded from 14 to 16 rows through the compiled prefill equal the plain prefill's (float32
    tolerance); the padded columns stay out of the key mask."""
    ids, codes = prompt(1, text_rows=3)  # 14 rows: 2 rows of padding
    plain, graphed = opened(model, ids, codes, False), opened(model, ids, codes, True)
    missing = prefill_bucket(ids.shape[0]) - ids.shape[0]
    assert missing > 0
    torch.testing.assert_close(graphed.state.hidden, plain.state.hidden, rtol=1e-5, atol=1e-5)
    assert torch.equal(graphed.state.position, plain.state.position)
    assert not graphed.state.key_mask[0, :missing].any() and graphed.state.key_mask[0, missing:missing + ids.shape[0]].all()
    for mine, theirs in zip(graphed.cache.backbone.layers, plain.cache.backbone.layers):
        if hasattr(mine, "keys"):
            torch.testing.assert_close(mine.keys[:, :, missing:missing + ids.shape[0]], theirs.keys[:, :, : ids.shape[0]],
                                       rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(mine.recurrent_states[0], theirs.recurrent_states[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine.conv_states[0], theirs.conv_states[0], rtol=1e-5, atol=1e-5)


def test_generate_with_prefill_graphs_draws_the_frames_of_the_plain_prefill(model):
    ids, codes = prompt(2, text_rows=4)  # 15 rows: a row of padding
    for options in (dict(do_sample=False), dict(seed=7, top_k=8)):
        common = dict(max_new_tokens=16, return_dict_in_generate=True, cache_implementation="static",
                      compile_config=EAGER_GRAPHS, **options)
        plain = model.generate(ids[None], codes[None], **common)
        graphed = model.generate(ids[None], codes[None], prefill_graphs=True, **common)
        assert int(plain.lengths[0]) > 4
        assert torch.equal(graphed.audio_codes, plain.audio_codes) and torch.equal(graphed.lengths, plain.lengths)


def test_the_bundled_model_speaks_its_golden_aligned_take_with_prefill_graphs(bundled_tiny):
    """Phoneme alignment reads the prompt's text: a left-padded prompt must not move it."""
    model, processor = bundled_tiny
    audio, words = reference_voice("B")
    inputs = processor("Good morning to you.", reference_audio=[audio], reference_text=[words])
    torch._dynamo.reset()
    codes = model.generate(**inputs, seed=0, max_new_tokens=60, threads=1, cache_implementation="static",
                           compile_config=EAGER_GRAPHS, prefill_graphs=True)
    assert codes.tolist() == json.loads(GOLDEN.read_text())["aligned"]


@pytest.mark.parametrize("dynamic", [False, None], ids=["fixed shapes", "automatic (the default config's)"])
def test_prompts_of_one_bucket_share_a_graph_and_another_bucket_gets_its_own(model, dynamic):
    """Each bucket is a graph of its own shapes, also where the compile config leaves dynamic shapes
    to torch (which would make the length symbolic at the second bucket and share that graph)."""
    symbolic = []

    def counting(gm, example_inputs):
        symbolic.append(any(isinstance(value, torch.SymInt) for value in example_inputs))
        return gm.forward

    config = CompileConfig(fullgraph=True, dynamic=dynamic, backend=counting, mode=None)
    torch._dynamo.reset()
    for text_rows in (3, 4, 6, 25):  # 14, 15, 17 and 36 rows: buckets 16, 16, 32, 64
        ids, codes = prompt(1, text_rows=text_rows)
        run = opened(model, ids, codes, True, compile_config=config)
        assert run.cache.backbone_part.filled == prefill_bucket(ids.shape[0])
    assert symbolic == [False] * 3  # the decode step compiles on its first step, which no run here takes


@torch.no_grad()
def test_the_prefill_is_capturable(model):
    """One graph, no graph break, no tensor constant, no host sync, and every tensor it writes in
    place that exists before it marked static (`mark_counters_static`)."""
    ids, codes, mask = left_padded(*(tensor[None] for tensor in prompt(1, text_rows=3)), None, 16)
    cache = DecodeCache(model, 256, ids.device, 1)
    cache.open_window(cache.backbone_part, 16)
    cache.open_window(cache.tower_part, 15)
    cache.mark_counters_static()
    with capturable_experts(model):
        report = check_capturable(_prefill_rows, model, ids, codes, mask, cache)
    assert report.graphs == 1 and report.ops > 0


@torch.no_grad()
def test_without_marking_the_counters_the_guard_names_them(model):
    from transformers_drama3.kernels.capture_check import capture_report

    ids, codes, mask = left_padded(*(tensor[None] for tensor in prompt(1, text_rows=3)), None, 16)
    cache = DecodeCache(model, 256, ids.device, 1)
    cache.open_window(cache.backbone_part, 16)
    cache.open_window(cache.tower_part, 15)
    with capturable_experts(model):
        report = capture_report(_prefill_rows, model, ids, codes, mask, cache)
    assert report.mutated_inputs and all("cumulative_length_linear" in finding.where for finding in report.mutated_inputs)


def test_own_states_moves_every_state_to_memory_of_its_own(model):
    run = opened(model, *prompt(1), False, compile_config=None)
    cache = run.cache
    before = [(tensor, tensor.clone()) for layer in (*cache.backbone.layers, *cache.tower.layers)
              for tensor in ((layer.keys, layer.values) if hasattr(layer, "keys") else (layer.conv_states[0], layer.recurrent_states[0]))]
    cache.own_states()
    after = [tensor for layer in (*cache.backbone.layers, *cache.tower.layers)
             for tensor in ((layer.keys, layer.values) if hasattr(layer, "keys") else (layer.conv_states[0], layer.recurrent_states[0]))]
    assert len(after) == len(before)
    for (old, copy), new in zip(before, after):
        assert new.data_ptr() != old.data_ptr() and torch.equal(new, copy)


@pytest.mark.parametrize("options, message", [
    (dict(prefill_graphs=True), r"prefill_graphs=True needs cache_implementation=\"static\""),
    (dict(prefill_graphs=True, cache_implementation="static"), "needs a compiled run: give a compile_config"),
    (dict(prefill_graphs=True, cache_implementation="static", compile_config=EAGER_GRAPHS, disable_compile=True),
     "disable_compile=True keeps it eager"),
    (dict(prefill_graphs="yes", cache_implementation="static", compile_config=EAGER_GRAPHS), "prefill_graphs='yes'; expected True or False"),
])
def test_prefill_graphs_outside_a_compiled_run_is_refused_before_any_work(model, options, message):
    ids, codes = prompt(1)
    with pytest.raises(ValueError, match=message):
        model.generate(ids[None], codes[None], max_new_tokens=2, **options)
