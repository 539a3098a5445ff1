"""The one decode step (`decoding.step`: `draw` + `feed`) on the one preallocated cache the prefill
writes into (`decoding.state.DecodeCache`), run by `decoding.loop.DecodeRun`.

References: the codes the decode loop drew before the decoding package existed (golden, on the
bundled model), the growing cache a plain prefill fills (the cache's states), and the
compiled step against the eager one (float32 tolerance on states, the same codes)."""

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import CompileConfig

from generation_helpers import SEPARATOR, GrowingCache, left_pad, line_model, line_prompt, prompt, tiny_model
from transformers_drama3.decoding import step as decode_step
from transformers_drama3.decoding.loop import DecodeRun, compiled_functions
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.decoding.state import MIN_COMPILED_CAPACITY, compiled_capacity
from transformers_drama3.decoding.request import RequestOptions, make_sampler, resolve_decoding
from transformers_drama3.decoding.request import resolve_request as _resolve_request
from transformers_drama3.tiny.shipped import reference_voice

GOLDEN = Path(__file__).parent / "golden" / "drama3_tiny_takes.json"
SAMPLED = dict(temperature=1.5, top_p=1.0)  # a flat distribution: long takes, eos rarely early


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


def assert_same_takes(first, second):
    assert first.lengths.tolist() == second.lengths.tolist()
    assert first.finish_reasons == second.finish_reasons
    assert first.line_boundaries == second.line_boundaries
    for item, length in enumerate(first.lengths.tolist()):
        assert torch.equal(first.audio_codes[item, :length], second.audio_codes[item, :length])


def opened_run(model, settings: SamplingSettings, seed, separator: bool = False, compile_config=None) -> DecodeRun:
    """A run right after its prefill (batch 1, budget 20 frames)."""
    ids, codes = line_prompt(1) if separator else prompt(1)
    ids, codes, mask = ids[None], codes[None], torch.ones(1, ids.shape[0], dtype=torch.long)
    options = RequestOptions(settings, max_new_tokens=20, expected_seconds=1.0)
    request = _resolve_request(model, ids, mask, options, separator_id=SEPARATOR if separator else None)
    sampler = make_sampler(model, request.reseeded(seed))
    return DecodeRun.prefilled(model, ids, codes, mask, sampler, request.budgets, request.separators,
                               compile_config=compile_config)


# ---- outputs unchanged ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, options", [
    ("aligned", {}), ("free", dict(phoneme_alignment=False)), ("greedy", dict(phoneme_alignment=False, do_sample=False)),
])
def test_the_bundled_model_draws_the_codes_the_decode_loop_drew_before_the_one_step(bundled_tiny, name, options):
    """Seeded, phoneme-aligned, free and greedy takes of drama3-tiny: bitwise the codes of the old loop."""
    model, processor = bundled_tiny
    audio, words = reference_voice("B")
    inputs = processor("Good morning to you.", reference_audio=[audio], reference_text=[words])
    codes = model.generate(**inputs, seed=0, max_new_tokens=60, threads=1, **options)
    assert codes.tolist() == json.loads(GOLDEN.read_text())[name]


# ---- the cache the prefill writes into -----------------------------------------------------------------


@torch.no_grad()
def test_the_prefill_writes_the_states_a_growing_cache_holds(model):
    """Keys, values and Gated DeltaNet states of a left-padded prefill, written into the
    preallocated columns, equal those of the plain growing cache; columns past the prompt stay empty."""
    ids, codes, mask = left_pad([prompt(1), prompt(2, audio_rows=1)])
    options = RequestOptions(SamplingSettings(), seed=0, max_new_tokens=8, expected_seconds=1.0)
    sampler = make_sampler(model, _resolve_request(model, ids, mask, options))
    run = DecodeRun.prefilled(model, ids, codes, mask, sampler, torch.tensor([8, 8]))
    growing = GrowingCache.empty(model.config)
    hidden = model.prefill(ids, codes, mask, growing)
    rows = ids.shape[1]
    torch.testing.assert_close(run.state.hidden, hidden[:, -1:], rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(run.cache.backbone.layers, growing.backbone.layers, strict=True):
        if hasattr(theirs, "keys") and theirs.keys is not None:
            torch.testing.assert_close(ours.keys[:, :, :rows], theirs.keys, rtol=1e-6, atol=1e-6)
            assert not ours.keys[:, :, rows:].any()
        else:
            torch.testing.assert_close(ours.recurrent_states[0], theirs.recurrent_states[0], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(ours.conv_states[0], theirs.conv_states[0], rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(run.cache.tower.layers, growing.tower.layers, strict=True):
        torch.testing.assert_close(ours.values[:, :, : rows - 1], theirs.values, rtol=1e-6, atol=1e-6)
    assert run.state.key_mask[:, :rows].long().tolist() == mask.tolist() and not run.state.key_mask[:, rows:].any()
    assert run.cache.backbone_part.filled == rows and run.cache.tower_part.filled == rows - 1
    assert run.cache.backbone_part.next_column.tolist() == [rows, rows]
    assert run.cache.tower_part.next_column.tolist() == [rows - 1, rows - 1]


@torch.no_grad()
def test_a_run_feeds_a_row_only_while_an_item_speaks(model):
    """The last step draws eos (or uses the budget) and feeds nothing: the cache ends with the open row."""
    ids, codes = prompt(3)
    run = opened_run(model, SamplingSettings(do_sample=False), None)
    rows = ids.shape[0]
    steps = list(run.steps())
    assert steps[-1].ended.all()
    assert run.cache.backbone_part.filled == rows + len(steps) - 1
    assert int(run.state.key_mask.sum()) == rows + len(steps) - 1
    # the tower took every open row that was followed by a frame: all of them unless the take ended on eos
    ended_on_eos = bool(steps[-1].eos.all())
    assert run.cache.tower_part.filled == rows - 1 + len(steps) - ended_on_eos
    assert int(run.cache.tower_part.next_column) == run.cache.tower_part.filled


def test_an_unfinished_run_is_refused_a_row_past_its_capacity(model):
    run = opened_run(model, SamplingSettings(do_sample=False), None)
    run.cache.compiled = True  # a compiled run cannot grow
    with pytest.raises(ValueError, match=f"holds {run.cache.capacity} rows"):
        run.cache.open_window(run.cache.backbone_part, run.cache.capacity)


# ---- capacity: the eager run's own length, a compiled run's length class --------------------------------


def test_a_compiled_run_gets_a_power_of_two_length_class():
    assert compiled_capacity(3) == MIN_COMPILED_CAPACITY
    assert compiled_capacity(257) == 512
    assert compiled_capacity(4096 + 300) == 8192


def test_the_capacity_does_not_change_what_is_drawn(model):
    """cache_implementation="static" (eagerly on the CPU, a power-of-two capacity) draws what the
    default run draws: greedy, seeded (RAS second draws included), and with line boundaries."""
    ids, codes, mask = left_pad([prompt(4), prompt(5, audio_rows=2), prompt(6)])
    for options in (dict(do_sample=False), dict(seed=[17, 18, 19], **SAMPLED)):
        runs = [model.generate(ids, codes, mask, max_new_tokens=24, return_dict_in_generate=True,
                               cache_implementation=name, **options) for name in ("dynamic", "static")]
        assert min(runs[0].lengths.tolist()) > 4
        assert_same_takes(*runs)
    lines = line_model(seed=0)
    ids, codes, mask = left_pad([line_prompt(1), prompt(2), line_prompt(3, lines=2)])
    runs = [lines.generate(ids, codes, mask, seed=[8, 9, 10], audio_separator_token_id=SEPARATOR, max_new_tokens=12,
                           return_dict_in_generate=True, cache_implementation=name, **SAMPLED) for name in ("dynamic", "static")]
    assert any(runs[0].line_boundaries)
    assert_same_takes(*runs)


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


def test_the_bundled_model_aligns_through_a_compiled_step_as_it_aligns_eagerly(bundled_tiny):
    """drama3-tiny's phoneme alignment runs inside the compiled step (dynamo's whole graph, run by
    its eager backend): the same seeded codes as the eager step, which are the golden ones."""
    model, processor = bundled_tiny
    audio, words = reference_voice("B")
    inputs = processor("Good morning to you.", reference_audio=[audio], reference_text=[words])
    torch._dynamo.reset()
    compiled = model.generate(**inputs, seed=0, max_new_tokens=60, threads=1, cache_implementation="static",
                              compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None))
    assert compiled.tolist() == json.loads(GOLDEN.read_text())["aligned"]


# ---- each half of the step is one graph ------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, seed, separator",
    [(SamplingSettings(do_sample=False), None, False), (SamplingSettings(), 3, False), (SamplingSettings(top_k=8), 4, True)],
    ids=["greedy", "seeded-sampling", "top-k-with-separators"],
)
@torch.no_grad()
def test_draw_and_feed_are_one_graph_each_without_a_break(model, settings, seed, separator):
    step_model = line_model(seed=0) if separator else model
    run = opened_run(step_model, settings, seed, separator)
    run.cache.mark_static()
    for part in run.cache.parts:
        run.cache.open_window(part, 1)
    sampler = run.sampler
    explained = torch._dynamo.explain(decode_step.draw)(step_model, run.cache, sampler, run.state, run.separator_id)
    assert explained.graph_break_count == 0, [reason.reason for reason in explained.break_reasons]
    assert explained.graph_count == 1
    frames = torch.zeros(1, step_model.config.num_codebooks, dtype=torch.long)
    explained = torch._dynamo.explain(decode_step.feed)(step_model, run.cache, run.state, torch.tensor([1]), frames)
    assert explained.graph_break_count == 0, [reason.reason for reason in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.slow
@torch.no_grad()
def test_the_compiled_step_equals_the_eager_step(model):
    """inductor, fullgraph: one draw + feed from the same state (the compiled one reads every column
    of its capacity, the eager one the filled columns: float32 tolerance on the hidden state and the
    cache, the same codes), then whole seeded takes through generate()."""
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode=None)
    torch._dynamo.reset()
    eager = opened_run(model, SamplingSettings(top_k=8), 5)
    eager.cache = copy.deepcopy(eager.cache)  # the same prefilled state, two caches
    twin = copy.deepcopy(eager)
    compiled = DecodeRun(model, twin.sampler, twin.cache, twin.state, None, compile_config)
    eager_steps, compiled_steps = eager.steps(), compiled.steps()
    for _ in range(3):
        first, second = next(eager_steps), next(compiled_steps)
        assert torch.equal(first.frames, second.frames) and torch.equal(first.main_ids, second.main_ids)
    torch.testing.assert_close(compiled.state.hidden, eager.state.hidden, rtol=1e-5, atol=1e-5)
    assert torch.equal(compiled.state.key_mask, eager.state.key_mask)
    last = next(i for i, layer in enumerate(eager.cache.backbone.layers) if hasattr(layer, "part"))
    torch.testing.assert_close(compiled.cache.backbone.layers[last].keys, eager.cache.backbone.layers[last].keys,
                               rtol=1e-5, atol=1e-5)
    assert compiled_functions(compile_config)[0] is not decode_step.draw

    ids, codes = prompt(1)
    settings = dict(seed=7, top_k=8, max_new_tokens=20, return_dict_in_generate=True, cache_implementation="static")
    plain = model.generate(ids[None], codes[None], **settings)
    through_graph = model.generate(ids[None], codes[None], compile_config=compile_config, **settings)
    assert plain.lengths.tolist()[0] > 4
    assert_same_takes(plain, through_graph)


@pytest.mark.parametrize("dynamic, graphs", [(None, 2), (False, 4)], ids=["automatic (the default)", "fixed shapes"])
def test_batch_sizes_after_the_first_two_run_the_graph_compiled_for_the_second(model, dynamic, graphs):
    """The default compile config leaves dynamic shapes to torch (`dynamic=None`): batch 1 compiles
    a graph of its shapes, batch 2 one with the batch size symbolic, and batches 3 and 5 run that
    one (with `dynamic=False`, every batch size compiles: 4 graphs). Every batch draws the codes the
    eager step draws (dynamo's graph, run by its eager backend; seeded, top-k with RAS)."""
    from transformers_drama3.decoding.loop import default_compile_config
    from transformers_drama3.decoding.steady_guards import graphs_of

    assert default_compile_config().dynamic is None
    compile_config = CompileConfig(fullgraph=True, dynamic=dynamic, backend="eager", mode=None)
    torch._dynamo.reset()
    settings = dict(top_k=8, max_new_tokens=12, return_dict_in_generate=True, cache_implementation="static")
    for batch in (1, 2, 3, 5):
        ids, codes, mask = left_pad([prompt(seed, audio_rows=1 + seed % 3) for seed in range(batch)])
        seeds = list(range(10, 10 + batch))
        plain = model.generate(ids, codes, mask, seed=seeds, **settings)
        compiled = model.generate(ids, codes, mask, seed=seeds, compile_config=compile_config, **settings)
        assert_same_takes(plain, compiled)
    assert graphs_of(compiled_functions(compile_config).step) == graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_on_cuda_the_static_cache_compiles_with_cuda_graphs_by_default_and_makes_the_same_frames():
    """What generate(cache_implementation="static") does on a GPU: inductor + CUDA graphs."""
    model = tiny_model(seed=0).cuda()
    options = resolve_decoding(model, None, {"cache_implementation": "static"})
    assert options.static and options.compile_config.mode == "reduce-overhead" and options.compile_config.fullgraph
    ids, codes, mask = (tensor.cuda() for tensor in left_pad([prompt(1), prompt(2, audio_rows=2)]))
    for options in (dict(do_sample=False), dict(seed=[3, 4], top_k=8)):
        runs = [model.generate(ids, codes, mask, max_new_tokens=24, return_dict_in_generate=True,
                               cache_implementation=name, **options) for name in ("dynamic", "static")]
        assert_same_takes(*runs)


# ---- one step in the package ----------------------------------------------------------------------------


def test_the_package_feeds_a_decode_row_in_exactly_one_function():
    """Every call that runs the backbone (`.backbone(` or `.language_model(`) in the package, by
    function: the decode step's `feed` is the only one that runs one new row per item from a cache;
    the others are the base model's forward (which both heads' forwards, speech and reward, call),
    prefill/extend of prompt rows and GRPO's teacher-forced scoring."""
    import ast

    import transformers_drama3

    package = Path(transformers_drama3.__file__).parent
    callers = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in {"backbone", "language_model"}:
                    callers.add(f"{path.relative_to(package).as_posix()}:{function.name}")
    assert callers == {
        "decoding/step.py:feed",  # THE decode row
        "modeling_drama3.py:_cached_backbone",  # prefill / extend: prompt rows into a cache
        "modeling_drama3.py:forward",  # Drama3Model: training and scoring, every row at once
        "training/grpo.py:policy_log_probs",
    }
    model_methods = {name for name in dir(transformers_drama3.Drama3ForSpeechGeneration) if not name.startswith("__")}
    assert not {"decode_row", "tower_step"} & model_methods


def test_only_prompting_reads_the_turn_to_speak_from_token_ids():
    """Outside `prompting/` the turn to speak comes as metadata (`speak_span`, `boundaries_left`) or
    from `prompting.bare_rows`: no module compares a prompt's ids with `<|im_end|>` (eos) to find it.
    What may compare with eos: a drawn main token (the step), a separator id check, GRPO's labels."""
    import re

    import transformers_drama3

    package = Path(transformers_drama3.__file__).parent
    compared = re.compile(r"(\w+(?:\[[^\]]*\])?)\s*==\s*[\w.]*(?:eos_token_id|im_end\w*)\b")
    found = set()
    for path in package.rglob("*.py"):
        if path.relative_to(package).parts[0] == "prompting":
            continue
        for match in compared.finditer(path.read_text()):
            found.add(f"{path.relative_to(package).as_posix()}:{match.group(1)}")
    assert found == {"decoding/step.py:main_ids[:, 0]", "decoding/request.py:separator_id", "training/grpo.py:tokens"}
