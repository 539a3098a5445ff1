"""The static decode step (`cache_implementation="static"`): preallocated caches, fixed shapes, one
graph per step. The eager loop on the dynamic cache is its reference: the same frames greedy
(bitwise: codes), the same draws seeded (same generators, same order), the same line boundaries;
`torch._dynamo` takes one step as one graph, and the compiled step equals the eager one."""

import copy

import pytest
import torch
from transformers import CompileConfig

from generation_helpers import SEPARATOR, left_pad, line_model, line_prompt, prompt, tiny_model
from transformers_drama3 import static_decoding
from transformers_drama3.generation_drama3 import SamplingSettings, _resolve_request, make_sampler, prefilled, resolve_decoding

SAMPLED = dict(temperature=1.5, top_p=1.0)  # a flat distribution: long takes, eos rarely early


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def both_ways(model, ids, codes, mask, **kwargs):
    """generate() on the dynamic and on the static cache, everything else the same."""
    kwargs.setdefault("max_new_tokens", 24)
    outputs = [
        model.generate(ids, codes, mask, return_dict_in_generate=True, cache_implementation=implementation, **kwargs)
        for implementation in ("dynamic", "static")
    ]
    return outputs


def assert_same_takes(dynamic, static):
    assert dynamic.lengths.tolist() == static.lengths.tolist()
    assert dynamic.finish_reasons == static.finish_reasons
    assert dynamic.line_boundaries == static.line_boundaries
    for item, length in enumerate(dynamic.lengths.tolist()):
        assert torch.equal(dynamic.audio_codes[item, :length], static.audio_codes[item, :length])


def test_greedy_static_decoding_makes_the_frames_of_the_dynamic_cache(model):
    """A left-padded batch of prompts of different lengths: padding, positions and masks agree."""
    ids, codes, mask = left_pad([prompt(1), prompt(2, text_rows=2, audio_rows=1), prompt(3, audio_rows=7)])
    dynamic, static = both_ways(model, ids, codes, mask, do_sample=False)
    assert min(dynamic.lengths.tolist()) > 4  # real takes, not an immediate eos
    assert_same_takes(dynamic, static)


def test_seeded_static_decoding_draws_what_the_dynamic_cache_draws(model):
    """One generator per item: the numbers drawn ahead of each step are the numbers the eager step
    draws, RAS second draw included, and items that stopped take back their codebook draws."""
    ids, codes, mask = left_pad([prompt(4), prompt(5, audio_rows=2), prompt(6)])
    dynamic, static = both_ways(model, ids, codes, mask, seed=[11, 12, 13], **SAMPLED)
    assert len(set(dynamic.lengths.tolist())) > 1  # items end at different steps
    assert_same_takes(dynamic, static)
    assert torch.equal(dynamic.ras_replacements, static.ras_replacements)


def test_static_decoding_on_the_global_generator_draws_the_same_and_leaves_it_where_eager_does(model):
    ids, codes, mask = left_pad([prompt(7), prompt(8)])
    after = []
    outputs = []
    for implementation in ("dynamic", "static"):
        torch.manual_seed(21)
        outputs.append(model.generate(ids, codes, mask, max_new_tokens=16, return_dict_in_generate=True,
                                      cache_implementation=implementation, **SAMPLED))
        after.append(torch.rand(4))
    assert_same_takes(*outputs)
    assert torch.equal(after[0], after[1])


def test_static_line_by_line_decoding_draws_the_same_boundaries_and_frames():
    """Separator steps make no frame and draw no codebook numbers: the static step draws them
    ahead and rewinds each generator that drew a boundary."""
    model = line_model(seed=0)
    ids, codes, mask = left_pad([line_prompt(1), prompt(2), line_prompt(3, lines=2)])
    dynamic, static = both_ways(
        model, ids, codes, mask, seed=[5, 6, 7], audio_separator_token_id=SEPARATOR, max_new_tokens=12, **SAMPLED
    )
    assert any(dynamic.line_boundaries)
    assert_same_takes(dynamic, static)
    greedy = both_ways(model, *left_pad([line_prompt(2)]), do_sample=False, audio_separator_token_id=SEPARATOR)
    assert greedy[0].line_boundaries == [[2, 7]]
    assert_same_takes(*greedy)


def test_a_static_stream_yields_the_frames_of_a_dynamic_stream(model):
    ids, codes = prompt(9)
    frames = {
        implementation: torch.cat([
            chunk.codes for chunk in model.stream(
                ids[None], codes[None], seed=4, max_new_tokens=16, cache_implementation=implementation, **SAMPLED
            ) if chunk.codes.numel()  # the closing chunk may hold no frame
        ], dim=1)
        for implementation in ("dynamic", "static")
    }
    assert frames["dynamic"].shape[1] > 4
    assert torch.equal(frames["dynamic"], frames["static"])


def test_the_cache_grows_to_a_power_of_two_length_class():
    assert static_decoding.static_length(3) == static_decoding.MIN_STATIC_LENGTH
    assert static_decoding.static_length(257) == 512
    assert static_decoding.static_length(4096 + 300) == 8192


def test_a_static_cache_is_compiled_only_when_asked_or_on_cuda(model):
    assert resolve_decoding(model, None, {}).static is False
    on_cpu = resolve_decoding(model, None, {"cache_implementation": "static"})
    assert on_cpu.static and on_cpu.compile_config is None  # the CPU compiles only when asked
    asked = CompileConfig(fullgraph=True, mode=None)
    assert resolve_decoding(model, None, {"cache_implementation": "static", "compile_config": asked}).compile_config is asked
    kept_eager = {"cache_implementation": "static", "compile_config": asked, "disable_compile": True}
    assert resolve_decoding(model, None, kept_eager).compile_config is None


def test_an_unknown_cache_implementation_is_refused_before_any_work(model):
    ids, codes = prompt(1)
    with pytest.raises(ValueError, match="cache_implementation='sliding_window'"):
        model.generate(ids[None], codes[None], cache_implementation="sliding_window")
    with pytest.raises(ValueError, match="compile_config="):
        model.generate(ids[None], codes[None], cache_implementation="static", compile_config={"fullgraph": True})


# ---- one step as one graph --------------------------------------------------------------------------------


def opened_step(model, settings: SamplingSettings, seed, separator: bool = False):
    """(cache, sampler, state, noise, separator id) of a static run right after its prefill."""
    ids, codes = line_prompt(1) if separator else prompt(1)
    ids, codes, mask = ids[None], codes[None], torch.ones(1, ids.shape[0], dtype=torch.long)
    separator_id = SEPARATOR if separator else None
    request = _resolve_request(model, settings, ids, mask, 20, 1.0, separator_id)
    sampler = make_sampler(model, request, ids, mask, seed)
    state = prefilled(model, ids, codes, mask)
    length = static_decoding.static_length(ids.shape[1] + 40)
    cache = static_decoding.Drama3StaticCache.from_filled(state.cache, length)
    left = None if request.separators is None else request.separators.left
    static = static_decoding.StaticDecodeState.opened(state.hidden, state.ids, state.codes, mask, length, request.budgets, left)
    noise = sampler.step_noise(1, sampler.candidate_ids.shape[0], model.config.num_codebooks, ids.device)
    return cache, sampler, static, noise, separator_id


@pytest.mark.parametrize(
    "settings, seed, separator",
    [(SamplingSettings(do_sample=False), None, False), (SamplingSettings(), 3, False), (SamplingSettings(top_k=8), 4, True)],
    ids=["greedy", "seeded-sampling", "top-k-with-separators"],
)
@torch.no_grad()
def test_one_static_step_is_one_graph_without_a_break(model, settings, seed, separator):
    step_model = line_model(seed=0) if separator else model
    inputs = opened_step(step_model, settings, seed, separator)
    explained = torch._dynamo.explain(static_decoding.static_step)(step_model, *inputs)
    assert explained.graph_break_count == 0, [reason.reason for reason in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.slow
@torch.no_grad()
def test_the_compiled_step_equals_the_eager_step(model):
    """inductor, fullgraph: one step from the same state (float32 tolerance on the next hidden state,
    the same codes), then whole seeded takes through generate()."""
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode=None)
    torch._dynamo.reset()
    compiled = static_decoding.compiled_step(compile_config)
    cache, sampler, state, noise, _ = opened_step(model, SamplingSettings(top_k=8), 5)
    twin = copy.deepcopy((cache, sampler, state))
    eager_out, eager_next = static_decoding.static_step(model, cache, sampler, state, noise, None)
    compiled_out, compiled_next = compiled(model, *twin, noise, None)
    assert torch.equal(eager_out.frames, compiled_out.frames) and torch.equal(eager_out.main_ids, compiled_out.main_ids)
    torch.testing.assert_close(compiled_next.hidden, eager_next.hidden, rtol=1e-5, atol=1e-5)
    assert torch.equal(compiled_next.key_mask, eager_next.key_mask)
    torch.testing.assert_close(twin[0].backbone.layers[-1].keys, cache.backbone.layers[-1].keys, rtol=1e-5, atol=1e-5)

    # batch 1 and the same cache length class: the graph compiled above serves it, no recompile
    ids, codes = prompt(1)
    settings = dict(seed=6, top_k=8, max_new_tokens=20, return_dict_in_generate=True, cache_implementation="static")
    eager = model.generate(ids[None], codes[None], **settings)
    through_graph = model.generate(ids[None], codes[None], compile_config=compile_config, **settings)
    assert eager.lengths.tolist()[0] > 4
    assert_same_takes(eager, through_graph)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_on_cuda_the_static_cache_compiles_with_cuda_graphs_by_default_and_makes_the_same_frames():
    """What generate(cache_implementation="static") does on a GPU: inductor + CUDA graphs."""
    model = tiny_model(seed=0).cuda()
    options = resolve_decoding(model, None, {"cache_implementation": "static"})
    assert options.static and options.compile_config.mode == "reduce-overhead" and options.compile_config.fullgraph
    ids, codes, mask = (tensor.cuda() for tensor in left_pad([prompt(1), prompt(2, audio_rows=2)]))
    dynamic, static = both_ways(model, ids, codes, mask, do_sample=False)
    assert_same_takes(dynamic, static)
    sampled = both_ways(model, ids, codes, mask, seed=[3, 4], top_k=8)
    assert_same_takes(*sampled)
