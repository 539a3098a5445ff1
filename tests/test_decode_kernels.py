"""The backbone's decode-row kernels (issue 45, point 2): the short-conv update and the recurrent
Gated DeltaNet step each equal their PyTorch reference (on the CPU through Triton's interpreter),
are routed to on CUDA decode rows only, and sit in a compiled step as one op without a graph break;
the MoE experts run transformers' grouped GEMM (`grouped_mm`), equal to its eager experts."""

import pytest
import torch
from transformers import CompileConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

from generation_helpers import ops_serve_cpu_rows, prompt, tiny_model
from transformers_drama3.decoding import step as decode_step
from transformers_drama3.decoding.loop import DecodeRun, capturable_experts
from transformers_drama3.integrations import (
    InternalsChanged,
    PreTrainedModelWithComposedExperts,
    check_experts_implementation_hook,
    kernel_report,
)
from transformers_drama3.kernels import fused_step, recurrent_decode, short_conv
from transformers_drama3.kernels.capture_check import capture_report, check_capturable

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = dict(rtol=2e-2, atol=2e-2)
CONV_OP = "drama3.short_conv_update.default"
RECURRENT_OP = "drama3.gated_delta_rule_decode.default"


@pytest.fixture(scope="module", autouse=True)
def kernels_run_here():
    """The kernels run compiled on CUDA, else in Triton's interpreter on the CPU (tests/conftest.py
    turns it on before triton is imported)."""
    if not (torch.cuda.is_available() or fused_step.interpreting()):
        pytest.fail("no CUDA and TRITON_INTERPRET is not set: the kernels cannot run (see tests/conftest.py)")
    assert short_conv.triton_available() and recurrent_decode.triton_available()


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


# ----------------------------------------------------------------------------- short-conv update


def conv_inputs(seed, batch, channels, width, state_len, bias, dtype=torch.float32):
    """hidden_states [batch, channels, 1] as the model passes it (a transposed view of
    [batch, 1, channels]), a conv state that is not zero, weights, bias."""
    g = generator(seed)
    hidden = torch.randn(batch, 1, channels, generator=g).to(dtype).transpose(1, 2)
    state = torch.randn(batch, channels, state_len, generator=g).to(dtype)
    weight = torch.randn(channels, width, generator=g).to(dtype)
    bias = torch.randn(channels, generator=g).to(dtype) if bias else None
    return hidden, state, weight, bias


CONV_CASES = [
    pytest.param(1, 40, 4, 4, False, "silu", id="batch1"),
    pytest.param(3, 300, 4, 4, True, "silu", id="batch3-bias-several-blocks"),
    pytest.param(2, 64, 4, 3, False, None, id="state-of-width-minus-one-no-activation"),
    pytest.param(2, 50, 3, 6, True, "swish", id="longer-state"),
]


@pytest.mark.parametrize("batch, channels, width, state_len, bias, activation", CONV_CASES)
def test_the_short_conv_kernel_equals_its_reference(batch, channels, width, state_len, bias, activation):
    hidden, state, weight, bias = conv_inputs(0, batch, channels, width, state_len, bias)
    reference_state = state.clone()
    expected = short_conv.short_conv_update_reference(hidden, reference_state, weight, bias, activation)
    hidden, kernel_state, weight, bias = on_device(hidden, state.clone(), weight, bias)
    out = short_conv.short_conv_update(hidden, kernel_state, weight, bias, activation)
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(kernel_state.cpu(), reference_state, rtol=0, atol=0)  # moved values, no arithmetic


def test_the_short_conv_kernel_equals_its_reference_in_bfloat16():
    hidden, state, weight, bias = conv_inputs(1, 2, 96, 4, 4, True, torch.bfloat16)
    reference_state = state.clone()
    expected = short_conv.short_conv_update_reference(hidden, reference_state, weight, bias, "silu")
    hidden, kernel_state, weight, bias = on_device(hidden, state.clone(), weight, bias)
    out = short_conv.short_conv_update(hidden, kernel_state, weight, bias, "silu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), expected, **BF16)
    torch.testing.assert_close(kernel_state.cpu(), reference_state, rtol=0, atol=0)


def test_the_short_conv_reference_is_transformers_causal_conv1d_update():
    hidden, state, weight, _ = conv_inputs(2, 2, 24, 4, 4, False)
    theirs_state, ours_state = state.clone(), state.clone()
    theirs = qwen.causal_conv1d_update.drama3_reference(hidden, theirs_state, weight, None, activation="silu")
    ours = short_conv.short_conv_update_reference(hidden, ours_state, weight, None, "silu")
    torch.testing.assert_close(ours, theirs, rtol=1.3e-6, atol=1e-5)  # two paths: float32 tolerance
    assert torch.equal(ours_state, theirs_state)  # the state is rolled and copied, not computed


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda h, s, w: (h.expand(-1, -1, 2), s, w), "hidden_states"),
        (lambda h, s, w: (h, s[..., :2], w), "conv_state"),
        (lambda h, s, w: (h, s, w[:-1]), "weight"),
    ],
)
def test_short_conv_inputs_that_do_not_fit_are_refused_by_name(change, named):
    hidden, state, weight = change(*conv_inputs(3, 2, 24, 4, 4, False)[:3])
    with pytest.raises(ValueError, match=f"^{named}: expected"):
        short_conv.short_conv_update(hidden, state, weight, None, "silu")


def test_an_activation_the_kernel_does_not_apply_is_refused_by_name():
    hidden, state, weight, _ = conv_inputs(3, 2, 24, 4, 4, False)
    with pytest.raises(ValueError, match="^activation: expected"):
        short_conv.short_conv_update(hidden, state, weight, None, "gelu")


# ----------------------------------------------------------------------------- recurrent delta rule


def delta_rule_inputs(seed, batch, heads, v_heads, k_dim, v_dim, state, dtype=torch.float32):
    """query/key [batch, 1, heads, k_dim] as views of one wider row (as the model splits its conv
    output), value, g (log decay), beta, and a recurrent state that is not zero (or None)."""
    g = generator(seed)
    row = torch.randn(batch, 1, 2 * heads * k_dim + v_heads * v_dim, generator=g).to(dtype)
    query, key, value = torch.split(row, [heads * k_dim, heads * k_dim, v_heads * v_dim], dim=-1)
    query, key = (t.reshape(batch, 1, heads, k_dim) for t in (query, key))
    value = value.reshape(batch, 1, v_heads, v_dim)
    decay = -torch.rand(batch, 1, v_heads, generator=g)  # float32, as the layer computes it
    beta = torch.rand(batch, 1, v_heads, generator=g).to(dtype)
    initial = torch.randn(batch, v_heads, k_dim, v_dim, generator=g) if state else None
    return query, key, value, decay, beta, initial


DELTA_CASES = [
    pytest.param(1, 1, 1, 16, 16, True, True, id="batch1-one-head"),
    pytest.param(3, 2, 4, 16, 24, True, True, id="batch3-grouped-values"),
    pytest.param(2, 2, 2, 32, 72, False, True, id="no-l2norm-several-value-blocks"),
    pytest.param(2, 1, 3, 8, 40, True, False, id="no-initial-state"),
]


@pytest.mark.parametrize("batch, heads, v_heads, k_dim, v_dim, l2norm, state", DELTA_CASES)
def test_the_recurrent_kernel_equals_its_reference(batch, heads, v_heads, k_dim, v_dim, l2norm, state):
    inputs = delta_rule_inputs(0, batch, heads, v_heads, k_dim, v_dim, state)
    expected, expected_state = recurrent_decode.gated_delta_rule_decode_reference(*inputs, l2norm)
    out, new_state = recurrent_decode.gated_delta_rule_decode(*on_device(*inputs), l2norm)
    assert out.dtype == inputs[0].dtype and new_state.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), expected)
    torch.testing.assert_close(new_state.cpu(), expected_state)


def test_the_recurrent_kernel_leaves_the_initial_state_as_it_was():
    inputs = delta_rule_inputs(1, 2, 2, 4, 16, 16, True)
    initial = inputs[-1].clone()
    recurrent_decode.gated_delta_rule_decode(*inputs, True)
    assert torch.equal(inputs[-1], initial)


def test_the_recurrent_kernel_equals_its_reference_in_bfloat16():
    inputs = delta_rule_inputs(2, 2, 2, 4, 32, 32, True, torch.bfloat16)
    expected, expected_state = recurrent_decode.gated_delta_rule_decode_reference(*inputs, True)
    out, new_state = recurrent_decode.gated_delta_rule_decode(*on_device(*inputs), True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), expected, **BF16)
    torch.testing.assert_close(new_state.cpu(), expected_state, **BF16)


@pytest.mark.parametrize("l2norm", [True, False])
def test_the_recurrent_reference_is_transformers_recurrent_rule_on_one_row(l2norm):
    query, key, value, decay, beta, initial = delta_rule_inputs(3, 2, 2, 4, 16, 8, True)
    theirs, theirs_state = qwen.torch_recurrent_gated_delta_rule.drama3_reference(
        query, key, value, g=decay, beta=beta, initial_state=initial, output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm,
    )
    ours, ours_state = recurrent_decode.gated_delta_rule_decode_reference(query, key, value, decay, beta, initial, l2norm)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_state, theirs_state, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "position, named",
    [(0, "query"), (1, "key"), (2, "value"), (3, "g"), (4, "beta"), (5, "initial_state")],
)
def test_delta_rule_inputs_that_do_not_fit_are_refused_by_name(position, named):
    inputs = list(delta_rule_inputs(4, 2, 2, 4, 8, 8, True))
    inputs[position] = torch.cat([inputs[position]] * 2, dim=1 if position < 5 else 3)
    with pytest.raises(ValueError, match=f"^{named}: expected"):
        recurrent_decode.gated_delta_rule_decode(*inputs, True)


# ----------------------------------------------------------------------------- routing


def test_routed_cpu_rows_take_transformers_path_and_never_the_ops(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a CPU row reached a decode op")

    monkeypatch.setattr(short_conv, "short_conv_update", refuse)
    monkeypatch.setattr(recurrent_decode, "gated_delta_rule_decode", refuse)
    hidden, state, weight, _ = conv_inputs(5, 2, 24, 4, 4, False)
    routed_state, reference_state = state.clone(), state.clone()
    out = qwen.causal_conv1d_update(hidden, routed_state, weight, None, activation="silu")
    expected = qwen.causal_conv1d_update.drama3_reference(hidden, reference_state, weight, None, activation="silu")
    assert torch.equal(out, expected) and torch.equal(routed_state, reference_state)

    query, key, value, decay, beta, initial = delta_rule_inputs(5, 2, 2, 4, 8, 8, True)
    kwargs = dict(g=decay, beta=beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, new_state = qwen.torch_recurrent_gated_delta_rule(query, key, value, cu_seqlens=None, **kwargs)
    expected, expected_state = qwen.torch_recurrent_gated_delta_rule.drama3_reference(query, key, value, **kwargs)
    assert torch.equal(out, expected) and torch.equal(new_state, expected_state)


def test_the_ops_serve_only_cuda_rows_without_gradients():
    hidden, state, weight, _ = conv_inputs(6, 1, 8, 4, 4, False)
    query = delta_rule_inputs(6, 1, 1, 1, 8, 8, True)[0]
    assert not short_conv.kernel_serves(hidden, "silu")
    assert not recurrent_decode.kernel_serves(query)
    if torch.cuda.is_available():
        hidden, query = hidden.cuda(), query.cuda()
        assert short_conv.kernel_serves(hidden, "silu") and recurrent_decode.kernel_serves(query)
        assert not short_conv.kernel_serves(hidden.expand(-1, -1, 2), "silu")
        assert not short_conv.kernel_serves(hidden, "gelu")
        assert not recurrent_decode.kernel_serves(torch.cat([query] * 2, dim=1))
        assert not recurrent_decode.kernel_serves(query, cu_seqlens=torch.tensor([0, 1], device="cuda"))
        assert not recurrent_decode.kernel_serves(query.clone().requires_grad_())


def test_the_kernel_report_names_the_decode_ops():
    report = kernel_report()
    assert report["causal_conv1d_update"].startswith("torch.ops.drama3.short_conv_update on a decode row, else ")
    assert report["torch_recurrent_gated_delta_rule"].startswith(
        "torch.ops.drama3.gated_delta_rule_decode on a decode row, else "
    )


# ----------------------------------------------------------------------------- one op in a compiled graph


def conv_row(hidden, state, weight):
    return short_conv.short_conv_update(hidden * 2, state, weight, None, "silu") + 1


def recurrent_row(query, key, value, decay, beta, state):
    out, new_state = recurrent_decode.gated_delta_rule_decode(query, key, value, decay, beta, state, True)
    state.copy_(new_state)  # what the cache does with the new state
    return out * 2


def test_the_short_conv_op_compiles_as_one_graph_and_declares_its_state_write():
    hidden, state, weight, _ = conv_inputs(7, 2, 40, 4, 4, False)
    expected_state = state.clone()
    expected = short_conv.short_conv_update_reference(hidden * 2, expected_state, weight, None, "silu") + 1
    static = state.clone()
    torch._dynamo.mark_static_address(static)
    report = check_capturable(conv_row, hidden, static, weight)
    assert report.graphs == 1 and not report.graph_breaks and not report.host_syncs and not report.tensor_constants
    torch.testing.assert_close(static, expected_state, rtol=0, atol=0)  # the compiled call updated the state
    compiled = torch.compile(conv_row, fullgraph=True, backend="aot_eager")
    again = state.clone()
    torch.testing.assert_close(compiled(hidden, again, weight), expected)
    # the op's write to the state is declared: the guard sees a mutated input (here not static)
    unmarked = capture_report(conv_row, hidden, state.clone(), weight)
    assert ["in short_conv_update" in finding.where for finding in unmarked.mutated_inputs] == [True]


def test_the_recurrent_op_compiles_as_one_graph_with_one_op():
    inputs = list(delta_rule_inputs(8, 2, 2, 4, 16, 16, True))
    torch._dynamo.mark_static_address(inputs[-1])
    report = check_capturable(recurrent_row, *inputs)
    assert report.op_counts[RECURRENT_OP] == 1


def test_the_ops_compile_whole_under_make_fx_with_their_fake_implementations():
    from torch.fx.experimental.proxy_tensor import make_fx

    hidden, state, weight, _ = conv_inputs(9, 2, 24, 4, 4, False)
    inputs = delta_rule_inputs(9, 2, 2, 4, 8, 8, True)
    conv_graph = make_fx(conv_row, tracing_mode="fake")(hidden, state, weight)
    recurrent_graph = make_fx(recurrent_row, tracing_mode="fake")(*inputs)
    targets = {str(node.target) for graph in (conv_graph, recurrent_graph) for node in graph.graph.nodes}
    assert {CONV_OP, RECURRENT_OP} <= targets


# ----------------------------------------------------------------------------- the decode row of the model


def prefilled_run(model, compiled: bool):
    """A tiny model's prompt prefilled into a decode cache on the model's device (its states not
    zero), ready for one feed."""
    device = model.device
    ids, codes = prompt(1)
    config = CompileConfig(fullgraph=True, dynamic=False, backend="eager", mode=None) if compiled else None
    run = DecodeRun.prefilled(model, ids[None].to(device), codes[None].to(device),
                              torch.ones(1, ids.shape[0], dtype=torch.long, device=device), None,
                              torch.tensor([8], device=device), compile_config=config)
    run.cache.open_window(run.cache.backbone_part, 1)
    return run


def row(model):
    """One row to feed: main_ids [1], frames [1, num_codebooks], on the model's device."""
    frames = torch.arange(1, 1 + model.config.num_codebooks)[None] % model.config.codebook_size
    main_ids = torch.full((1,), model.config.semantic_start_token_id + 3)
    return main_ids.to(model.device), frames.to(model.device)


def linear_states(cache):
    return [t for layer in cache.backbone.layers if hasattr(layer, "recurrent_states")
            for t in (layer.conv_states[0], layer.recurrent_states[0])]


def test_a_decode_row_through_the_ops_equals_the_row_through_the_references(monkeypatch):
    model = tiny_model(seed=0)
    references, kernels = prefilled_run(model, False), prefilled_run(model, False)
    with torch.no_grad():
        expected = decode_step.feed(model, references.cache, references.state, *row(model))
        ops_serve_cpu_rows(monkeypatch)
        calls = []
        for module, name in ((short_conv, "short_conv_update"), (recurrent_decode, "gated_delta_rule_decode")):
            original = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _f=original, **k: calls.append(_f.__name__) or _f(*a, **k))
        got = decode_step.feed(model, kernels.cache, kernels.state, *row(model))
    linear_layers = sum(kind == "linear_attention" for kind in model.config.text_config.layer_types)
    assert sorted(calls) == ["gated_delta_rule_decode"] * linear_layers + ["short_conv_update"] * linear_layers
    torch.testing.assert_close(got.hidden, expected.hidden)
    for ours, theirs in zip(linear_states(kernels.cache), linear_states(references.cache), strict=True):
        torch.testing.assert_close(ours, theirs)


def test_the_compiled_feed_with_the_ops_is_one_capturable_graph(monkeypatch):
    model = tiny_model(seed=0)
    run = prefilled_run(model, True)
    ops_serve_cpu_rows(monkeypatch)
    with capturable_experts(model):  # float32 experts: as `compiled_functions` calls the step
        report = check_capturable(decode_step.feed, model, run.cache, run.state, *row(model))
    linear_layers = sum(kind == "linear_attention" for kind in model.config.text_config.layer_types)
    assert report.op_counts[RECURRENT_OP] == linear_layers
    assert "aten.convolution.default" not in report.op_counts  # the short conv went through its op


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_feed_runs_the_ops_and_equals_the_eager_feed():
    model = tiny_model(seed=0).cuda()
    eager, compiled = prefilled_run(model, False), prefilled_run(model, True)
    report = capture_report(decode_step.feed, model, prefilled_run(model, True).cache, compiled.state, *row(model))
    assert report.capturable and report.op_counts[RECURRENT_OP] > 0, report.problems()
    with torch.no_grad():
        expected = decode_step.feed(model, eager.cache, eager.state, *row(model))
        got = torch.compile(decode_step.feed, fullgraph=True, dynamic=False)(model, compiled.cache, compiled.state, *row(model))
    torch.testing.assert_close(got.hidden, expected.hidden, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(linear_states(compiled.cache), linear_states(eager.cache), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- MoE experts: grouped GEMM


def backbone_experts(model):
    return [module for module in model.modules() if type(module).__name__ == "Qwen3_5MoeExperts"]


def test_the_backbone_experts_run_grouped_mm_by_default(bundled_tiny):
    for model in (tiny_model(seed=0), bundled_tiny[0]):
        experts = backbone_experts(model)
        assert experts and {e.config._experts_implementation for e in experts} == {"grouped_mm"}
        assert model.config.text_config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("rows", [1, 23], ids=["decode-row", "prefill"])
def test_grouped_mm_experts_equal_the_eager_experts(rows):
    model = tiny_model(seed=0)
    experts = backbone_experts(model)[0]
    g = generator(10)
    hidden = torch.randn(rows, model.config.text_config.hidden_size, generator=g)
    top_k = model.config.text_config.num_experts_per_tok
    chosen = torch.rand(rows, model.config.text_config.num_experts, generator=g).topk(top_k, dim=-1)
    weights = torch.softmax(chosen.values, dim=-1)
    with torch.no_grad():
        grouped = experts(hidden, chosen.indices, weights)
        model.model.language_model.set_experts_implementation("eager")
        eager = experts(hidden, chosen.indices, weights)
    torch.testing.assert_close(grouped, eager)


def test_the_model_forward_with_grouped_mm_equals_eager_experts():
    model = tiny_model(seed=0)
    ids, codes = prompt(2)
    with torch.no_grad():
        grouped = model(ids[None], codes[None]).logits
        model.model.language_model.set_experts_implementation("eager")
        eager = model(ids[None], codes[None]).logits
    torch.testing.assert_close(grouped, eager)


def test_the_compiled_feed_in_bfloat16_holds_the_grouped_gemm_and_is_capturable():
    """In bfloat16 a compiled step runs torch's grouped GEMM (`aten._grouped_mm`); in float32
    transformers replaces it under torch.compile by its own fallback op (a loop over the experts)."""
    model = tiny_model(seed=0).to(torch.bfloat16)
    run = prefilled_run(model, True)
    report = check_capturable(decode_step.feed, model, run.cache, run.state, *row(model))
    moe_layers = len(backbone_experts(model))
    grouped = sum(count for name, count in report.op_counts.items() if name.startswith("aten._grouped_mm"))
    assert grouped == 2 * moe_layers  # gate-up and down projections of each MoE layer


def test_drama3_takes_experts_implementation_and_hands_it_on_to_its_backbone():
    """transformers refuses `experts_implementation` for a model whose own module defines no experts;
    Drama 3's models (`PreTrainedModelWithComposedExperts`) take it for the backbone they compose."""
    from transformers_drama3 import Drama3ForSpeechGeneration
    from transformers_drama3.tiny import shipped

    if not shipped.is_available():
        pytest.skip("this checkout carries no drama3-tiny weights")
    assert issubclass(Drama3ForSpeechGeneration, PreTrainedModelWithComposedExperts)
    model = Drama3ForSpeechGeneration.from_pretrained(shipped.TINY_MODEL_PATH, experts_implementation="grouped_mm")
    assert model.get_experts_implementation()["text_config"] == "grouped_mm"
    model.set_experts_implementation("eager")
    assert {e.config._experts_implementation for e in backbone_experts(model)} == {"eager"}
    model.set_experts_implementation("grouped_mm")
    assert {e.config._experts_implementation for e in backbone_experts(model)} == {"grouped_mm"}


def test_the_experts_implementation_hook_is_checked_by_name(monkeypatch):
    from transformers import PreTrainedModel

    check_experts_implementation_hook()
    monkeypatch.setattr(PreTrainedModel, "_can_set_experts_implementation", staticmethod(lambda: True))
    with pytest.raises(InternalsChanged, match=r"PreTrainedModel\._can_set_experts_implementation: expected a classmethod"):
        PreTrainedModelWithComposedExperts._can_set_experts_implementation()
