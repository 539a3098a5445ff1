"""CPU guards for the CUDA-graph capture of the decode step (issue 45, point 6).

`kernels.capture_check` compiles a function with a checking backend on the CPU; each guard is
proven to fire on a small planted function, then the decode step of a tiny random model must pass
every guard: one graph, no graph break, no tensor constant made inside the graph, no host sync, no
input written in place without a static address. On a GPU any of these keeps torch from capturing
the step (a CPU constant: "skipping cudagraphs due to cpu device (_tensor_constant0)")."""

import copy

import pytest
import torch
from transformers import CompileConfig

from generation_helpers import SEPARATOR, line_model, line_prompt, ops_serve_cpu_rows, prompt, tiny_model
from transformers_drama3.decoding import step as decode_step
from transformers_drama3.decoding.loop import DecodeRun, capturable_experts
from transformers_drama3.decoding.sampler import SamplingSettings
from transformers_drama3.decoding.request import RequestOptions, make_sampler
from transformers_drama3.decoding.request import resolve_request as _resolve_request
from transformers_drama3.kernels import fused_step
from transformers_drama3.kernels.capture_check import NotCapturable, capture_report, check_capturable

# ---- each guard fires ----------------------------------------------------------------------------


def planted_constant(x):
    dropped = x > 0
    dropped[..., 0] = False  # a Python scalar written into a tensor: traced as a CPU tensor constant
    return x.masked_fill(dropped, 0.0)


def planted_item(x):
    return torch.full((2,), x.sum().item())  # the host reads a value off the device


def planted_mask_shape(x):
    return x[x > 0]  # the output's length is data: the host must read it


def planted_break(x):
    if x.sum() > 0:  # Python control flow on a tensor: dynamo cannot keep one graph
        return x + 1
    return x - 1


def clean(x):
    ranks = torch.arange(x.shape[-1], device=x.device)
    dropped = (x > 0) & (ranks > 0)
    return x.masked_fill(dropped, 0.0)


def test_a_planted_cpu_constant_is_named_with_its_line():
    report = capture_report(planted_constant, torch.randn(3, 5))
    assert len(report.tensor_constants) == 1 and not report.graph_breaks and not report.host_syncs
    assert "_tensor_constant0" in report.tensor_constants[0].what and "cpu" in report.tensor_constants[0].what
    assert "dropped[..., 0] = False" in report.tensor_constants[0].where
    with pytest.raises(NotCapturable, match=r"tensor constant created inside the graph: _tensor_constant0"):
        check_capturable(planted_constant, torch.randn(3, 5))


@pytest.mark.parametrize("planted, op", [(planted_item, "aten._local_scalar_dense"), (planted_mask_shape, "aten.index")])
def test_a_planted_host_sync_is_named_with_its_line(planted, op):
    report = capture_report(planted, torch.randn(3, 5))
    assert report.graphs == 1 and not report.graph_breaks and not report.tensor_constants
    assert [finding.what.startswith(op) for finding in report.host_syncs] == [True]
    assert planted.__name__ in report.host_syncs[0].where
    with pytest.raises(NotCapturable, match=f"host sync: {op}"):
        check_capturable(planted, torch.randn(3, 5))


def test_a_planted_graph_break_is_named_with_its_line():
    report = capture_report(planted_break, torch.randn(3, 5))
    assert len(report.graph_breaks) >= 1 and report.graphs == 0
    assert "if x.sum() > 0" in report.graph_breaks[0].where
    with pytest.raises(NotCapturable, match="graph break"):
        check_capturable(planted_break, torch.randn(3, 5))


def test_an_input_written_in_place_must_keep_its_address():
    def count(counter, x):
        counter.add_(1)
        return x * 2

    counter = torch.zeros(())
    report = capture_report(count, counter, torch.randn(3))
    assert [finding.where.endswith("counter.add_(1)") for finding in report.mutated_inputs] == [True]
    torch._dynamo.mark_static_address(counter)  # what the decode cache does for its tensors
    assert capture_report(count, counter, torch.randn(3)).capturable


def scaled_and_counted(x, counter):
    counter.add_(1)
    return x * torch.tensor(2.0)  # a constant the trace makes on the CPU


def test_on_a_device_every_op_touching_a_cpu_tensor_is_named_with_its_line():
    """With the arguments on a device (meta stands in for CUDA), a counter left on the CPU (marked
    static or not) and a constant made there are each named, with the line that made them, by the
    dispatch mode the graph runs under; on the device itself the counter passes. A graph whose
    arguments are all on the CPU has nothing to name."""
    x, counter = torch.randn(3, 4, device="meta"), torch.zeros((), dtype=torch.long)
    torch._dynamo.mark_static_address(counter)
    report = capture_report(scaled_and_counted, x, counter)
    assert report.device == "meta" and report.graphs == 1 and report.mutated_inputs == []
    lines = {finding.where.rsplit(": ", 1)[-1] for finding in report.cpu_tensors}
    assert lines == {"counter.add_(1)", "return x * torch.tensor(2.0)  # a constant the trace makes on the CPU"}
    assert all("on CPU tensor(s) 0-d" in finding.what for finding in report.cpu_tensors)
    with pytest.raises(NotCapturable, match="CPU tensor in a graph on meta: aten.add.Tensor"):
        check_capturable(scaled_and_counted, x, counter)
    on_device = torch.zeros((), dtype=torch.long, device="meta")
    torch._dynamo.mark_static_address(on_device)
    report = capture_report(lambda x, counter: (counter.add_(1), x * 2)[1], x, on_device)
    assert report.capturable and report.device == "meta"
    on_host = capture_report(scaled_and_counted, torch.randn(3, 4), counter)
    assert on_host.device == "cpu" and on_host.cpu_tensors == []


def test_a_clean_function_passes_and_its_ops_are_counted():
    report = check_capturable(clean, torch.randn(3, 5))
    assert report.graphs == 1 and report.ops == sum(report.op_counts.values()) >= 4
    assert report.op_counts["aten.arange.start_step"] + report.op_counts["aten.arange.default"] == 1


def restarted(x, p):
    # with every size symbolic, dynamo traces `p` as a symbol, then specialises it for `torch.full`
    # and traces the frame again: the backend is called twice for one graph
    return torch.full((2,), p) + x.sum() + x.nonzero().shape[0]


def test_a_frame_dynamo_traces_again_is_reported_from_its_last_trace_alone():
    fixed = capture_report(restarted, torch.randn(5, 4), 0.9)
    symbolic = capture_report(restarted, torch.randn(5, 4), 0.9, dynamic=True)
    for report in (fixed, symbolic):
        assert report.graphs == 1 and [finding.what for finding in report.host_syncs] == ["aten.nonzero.default"]
    assert symbolic.op_counts == fixed.op_counts


@pytest.mark.parametrize("keep_crossing", [True, False])
def test_the_capped_filtered_draw_makes_no_constant(keep_crossing):
    """The constant torch found on the H200: `dropped[..., 0] = False` in the capped draw."""
    logits = torch.randn(2, 40)
    report = check_capturable(fused_step.top_k_filtered_probabilities, logits, 1.0, 8, 0.5, keep_crossing)
    assert not report.tensor_constants


# ---- the decode step passes every guard ----------------------------------------------------------

CASES = [
    pytest.param(dict(do_sample=False), None, False, id="greedy"),
    pytest.param(dict(top_p=0.9), 3, False, id="seeded-top-p-ras"),
    pytest.param(dict(top_k=8, top_p=0.9), 4, True, id="seeded-top-k-ras-separators"),
]
"""Settings (repetition-aware sampling is on by default), seed, line separators."""


def assert_capturable(report):
    assert report.graphs == 1 and report.ops > 0
    assert report.graph_breaks == [] and report.tensor_constants == [] and report.host_syncs == []
    assert report.mutated_inputs == []


@pytest.mark.parametrize("settings, seed, separator", CASES)
def test_the_decode_step_draw_feed_and_both_in_one_are_each_capturable(settings, seed, separator):
    model = line_model(seed=0) if separator else tiny_model(seed=0)
    ids, codes = line_prompt(1) if separator else prompt(1)
    ids, codes, mask = ids[None], codes[None], torch.ones(1, ids.shape[0], dtype=torch.long)
    options = RequestOptions(SamplingSettings(**settings), max_new_tokens=20, expected_seconds=1.0)
    request = _resolve_request(model, ids, mask, options, separator_id=SEPARATOR if separator else None)
    sampler = make_sampler(model, request.reseeded(seed))
    # a compile config marks the cache static and sizes it as a compiled run does; the backend is unused
    run = DecodeRun.prefilled(model, ids, codes, mask, sampler, request.budgets, request.separators,
                              compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None))
    cache, state = run.cache, run.state
    cache.open_window(cache.tower_part, 1)
    with capturable_experts(model):  # as `compiled_functions` calls the step
        assert_capturable(check_capturable(decode_step.draw, model, cache, sampler, state, run.separator_id))
        cache.open_window(cache.backbone_part, 1)
        frames = torch.ones(1, model.config.num_codebooks, dtype=torch.long)
        main_ids = torch.full((1,), model.config.semantic_start_token_id + 3)
        assert_capturable(check_capturable(decode_step.feed, model, cache, state, main_ids, frames))
        # both in one function, as `DecodeRun.steps_ahead` calls them: one graph for the whole step
        assert_capturable(check_capturable(decode_step.step, model, cache, sampler, state, run.separator_id))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32-batched-experts", "bf16-grouped-gemm"])
def test_the_decode_step_with_its_sizes_symbolic_is_capturable_through_the_decode_ops(monkeypatch, dtype):
    """The graph the default compile config makes for the second batch size has the batch (and every
    other size of the step's tensors) symbolic: it passes every guard too, with the backbone's decode
    ops (`drama3::short_conv_update`, `drama3::gated_delta_rule_decode`: their fake implementations
    take symbolic sizes) and, in bf16, transformers' grouped GEMM over a symbolic token count. Batch 3,
    seeded top-k with RAS and line separators."""
    model = line_model(seed=0).to(dtype)
    prompts = [line_prompt(seed) for seed in (1, 2, 3)]
    ids, codes = torch.stack([ids for ids, _ in prompts]), torch.stack([codes for _, codes in prompts])
    mask = torch.ones_like(ids)
    options = RequestOptions(SamplingSettings(top_k=8, top_p=0.9), max_new_tokens=20, expected_seconds=1.0)
    request = _resolve_request(model, ids, mask, options, separator_id=SEPARATOR)
    sampler = make_sampler(model, request.reseeded(4))
    run = DecodeRun.prefilled(model, ids, codes, mask, sampler, request.budgets, request.separators,
                              compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None))
    run.cache.open_window(run.cache.tower_part, 1)
    ops_serve_cpu_rows(monkeypatch)
    with capturable_experts(model):
        report = capture_report(decode_step.step, model, run.cache, sampler, run.state, run.separator_id, dynamic=True)
    assert_capturable(report)
    linear_layers = sum(kind == "linear_attention" for kind in model.config.text_config.layer_types)
    assert report.op_counts["drama3.short_conv_update.default"] == linear_layers
    assert report.op_counts["drama3.gated_delta_rule_decode.default"] == linear_layers
    assert (report.op_counts["aten._grouped_mm.default"] > 0) == (dtype == torch.bfloat16)


@torch.no_grad()
def test_float32_experts_read_their_offsets_on_the_host_unless_the_step_switches_them():
    """transformers' grouped-GEMM experts, compiled in float32, call a fallback op that reads the
    expert offsets on the host: the guard names it. `capturable_experts` (how the library calls its
    compiled step) computes them with batched matmuls instead: no host sync, the same row within
    float32 tolerance, and the model's own setting back afterwards."""
    model = tiny_model(seed=0)
    ids, codes = prompt(1)
    ids, codes, mask = ids[None], codes[None], torch.ones(1, ids.shape[0], dtype=torch.long)
    options = RequestOptions(SamplingSettings(do_sample=False), max_new_tokens=20, expected_seconds=1.0)
    request = _resolve_request(model, ids, mask, options)
    run = DecodeRun.prefilled(model, ids, codes, mask, make_sampler(model, request), request.budgets,
                              compile_config=CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None))
    run.cache.open_window(run.cache.backbone_part, 1)
    main_ids = torch.full((1,), model.config.semantic_start_token_id + 3)
    frames = torch.ones(1, model.config.num_codebooks, dtype=torch.long)
    report = capture_report(decode_step.feed, model, copy.deepcopy(run.cache), run.state, main_ids, frames)
    assert report.host_syncs and all(finding.what.startswith("transformers.grouped_mm_fallback") for finding in report.host_syncs)
    grouped = decode_step.feed(model, copy.deepcopy(run.cache), run.state, main_ids, frames).hidden
    with capturable_experts(model):
        assert {e.config._experts_implementation for e in model.modules() if hasattr(e, "down_proj") and hasattr(e, "config")} == {"batched_mm"}
        assert capture_report(decode_step.feed, model, copy.deepcopy(run.cache), run.state, main_ids, frames).host_syncs == []
        batched = decode_step.feed(model, copy.deepcopy(run.cache), run.state, main_ids, frames).hidden
    assert model.config.text_config._experts_implementation == "grouped_mm"
    torch.testing.assert_close(batched, grouped, rtol=1e-5, atol=1e-5)
    with capturable_experts(model.to(torch.bfloat16)):  # bf16 keeps its grouped GEMM
        assert model.config.text_config._experts_implementation == "grouped_mm"
